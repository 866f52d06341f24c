"""Fault injection at every write and rename of a checkpoint save.

Each fault is raised either as an error the save sees (an OSError: a full disk, an I/O error), as a stop-at-once
signal (a KeyboardInterrupt: the save removes what it wrote, then lets it through) or as a crash (the process dies
there: nothing is cleaned up, a file may be half-written). After each one the previous checkpoint must still be the
latest and load exactly, and the next save must succeed. A crash is followed by what the next run's owner does
first, `clean_temporaries`.
"""

from __future__ import annotations

import errno
import io
import os
import warnings

import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import make_optimizer, make_scheduler
from logitless.trainer.config.schema import ModelConfig, OptimConfig
from logitless.trainer.policy.modeling import prepare_for_training, trainable_parameters
from tests.conftest import tiny_qwen2


class _Crash(BaseException):
    """The process dies here (not an Exception: the save's error handling never sees it)."""


def _fault(mode: str) -> BaseException:
    return {"error": OSError(errno.ENOSPC, "No space left on device"), "interrupt": KeyboardInterrupt()}.get(mode, _Crash())


RAISED = {"error": ckpt.CheckpointError, "interrupt": KeyboardInterrupt, "crash": _Crash}


class _HalfThenFail(io.FileIO):
    """A file that writes half of what it is given, then fails."""

    def __init__(self, path, exc: BaseException):
        super().__init__(path, "wb")
        self.exc = exc

    def write(self, data):
        view = memoryview(data).cast("B")
        super().write(view[: len(view) // 2])
        raise self.exc


def _setup(tmp_path):
    torch.manual_seed(0)
    model = prepare_for_training(tiny_qwen2(vocab_size=96, hidden=32, layers=1), ModelConfig(lora_r=4, lora_alpha=8))
    opt = make_optimizer(trainable_parameters(model), OptimConfig(learning_rate=1e-2))
    sched = make_scheduler(opt, 10, OptimConfig(learning_rate=1e-2))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {lora_r: 4}\n")
    return model, opt, sched, run / "checkpoints"


def _step(model, opt, sched):
    """One optimizer step: the weights (and optimizer state) move on."""
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _lora(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def _save(root, step, model, opt, sched):
    return ckpt.save_checkpoint(root, step, model=model, optimizer=opt, scheduler=sched, trainer_state={"tag": step})


def _assert_latest_loads(root, step: int, weights: dict[str, torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the latest must be intact: no fallback warning
        path = ckpt.resolve_checkpoint(root)
    assert path.name == ckpt.step_dirname(step)
    fresh = prepare_for_training(tiny_qwen2(vocab_size=96, hidden=32, layers=1, seed=5), ModelConfig(lora_r=4, lora_alpha=8))
    state = ckpt.load_checkpoint(root, model=fresh, restore_rng=False)
    assert state["tag"] == step
    loaded = _lora(fresh)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)


def _inject(monkeypatch, model, point: str, exc: BaseException) -> None:
    """Make the save fail at `point`: a file name (written half, then fails), 'model' (save_pretrained leaves a
    half-written adapter), 'rename:tmp' / 'rename:old' (the folder renames), 'replace' (the pointer's replace)."""
    if point == "model":
        real = model.save_pretrained

        def save_pretrained(folder, **kw):
            real(folder, **kw)
            f = os.path.join(folder, "adapter_model.safetensors")
            os.truncate(f, os.path.getsize(f) // 2)
            raise exc

        monkeypatch.setattr(model, "save_pretrained", save_pretrained)
    elif point.startswith("rename:"):
        real_rename, prefix = os.rename, ckpt.TMP_PREFIX if point == "rename:tmp" else ckpt.STEP_PREFIX

        def rename(src, dst, *a, **kw):
            if os.path.basename(src).startswith(prefix):
                raise exc
            return real_rename(src, dst, *a, **kw)

        monkeypatch.setattr(ckpt.os, "rename", rename)
    elif point == "replace":
        def replace(src, dst, *a, **kw):
            raise exc

        monkeypatch.setattr(ckpt.os, "replace", replace)
    else:
        real_open = ckpt._open_for_write
        monkeypatch.setattr(ckpt, "_open_for_write", lambda p: _HalfThenFail(p, exc) if p.name == point else real_open(p))


NEW_STEP_POINTS = ["model", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml", ckpt.MANIFEST, "rename:tmp",
                   "latest.tmp", "replace"]
RESAVE_POINTS = ["rename:old", "rename:tmp", "latest.tmp", "replace"]  # re-saving a step that exists (after a resume)


@pytest.mark.parametrize("mode", ["error", "interrupt", "crash"])
@pytest.mark.parametrize("point", NEW_STEP_POINTS)
def test_fault_while_saving_a_new_step_keeps_the_previous_latest(tmp_path, monkeypatch, point, mode):
    model, opt, sched, root = _setup(tmp_path)
    _save(root, 1, model, opt, sched)
    first = _lora(model)
    _step(model, opt, sched)
    _inject(monkeypatch, model, point, _fault(mode))
    with pytest.raises(RAISED[mode]):
        _save(root, 2, model, opt, sched)
    monkeypatch.undo()
    if mode == "crash":
        ckpt.clean_temporaries(root)  # what the next owner of the run folder does first
    assert sorted(p.name for p in root.iterdir()) in (["latest", "step-000001"],
                                                      ["latest", "step-000001", "step-000002"])  # renamed, no pointer
    _assert_latest_loads(root, 1, first)
    _save(root, 2, model, opt, sched)  # the next save succeeds
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]
    _assert_latest_loads(root, 2, _lora(model))


@pytest.mark.parametrize("mode", ["error", "interrupt", "crash"])
@pytest.mark.parametrize("point", RESAVE_POINTS)
def test_fault_while_re_saving_a_step_keeps_its_previous_version(tmp_path, monkeypatch, point, mode):
    model, opt, sched, root = _setup(tmp_path)
    _save(root, 1, model, opt, sched)
    _step(model, opt, sched)
    _save(root, 2, model, opt, sched)
    second = _lora(model)
    _step(model, opt, sched)  # a resumed run redoes step 2 with other weights
    _inject(monkeypatch, model, point, _fault(mode))
    with pytest.raises(RAISED[mode]):
        _save(root, 2, model, opt, sched)
    monkeypatch.undo()
    if mode == "crash":
        ckpt.clean_temporaries(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]
    if point in ("rename:old", "rename:tmp"):
        _assert_latest_loads(root, 2, second)  # the step's previous version, intact
    else:  # the new version was complete and renamed into place; the pointer named step 2 all along
        _assert_latest_loads(root, 2, _lora(model))
    _save(root, 2, model, opt, sched)
    _assert_latest_loads(root, 2, _lora(model))


def test_a_full_disk_inside_safetensors_is_one_short_line_and_leaves_nothing(tmp_path, monkeypatch):
    """safetensors reports a failed write as its own exception type (not an OSError), the OS error in its text; the
    save names the error in a few words, removes its half-written folder and keeps the previous checkpoint."""
    from safetensors import SafetensorError

    model, opt, sched, root = _setup(tmp_path)
    _save(root, 1, model, opt, sched)
    first = _lora(model)
    _step(model, opt, sched)
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    _inject(monkeypatch, model, "model", full)  # the adapter file is half-written, then the write fails
    with pytest.raises(ckpt.CheckpointError) as e:
        _save(root, 2, model, opt, sched)
    monkeypatch.undo()
    assert str(e.value) == (f"could not write checkpoint step-000002 in {root}: No space left on device (ENOSPC). The "
                            "previous checkpoint step-000001 is still the latest. Free space on that disk (or lower "
                            "checkpoint.save_total_limit).")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # no .tmp folder left
    _assert_latest_loads(root, 1, first)
