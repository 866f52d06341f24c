"""Runs that cannot be lost: --overwrite keeps the old run until the new one has finished a step, a run folder that
disappears stops the run, --resume refuses a run folder without its config and a silent change of what is trained,
and a damaged `latest` pointer or metrics line is found before the model loads.

The fixtures are test_rundir's: `earlier_run` (a finished 2-step run, written without training), `no_model_load`
(any model load fails the test), and the tiny end-to-end runs.
"""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from logitless.cli import main
from logitless.trainer import checkpoint as ckpt
from logitless.trainer import loop as loop_mod
from logitless.trainer.config.schema import load_train_config, to_yaml
from logitless.trainer.report.metrics import read_metrics
from logitless.trainer.rundir import LOCK_FILE, RunDirError, claim_run_dir
from logitless.trainer.config.files import current_config
from tests.test_cli import _config, tiny_folder  # noqa: F401  (fixture)
from tests.test_rundir import (  # noqa: F401  (fixtures)
    _cli,
    _e2e_cfg,
    _run_cfg,
    _snapshot,
    _tiny_train,
    earlier_run,
    no_model_load,
    tok,
)

# ---- a YAML config with a key twice


def test_a_config_file_with_a_section_twice_is_refused_before_anything(tmp_path, capsys, no_model_load):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("optim:\n  learning_rate: 0.001\ntrain:\n  max_steps: 3\noptim:\n  weight_decay: 0.1\n")
    code, err = _cli(capsys, "train", str(cfg), f"train.output_dir={tmp_path / 'run'}")
    assert code == 2 and f"config file '{cfg}': line 5 gives 'optim' again (first at line 1)" in err
    assert not (tmp_path / "run").exists()


# ---- --overwrite


def _overwritten(run):
    return [p for p in run.iterdir() if p.name.startswith(".replaced-")]


def test_overwrite_keeps_the_old_run_until_the_new_one_has_finished_a_step(earlier_run, tok):
    run = earlier_run
    old = [r["reward/mean"] for r in read_metrics(run)]
    seen = {}

    def hook(event, step):
        seen[event, step] = [sorted(p.name for p in a.iterdir()) for a in _overwritten(run)]

    result = _tiny_train(_e2e_cfg(run, "train.max_steps=2"), tok, overwrite=True, hook=hook)
    assert result.step == 2 and [r["step"] for r in read_metrics(run)] == [1, 2]
    assert [r["reward/mean"] for r in read_metrics(run)] != old  # the new run's records
    # during step 1 the old run (config, metrics, checkpoint) waited aside; deleted once step 1 was done
    assert seen["step_start", 1] == seen["after_update", 1] == [["checkpoints", "config.yaml", "metrics.jsonl"]]
    assert seen["step_start", 2] == []
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "checkpoints", "config.yaml", "metrics.jsonl",
                                                     "resolved.json"]


def test_overwrite_puts_the_old_run_back_when_the_new_one_fails_before_its_first_step(earlier_run, tmp_path, tok):
    before = _snapshot(earlier_run)

    def hook(event, step):
        if event == "after_rollout":
            raise ValueError("a check after the model load fails")

    cfg = _e2e_cfg(earlier_run, "train.max_steps=2")
    with pytest.raises(ValueError, match="a check after the model load"), \
            pytest.warns(UserWarning, match=rf"the run it was to replace is back in {earlier_run}, as it was"):
        _tiny_train(cfg, tok, overwrite=True, hook=hook)
    assert _snapshot(earlier_run) == before and not _overwritten(earlier_run)


def test_a_killed_overwrite_is_put_back_by_the_next_claim(earlier_run):
    before = _snapshot(earlier_run)
    run = claim_run_dir(_run_cfg(earlier_run, "train.max_steps=4"), overwrite=True)
    (earlier_run / "config.yaml").write_text("the new run's config\n")  # the new run had started writing
    os.close(run._fd)  # the process dies: its lock goes, nothing is put back
    assert [p.name for p in _overwritten(earlier_run)] and (earlier_run / "config.yaml").read_text() != ""
    with pytest.warns(UserWarning) as said:
        claim_run_dir(_run_cfg(earlier_run, "train.max_steps=4"), resume=earlier_run).release()
    said = [str(w.message) for w in said]
    assert len(said) == 2 and "taking over the stale lock" in said[0]
    assert "an earlier --overwrite of this folder stopped before its new run finished a step" in said[1]
    assert _snapshot(earlier_run) == before and not _overwritten(earlier_run)


