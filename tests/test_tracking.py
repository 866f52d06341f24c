"""Experiment trackers (logging.report_to): what TensorBoard, W&B (offline) and Trackio (local store) hold after a
real run is read back and must equal metrics.jsonl, name for name and step for step, with the run's config."""

from __future__ import annotations

import json
import math
import sys

import pytest

from logitless.trainer.report import tracking
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from logitless.trainer.preflight import validate_config
from tests.conftest import tiny_qwen2
from tests.readback import tensorboard_scalars, tensorboard_text, wandb_history

VOCAB = 50_257
QUIET = ("model.lora_r=4", "model.lora_alpha=8", "logging.progress=false", "logging.log_completions=false",
         "logging.plot=false")


def _cfg(run_dir, *overrides):
    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=3", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "rollout.num_generations=4", "rollout.max_completion_length=4", "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[numeric_answer, length_target]", "reward.reward_options={length_target: {target: 20}}",
        "optim.learning_rate=0.05", "checkpoint.save_steps=2", "checkpoint.save_total_limit=null", *QUIET,
        *overrides,
    ])


@pytest.fixture(scope="module")
def tok(gpt2_tokenizer_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir))
    t.pad_token, t.padding_side = t.eos_token, "left"
    return t


def _flush_wandb():
    """Shut W&B's service process down: run.finish() returns before the service has written an offline run's last
    records; teardown waits for it (as the interpreter's exit does)."""
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def _isolate_trackers(mp, tmp):
    """W&B offline and silent; Trackio's store in `tmp` (also when trackio was imported before)."""
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_DISABLE_GIT", "true")
    mp.setenv("TRACKIO_DIR", str(tmp / "trackio"))
    for name, module in list(sys.modules.items()):
        if name.startswith("trackio") and hasattr(module, "TRACKIO_DIR"):
            mp.setattr(module, "TRACKIO_DIR", tmp / "trackio")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tok, one_thread):
    """One 3-step run reporting to every installed tracker."""
    tmp = tmp_path_factory.mktemp("tracked")
    names = [t for t in tracking.TRACKERS if tracking.installed(t)]
    with pytest.MonkeyPatch.context() as mp:
        _isolate_trackers(mp, tmp)
        cfg = _cfg(tmp / "run", f"logging.report_to=[{', '.join(names)}]", "logging.project=logitless-test",
                   "logging.run_name=tracked", "logging.tracker_options={trackio: {auto_log_cpu: false}}")
        result = train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok)
        _flush_wandb()
        trackio_logs = trackio_config = None
        if "trackio" in names:
            from trackio.sqlite_storage import SQLiteStorage

            trackio_logs = SQLiteStorage.get_logs("logitless-test", "tracked")
            trackio_config = SQLiteStorage.get_run_config("logitless-test", "tracked")
    records = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"run": tmp / "run", "cfg": cfg, "result": result, "records": records, "trackio": trackio_logs,
            "trackio_config": trackio_config}


def _expected(records):
    """{step: {name: value}}: the numbers of each metrics.jsonl record (null = a non-finite value is not logged)."""
    return {r["step"]: {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float))
                        and not isinstance(v, bool)} for r in records}


def _assert_same(got, want, rel):
    assert sorted(got) == sorted(want)  # the same steps
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), step  # the same names
        for k, v in want[step].items():
            assert got[step][k] == pytest.approx(v, rel=rel, abs=1e-30), (step, k)


