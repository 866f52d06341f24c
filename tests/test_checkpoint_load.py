"""Checkpoints that check themselves, on their own (no run folder, no CLI): the manifest, `validate_checkpoint`,
the fallback to the newest intact checkpoint, `clean_temporaries`, pruning around `latest`, the run config and
step a checkpoint carries, weights that do not match the model, and RNG states with a cached Gaussian.

Written to kill the mutants of `logitless/trainer/checkpoint.py` that its fast tests let live (docs/testing.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings

import numpy as np
import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import prepare_for_training
from tests.conftest import tiny_qwen2


def _model(lora: bool = True, seed: int = 0, tie: bool = True):
    model = tiny_qwen2(vocab_size=96, hidden=32, layers=1, seed=seed, tie=tie)
    return prepare_for_training(model, ModelConfig(lora=lora, lora_r=4, lora_alpha=8))


@pytest.fixture(scope="module")
def _three_steps(tmp_path_factory):
    run = tmp_path_factory.mktemp("template") / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {lora_r: 4}\ntrain: {max_steps: 3}\n")
    model = _model()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(run / "checkpoints", step, model=model, optimizer=None, trainer_state={"tag": step})
    return run


@pytest.fixture
def run(_three_steps, tmp_path):
    """A run folder with checkpoints step-000001..3 (latest: 3) and a config.yaml; a fresh copy per test."""
    shutil.copytree(_three_steps, tmp_path / "run")
    return tmp_path / "run"


def _no_warning_resolve(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return ckpt.resolve_checkpoint(path)


def _flip_last_byte(f):
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


# ---- the manifest and validate_checkpoint


def test_manifest_lists_every_other_file_with_its_size_and_sha256(run):
    step = run / "checkpoints" / "step-000003"
    manifest = json.loads((step / ckpt.MANIFEST).read_text())
    files = sorted(p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST)
    assert sorted(manifest) == files
    assert {"optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml", "model/adapter_model.safetensors"} <= set(files)
    for rel, entry in manifest.items():
        data = (step / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert (step / "config.yaml").read_text() == (run / "config.yaml").read_text()


def test_validate_checkpoint_names_what_is_wrong(run):
    step = run / "checkpoints" / "step-000003"
    assert ckpt.validate_checkpoint(step) is None
    size = (step / "rng.pt").stat().st_size
    _flip_last_byte(step / "rng.pt")  # same size, other bytes
    assert ckpt.validate_checkpoint(step) == f"{step / 'rng.pt'} does not match its checksum in manifest.json (corrupted)"
    (step / "rng.pt").write_bytes(b"x" * (size - 1))
    assert ckpt.validate_checkpoint(step) == (f"{step / 'rng.pt'} has {size - 1} bytes, the manifest says {size} "
                                              "(truncated or overwritten)")
    (step / "rng.pt").unlink()
    assert ckpt.validate_checkpoint(step) == f"{step / 'rng.pt'} is missing"
    (step / ckpt.MANIFEST).write_text("{not json")
    assert ckpt.validate_checkpoint(step).startswith(f"{step / ckpt.MANIFEST} is unreadable (")
    (step / ckpt.MANIFEST).unlink()  # written before manifests existed: only trainer_state.json is checked
    assert ckpt.validate_checkpoint(step) is None
    (step / "trainer_state.json").unlink()
    assert ckpt.validate_checkpoint(step) == f"{step / 'trainer_state.json'} is missing"


def test_a_damaged_file_deep_in_the_manifest_is_found(run):
    """Every entry is checked, not only the first one."""
    step = run / "checkpoints" / "step-000003"
    last = sorted(json.loads((step / ckpt.MANIFEST).read_text()))[-1]
    _flip_last_byte(step / last)
    assert ckpt.validate_checkpoint(step) == f"{step / last} does not match its checksum in manifest.json (corrupted)"


# ---- resolving: latest, or the newest intact one


def test_resolve_takes_latest_even_when_a_newer_folder_exists(run):
    root = run / "checkpoints"
    (root / "latest").write_text("step-000002\n")
    assert _no_warning_resolve(run) == root / "step-000002"
    assert _no_warning_resolve(root) == root / "step-000002"
    assert ckpt.read_latest(root) == root / "step-000002"


def test_damaged_latest_falls_back_to_the_newest_intact_checkpoint(run):
    root = run / "checkpoints"
    _flip_last_byte(root / "step-000003" / "optimizer.pt")
    (root / "step-000002" / "rng.pt").write_bytes(b"")
    with pytest.warns(UserWarning) as record:
        assert ckpt.resolve_checkpoint(run) == root / "step-000001"
    assert len(record) == 1
    msg = str(record[0].message)
    assert msg.startswith(f"--resume {root}: the latest checkpoint is damaged: {root / 'latest'} names 'step-000003', "
                          "which is not a complete checkpoint: ")
    assert "step-000003/optimizer.pt does not match its checksum" in msg
    assert "; " + f"{root / 'step-000002' / 'rng.pt'} has 0 bytes" in msg
    assert msg.endswith("Falling back to step-000001, the newest intact checkpoint.")
    # stacklevel: the warning points at the caller of resolve_checkpoint, not into the library (under mutmut, whose
    # trampolines add frames, only the second half holds)
    assert record[0].filename != ckpt.__file__
    assert record[0].filename == __file__ or "MUTANT_UNDER_TEST" in os.environ


def test_latest_naming_a_missing_folder_or_empty_falls_back(run):
    root = run / "checkpoints"
    (root / "latest").write_text("step-000009")
    with pytest.warns(UserWarning, match=rf"names 'step-000009', which is not a complete checkpoint: "
                                         rf"{root / 'step-000009'} does not exist\. Falling back to step-000003"):
        assert ckpt.resolve_checkpoint(root, flag="--checkpoint") == root / "step-000003"
    (root / "latest").write_text("  \n")
    with pytest.warns(UserWarning, match=rf"--checkpoint {root}: .*{root / 'latest'} is empty\. Falling back to step-000003"):
        assert ckpt.resolve_checkpoint(root, flag="--checkpoint") == root / "step-000003"
    with pytest.raises(ckpt.CheckpointError, match=rf"{root / 'latest'} is empty"):
        ckpt.read_latest(root)


def test_no_pointer_takes_the_newest_intact_folder_without_warning(run):
    root = run / "checkpoints"
    (root / "latest").unlink()
    assert ckpt.read_latest(root) is None
    assert _no_warning_resolve(run) == root / "step-000003"
    (root / "step-000003" / "trainer_state.json").unlink()
    with pytest.warns(UserWarning, match="damaged: .*step-000003/trainer_state.json is missing.*Falling back to step-000002"):
        assert ckpt.resolve_checkpoint(run) == root / "step-000002"


def test_no_intact_checkpoint_is_an_error_listing_every_problem(run):
    root = run / "checkpoints"
    for step in (1, 2, 3):
        (root / ckpt.step_dirname(step) / "rng.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resolve_checkpoint(run, flag="--checkpoint")
    msg = str(err.value)
    assert msg.startswith(f"--checkpoint {str(root)!r}: no intact checkpoint: {root / 'latest'} names 'step-000003'")
    assert [s for s in ("step-000003", "step-000002", "step-000001") if f"{s}/rng.pt has 0 bytes" in msg] == \
        ["step-000003", "step-000002", "step-000001"]
    assert msg.count("step-000003/rng.pt") == 1  # the latest one is checked once


def test_load_from_a_fallback_loads_that_checkpoint(run):
    root = run / "checkpoints"
    _flip_last_byte(root / "step-000003" / "model" / "adapter_model.safetensors")
    with pytest.warns(UserWarning, match="Falling back to step-000002"):
        state = ckpt.load_checkpoint(run, model=_model(seed=4), restore_rng=False)
    assert state["tag"] == 2 and state["step"] == 2


# ---- clean_temporaries and prune


def test_clean_temporaries_restores_a_moved_aside_step_and_removes_the_rest(run):
    root = run / "checkpoints"
    os.rename(root / "step-000003", root / ".old-step-000003-77")
    shutil.copytree(root / "step-000002", root / ".old-step-000002-77")  # its step exists: just a leftover
    (root / ".tmp-step-000004-77").mkdir()
    (root / "latest.tmp").write_text("step-000004")
    (root / ".tmp-file").write_text("x")
    assert ckpt.clean_temporaries(root) == [".old-step-000002-77", ".old-step-000003-77 (restored as step-000003)",
                                            ".tmp-file", ".tmp-step-000004-77", "latest.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002", "step-000003"]
    assert _no_warning_resolve(run) == root / "step-000003"
    assert ckpt.clean_temporaries(root) == []
    assert ckpt.clean_temporaries(run / "nowhere") == []


def test_clean_temporaries_drops_a_damaged_moved_aside_step(run):
    root = run / "checkpoints"
    os.rename(root / "step-000003", root / ".old-step-000003-77")
    (root / ".old-step-000003-77" / "rng.pt").write_bytes(b"")
    assert ckpt.clean_temporaries(root) == [".old-step-000003-77"]
    assert not (root / "step-000003").exists()


def test_prune_never_deletes_the_checkpoint_latest_names(run):
    root = run / "checkpoints"
    (root / "latest").write_text("step-000001")
    ckpt.prune(root, 1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000003"]
    ckpt.prune(root, 0)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]


def test_save_with_keep_prunes_after_writing(run):
    root = run / "checkpoints"
    path = ckpt.save_checkpoint(root, 4, model=_model(), optimizer=None, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003", "step-000004"]
    assert ckpt.read_latest(root) == path


# ---- what a checkpoint carries


def test_checkpoint_config_and_step(run):
    step = run / "checkpoints" / "step-000002"
    assert ckpt.checkpoint_config(step) == {"model": {"lora_r": 4}, "train": {"max_steps": 3}}
    assert ckpt.checkpoint_step(step) == 2
    (run / "config.yaml").write_text("model: {lora_r: 8}\n")  # the copy in the checkpoint wins
    assert ckpt.checkpoint_config(step) == {"model": {"lora_r": 4}, "train": {"max_steps": 3}}
    (step / "config.yaml").unlink()  # an older checkpoint: the run folder's config
    assert ckpt.checkpoint_config(step) == {"model": {"lora_r": 8}}
    (run / "config.yaml").write_text("- a list\n")
    assert ckpt.checkpoint_config(step) is None
    (run / "config.yaml").write_text("model: {lora_r: [\n")
    with pytest.raises(ckpt.CheckpointError, match=rf"{run / 'config.yaml'} is not valid YAML"):
        ckpt.checkpoint_config(step)
    (run / "config.yaml").unlink()
    assert ckpt.checkpoint_config(step) is None
    (step / "trainer_state.json").write_text('{"tag": 2}')
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state.json is unreadable \(KeyError: 'step'\)"):
        ckpt.checkpoint_step(step)


def test_weights_that_do_not_match_the_model_are_refused(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=rf"no \.safetensors weights in {tmp_path}"):
        ckpt.load_model_weights(_model(), tmp_path)

    full = _model(lora=False, tie=False)
    ckpt.save_checkpoint(tmp_path / "full", 1, model=full, optimizer=None)
    folder = tmp_path / "full" / "step-000001" / "model"
    fresh = _model(lora=False, seed=2, tie=False)
    ckpt.load_model_weights(fresh, folder)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), fresh.state_dict().values()))
    two_layers = prepare_for_training(tiny_qwen2(vocab_size=96, hidden=32, layers=2, tie=False), ModelConfig(lora=False))
    with pytest.raises(ckpt.CheckpointError, match=r"do not match the model: missing \['model.layers.1"):
        ckpt.load_model_weights(two_layers, folder)


def test_a_tied_full_model_loads_without_its_lm_head(tmp_path):
    tied = _model(lora=False, tie=True)
    ckpt.save_checkpoint(tmp_path, 1, model=tied, optimizer=None)
    fresh = _model(lora=False, seed=2, tie=True)
    ckpt.load_model_weights(fresh, tmp_path / "step-000001" / "model")
    assert torch.equal(fresh.lm_head.weight, tied.lm_head.weight)
    assert fresh.lm_head.weight.data_ptr() == fresh.get_input_embeddings().weight.data_ptr()


def test_rng_states_with_a_cached_gaussian_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    random.gauss(0, 1)  # python and numpy now hold the second value of a Box-Muller pair
    np.random.standard_normal()
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    ckpt.save_checkpoint(tmp_path, 1, model=_model(), optimizer=None)
    expected = (random.gauss(0, 1), float(np.random.standard_normal()), random.random(), float(np.random.rand()))
    random.seed(9)
    np.random.seed(9)
    ckpt.load_checkpoint(tmp_path, model=_model(seed=1))
    got = (random.gauss(0, 1), float(np.random.standard_normal()), random.random(), float(np.random.rand()))
    assert got == expected
    state = json.loads((tmp_path / "step-000001" / "trainer_state.json").read_text())
    assert state["step"] == 1 and set(state["rng"]) == {"python", "numpy"}


# ---- saving into a new folder, a first save that fails, what loading refuses


def test_first_save_creates_its_folders_and_keeps_only_the_adapter(tmp_path):
    root = tmp_path / "a" / "b" / "checkpoints"
    path = ckpt.save_checkpoint(root, 1, model=_model(), optimizer=None)
    assert ckpt.read_latest(root) == path
    from safetensors.torch import load_file

    keys = list(load_file(str(path / "model" / "adapter_model.safetensors")))
    assert keys and all("lora_" in k for k in keys), keys  # no embedding layers saved with the adapter


def test_a_first_save_that_fails_says_there_is_no_earlier_checkpoint(tmp_path, monkeypatch):
    import errno

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_open_for_write", full)
    with pytest.raises(ckpt.CheckpointError, match=r"No space left on device \(ENOSPC\)\. No earlier checkpoint exists\. "
                                                         r"Free space on that disk"):
        ckpt.save_checkpoint(tmp_path, 1, model=_model(), optimizer=None)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_step_folder_given_directly_is_an_error(run):
    step = run / "checkpoints" / "step-000002"
    _flip_last_byte(step / "rng.pt")
    with pytest.raises(ckpt.CheckpointError, match=rf"^--resume {str(step)!r}: damaged checkpoint: .*rng.pt does not "
                                                   "match its checksum.*give the run folder"):
        ckpt.resolve_checkpoint(step)
    (step / "trainer_state.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="damaged checkpoint: .*trainer_state.json is missing"):
        ckpt.resolve_checkpoint(step)
    (run / "checkpoints" / "latest").write_text("step-000002")
    with pytest.raises(ckpt.CheckpointError, match="names 'step-000002', which is not a complete checkpoint"):
        ckpt.read_latest(run / "checkpoints")


def test_loading_refuses_pickled_objects_beyond_tensors(run):
    """torch.load(weights_only=True): a checkpoint file holding an arbitrary Python object is not unpickled."""
    step = run / "checkpoints" / "step-000003"
    (step / ckpt.MANIFEST).unlink()  # not caught by a checksum: by the loader itself
    torch.save({"optimizer": None, "scheduler": None, "extra": ckpt.CheckpointError("x")}, step / "optimizer.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.pt is damaged or unreadable \(UnpicklingError"):
        ckpt.load_checkpoint(step, model=_model(seed=2), restore_rng=False)
    step = run / "checkpoints" / "step-000002"
    (step / ckpt.MANIFEST).unlink()
    torch.save({"torch": torch.get_rng_state(), "extra": ckpt.CheckpointError("x")}, step / "rng.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"rng.pt is damaged or unreadable \(UnpicklingError"):
        ckpt.load_checkpoint(step, model=_model(seed=2))


def test_a_leftover_that_cannot_be_removed_never_fails_a_save(run, monkeypatch):
    """Removing an old version (re-save) or a pruned step is best effort: a busy file there (NFS, an open handle on
    another host) leaves the folder behind but the save succeeds. Simulated with an rmtree that fails unless told
    to ignore errors, as shutil's does on such a file."""
    import errno

    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kw):
        if ignore_errors:
            return None  # the folder stays
        raise OSError(errno.EBUSY, "Device or resource busy", str(path))

    root = run / "checkpoints"
    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    path = ckpt.save_checkpoint(root, 3, model=_model(seed=1), optimizer=None, keep=1)  # a re-save, then a prune
    monkeypatch.setattr(ckpt.shutil, "rmtree", real)
    assert ckpt.read_latest(root) == path and ckpt.validate_checkpoint(path) is None
    assert (root / "step-000001").is_dir() and (root / "step-000002").is_dir()  # not removed, no error


def test_a_checkpoint_folder_under_another_name_resolves_to_itself(run):
    """A folder holding trainer_state.json is a checkpoint, whatever its name (a copy named 'best', say)."""
    best = run / "best"
    shutil.copytree(run / "checkpoints" / "step-000002", best)
    assert _no_warning_resolve(best) == best
    assert ckpt.load_checkpoint(best, model=_model(seed=2), restore_rng=False)["tag"] == 2


def test_an_adapter_with_weights_the_model_lacks_is_refused(run):
    from safetensors.torch import load_file, save_file

    step = run / "checkpoints" / "step-000001"
    f = step / "model" / "adapter_model.safetensors"
    sd = load_file(str(f))
    sd["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
    save_file(sd, str(f))
    with pytest.raises(ckpt.CheckpointError, match=r"adapter weights in .* do not match the model: unexpected \["
                                                   r"'base_model.model.model.layers.7"):
        ckpt.load_model_weights(_model(), step / "model")