# ---- the run folder removed while training


def test_a_run_folder_removed_while_training_stops_the_run_loudly(tmp_path, tiny_folder, capsys, monkeypatch):
    cfg = _config(tmp_path, tiny_folder, max_steps=2)
    run = tmp_path / "run"
    real = loop_mod.update_stage

    def update_then_remove(ctx, plan, oldref):
        out = real(ctx, plan, oldref)
        shutil.rmtree(run)  # the user deletes the run folder during step 1
        return out

    monkeypatch.setattr(loop_mod, "update_stage", update_then_remove)
    code = main(["train", str(cfg)])
    out, err = capsys.readouterr()
    assert code == 1 and "done" not in out
    assert f"error: the run folder {run} (train.output_dir) was removed (or moved away) while the run was training; " \
           "stopping now" in err
    assert not run.exists()  # nothing written afterwards (no checkpoint recreated the folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_run_folder_made_read_only_stops_the_run(tmp_path, tok):
    run = tmp_path / "run"

    def hook(event, step):
        if event == "after_update" and step == 2:  # step 1's checkpoint was saved
            run.chmod(0o555)

    try:
        with pytest.raises(RunDirError, match=rf"the run folder {run} .*is no longer writable.*make it writable again "
                                              rf".*checkpoint step-000001 with: logitless train --resume {run}"):
            _tiny_train(_e2e_cfg(run), tok, hook=hook)
    finally:
        run.chmod(0o755)


# ---- --resume and the run's config


def test_resume_of_a_folder_without_its_config_is_refused(earlier_run, capsys, no_model_load):
    (earlier_run / "config.yaml").unlink()
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", "--resume", str(earlier_run), "train.max_steps=4")
    assert code == 2 and f"{earlier_run} has no config.yaml (the config the run was started with)" in err
    assert f"cp {earlier_run / 'checkpoints' / 'step-000002' / 'config.yaml'} {earlier_run / 'config.yaml'}" in err
    assert f"logitless train CONFIG.yaml --resume {earlier_run}" in err
    shutil.rmtree(earlier_run / "checkpoints")
    code, err = _cli(capsys, "train", "--resume", str(earlier_run))
    assert code == 2 and "has no config.yaml" in err and " cp " not in err
    assert _snapshot(earlier_run) == {k: v for k, v in before.items() if not k.startswith("checkpoints/")}
    code, err = _cli(capsys, "eval", "--checkpoint", str(earlier_run))  # nor a checkpoint to take a copy from
    assert code == 2 and "has no config.yaml" in err


def test_eval_of_a_checkpoint_without_the_run_config_uses_its_copy(earlier_run, no_model_load):
    (earlier_run / "config.yaml").unlink()
    with pytest.raises(AssertionError, match="model was loaded"):  # past every check: the copy was taken
        main(["eval", "--checkpoint", str(earlier_run), "data.eval_options={n: 10}"])


def test_resume_with_a_changed_learning_rate_needs_the_flag(earlier_run, capsys, no_model_load):
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", "--resume", str(earlier_run), "optim.learning_rate=0.001",
                     "train.max_steps=4", "logging.logging_steps=2")
    assert code == 1 and "this config changes what the run trains" in err
    assert "optim.learning_rate: 1e-05 -> 0.001" in err and "logging_steps" not in err  # logging may change freely
    assert "add --allow-config-change" in err and "config.from-step-000003.yaml" in err
    assert _snapshot(earlier_run) == before
    with pytest.raises(AssertionError, match="model was loaded"):  # allowed: the run goes on to load the model
        main(["train", "--resume", str(earlier_run), "optim.learning_rate=0.001", "train.max_steps=4",
              "--allow-config-change"])
    assert _snapshot(earlier_run) == before  # nothing is written before the model loads