def test_records_have_metrics_worth_checking(tracked_run):
    records = tracked_run["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(len(_expected([r])[r["step"]]) > 20 for r in records)
    assert records[0]["reward/length_target/mean"] != records[1]["reward/length_target/mean"]  # values move


def test_tensorboard_holds_the_jsonl_metrics_and_the_config(tracked_run):
    folder = tracked_run["run"] / "tensorboard"
    by_tag = tensorboard_scalars(folder)
    got: dict[int, dict[str, float]] = {}
    for tag, points in by_tag.items():
        for step, v in points.items():
            got.setdefault(step, {})[tag] = v
    _assert_same(got, _expected(tracked_run["records"]), rel=1e-6)  # TensorBoard stores float32
    text = tensorboard_text(folder, "config/text_summary")
    assert "max_steps: 3" in text and "report_to:" in text


def test_wandb_offline_run_holds_the_jsonl_metrics_and_the_config(tracked_run):
    pytest.importorskip("wandb")
    run_dir = tracked_run["run"]
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    state = json.loads((run_dir / "trackers.json").read_text())
    assert files[0].name == f"run-{state['wandb']['id']}.wandb"
    history, config = wandb_history(files[0])
    _assert_same(history, _expected(tracked_run["records"]), rel=0)  # JSON doubles: exact
    assert config["train"]["max_steps"] == 3 and config["logging"]["report_to"] == tracked_run["cfg"].logging.report_to
    assert config["reward"]["reward_funcs"] == ["numeric_answer", "length_target"]


def test_trackio_local_store_holds_the_jsonl_metrics_and_the_config(tracked_run):
    pytest.importorskip("trackio")
    got = {}
    for row in tracked_run["trackio"]:
        got[row["step"]] = {k: v for k, v in row.items() if k not in ("step", "timestamp")}
    _assert_same(got, _expected(tracked_run["records"]), rel=0)
    config = tracked_run["trackio_config"]
    assert config["train"]["max_steps"] == 3 and config["model"]["lora_r"] == 4


def test_nan_metrics_are_left_out_everywhere(tracked_run):
    """A null in metrics.jsonl (a non-finite value) is logged by no tracker; `scalars` keeps exactly the numbers."""
    record = {"step": 4, "a": 1.5, "b": None, "c": math.nan, "d": math.inf, "e": 3, "f": True, "g": "text"}
    assert tracking.scalars(record) == {"a": 1.5, "e": 3}


def test_resume_continues_the_same_wandb_run_and_tensorboard_drops_later_events(tmp_path, tok, one_thread):
    pytest.importorskip("wandb")

    class Crash(Exception):
        pass

    def crash(event, step):
        if event == "after_rollout" and step == 3:
            raise Crash

    with pytest.MonkeyPatch.context() as mp:
        _isolate_trackers(mp, tmp_path)
        cfg = _cfg(tmp_path / "run", "logging.report_to=[tensorboard, wandb]", "train.max_steps=4")
        with pytest.raises(Crash):
            train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, hook=crash)
        first = json.loads((tmp_path / "run" / "trackers.json").read_text())["wandb"]["id"]
        train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, resume=tmp_path / "run")
        _flush_wandb()
    assert json.loads((tmp_path / "run" / "trackers.json").read_text())["wandb"]["id"] == first
    files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{first}.wandb"] * 2  # two sessions of one W&B run
    steps = sorted(set().union(*(wandb_history(f)[0] for f in files)))
    assert steps == [1, 2, 3, 4]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tb = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert {s: v for s, v in tb["reward/mean"].items()} == pytest.approx({r["step"]: r["reward/mean"] for r in records})


@pytest.mark.parametrize("overrides, match", [
    (["logging.report_to=[wandbb]"], r"unknown tracker 'wandbb'; did you mean 'wandb'\?"),
    (["logging.report_to=[wandb]", "logging.tensorboard=true"], r"logging.tensorboard=true contradicts"),
])
def test_bad_report_to_is_refused_before_the_model_loads(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(tmp_path / "run", *overrides))


def test_a_named_tracker_that_is_not_installed_is_refused_with_the_install_command(tmp_path, monkeypatch):
    real = tracking.installed
    monkeypatch.setattr(tracking, "installed", lambda name: name != "trackio" and real(name))
    with pytest.raises(ValueError, match=r"pip install 'logitless\[trackio\]'"):
        validate_config(_cfg(tmp_path / "run", "logging.report_to=[trackio]"))


def test_default_and_older_switch(tmp_path):
    assert tracking.resolve_report_to(None, None) == (["tensorboard"], False)
    assert tracking.resolve_report_to(None, False) == ([], False)
    assert tracking.resolve_report_to([], None) == ([], True)
    assert tracking.resolve_report_to(["wandb", "wandb"], None) == (["wandb"], True)
    assert tracking.resolve_report_to(["none"], None) == ([], True)
    assert tracking.resolve_report_to(["all"], None) == ([t for t in tracking.TRACKERS if tracking.installed(t)], False)
    assert _cfg(tmp_path / "run", "logging.report_to=tensorboard").logging.report_to == ["tensorboard"]  # as TRL
    validate_config(_cfg(tmp_path / "run", "logging.tensorboard=false"))  # an older config still loads
    validate_config(_cfg(tmp_path / "run", "logging.report_to=[]", "logging.tensorboard=false"))