def test_an_allowed_change_keeps_the_config_and_saves_the_new_one_beside_it(tmp_path, tok):
    run = tmp_path / "run"
    _tiny_train(_e2e_cfg(run, "train.max_steps=1"), tok)
    original = (run / "config.yaml").read_text()
    changed = _e2e_cfg(run, "train.max_steps=2", "optim.learning_rate=0.001")
    with pytest.raises(RunDirError, match=r"optim.learning_rate: 1e-05 -> 0.001"):
        _tiny_train(changed, tok, resume=run)
    result = _tiny_train(changed, tok, resume=run, allow_config_change=True)
    assert result.step == 2 and (run / "config.yaml").read_text() == original
    saved = load_train_config(run / "config.from-step-000002.yaml")
    assert saved.optim.learning_rate == 0.001 and current_config(run).name == "config.from-step-000002.yaml"
    assert result.records[0]["learning_rate"] == 0.001
    copy = yaml.safe_load((run / "checkpoints" / "step-000002" / "config.yaml").read_text())
    assert copy["optim"]["learning_rate"] == 0.001  # the checkpoint says what its weights were trained with
    # the next resume compares with the newest config: the same settings need no flag
    with claim_run_dir(_e2e_cfg(run, "train.max_steps=4", "optim.learning_rate=0.001"), resume=run) as again:
        assert again.config_file == run / "config.from-step-000002.yaml"  # max_steps updated in place there


def test_which_keys_may_change_on_resume():
    from logitless.trainer.config.files import changes_training

    cfg = load_train_config()
    assert not changes_training("train.max_steps", cfg)  # constant schedule: only how long the run goes
    assert changes_training("train.max_steps", load_train_config(None, ["optim.lr_scheduler_type=cosine"]))
    assert changes_training("train.max_steps", load_train_config(None, ["optim.warmup_ratio=0.1"]))
    for key in ("logging.logging_steps", "checkpoint.save_steps", "eval.num_prompts", "train.max_minutes"):
        assert not changes_training(key, cfg)
    for key in ("optim.learning_rate", "rollout.temperature", "objective.beta", "data.options.path", "train.seed"):
        assert changes_training(key, cfg)


# ---- damaged files found before the model loads


def test_an_undecodable_latest_pointer_falls_back_with_a_warning(earlier_run, capsys, no_model_load):
    (earlier_run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    with pytest.warns(UserWarning, match=r"latest is not a checkpoint name \(undecodable bytes .*Falling back to "
                                         r"step-000002, the newest intact checkpoint"):
        assert ckpt.resolve_checkpoint(earlier_run).name == "step-000002"
    with pytest.raises(AssertionError, match="model was loaded"), pytest.warns(UserWarning, match="undecodable"):
        main(["train", "--resume", str(earlier_run), "train.max_steps=3"])  # the claim resolves it, no utf-8 error


def test_a_damaged_middle_metrics_line_is_found_before_the_model_loads(earlier_run, capsys, no_model_load):
    path = earlier_run / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    code, err = _cli(capsys, "train", "--resume", str(earlier_run), "train.max_steps=4")
    assert code == 1 and f"{path} line 2 is not a JSON record" in err and "fix or delete that line" in err


# ---- a full disk at the last checkpoint, from the command line


def test_a_full_disk_at_the_last_checkpoint_is_one_line(tmp_path, tok, monkeypatch):
    import errno

    real = ckpt._open_for_write

    def full(path):
        if path.parent.name.startswith(ckpt.TMP_PREFIX + "step-000002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path)

    monkeypatch.setattr(ckpt, "_open_for_write", full)
    root = tmp_path / "run" / "checkpoints"
    with pytest.raises(ckpt.CheckpointError) as e:  # the command line prints it as `error: <message>`
        _tiny_train(_e2e_cfg(tmp_path / "run"), tok)
    assert str(e.value) == (
        f"could not write checkpoint step-000002 in {root}: No space left on device (ENOSPC). The previous "
        "checkpoint step-000001 is still the latest. Free space on that disk (or lower checkpoint.save_total_limit).")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]


def test_the_saved_config_is_not_rewritten_by_an_unchanged_resume(earlier_run):
    text = (earlier_run / "config.yaml").read_text()
    with claim_run_dir(_run_cfg(earlier_run, "train.max_steps=2"), resume=earlier_run) as run:
        assert run.config_file is None  # nothing to write
    with claim_run_dir(_run_cfg(earlier_run, "train.max_steps=5"), resume=earlier_run) as run:
        assert run.config_file == earlier_run / "config.yaml"  # a key that may change freely: updated in place
        run.save_config(run.cfg)
    assert load_train_config(earlier_run / "config.yaml").train.max_steps == 5
    assert to_yaml(load_train_config(earlier_run / "config.yaml")) != text
