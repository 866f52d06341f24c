"""The run folder is a unit only its owner writes, and everything checkable without the model fails before its load.

Each refusal asserts that the message names the config key (or file) and the fix, and that no file of the
earlier run in the folder changed. `no_model_load` makes any model load fail the test: the checks must come first.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from logitless.cli import main
from logitless.trainer import checkpoint as ckpt
from logitless.trainer import loop as loop_mod
from logitless.trainer.config.schema import load_train_config, to_yaml
from logitless.trainer.demo import demo_config
from logitless.trainer.report.metrics import RewardErrorReport, read_metrics
from logitless.trainer.policy.modeling import prepare_for_training
from logitless.trainer.preflight import validate_config
from logitless.trainer.rundir import LOCK_FILE, RunDirError, claim_run_dir
from tests.conftest import start_with_sigint, subprocess_env, tiny_qwen2

evaluate_mod = importlib.import_module("logitless.trainer.evaluate")  # the package exports a function of that name
context_mod = importlib.import_module("logitless.trainer.context")  # where train() loads the model


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under `folder` except the lock file (which only records its owner)."""
    return {
        p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE
    }


def _run_cfg(run: Path, *overrides: str):
    model = Path(run).parent / "model"  # a local model folder (config.json only: no test here loads its weights)
    if not (model / "config.json").is_file():
        model.mkdir(parents=True, exist_ok=True)
        tiny_qwen2(vocab_size=96, hidden=32, layers=1).config.to_json_file(model / "config.json")
    base = [f"train.output_dir={run}", "train.max_steps=2", f"model.name_or_path={model}", "model.lora_r=16",
            "model.lora_alpha=32", "data.options={difficulty: 1, n: 40, chat: false}", "logging.tensorboard=false"]
    return load_train_config(None, base + list(overrides))


@pytest.fixture
def earlier_run(tmp_path) -> Path:
    """A finished run (config.yaml, 2 metrics records, checkpoints step 1 and 2 with LoRA r=16) without training."""
    run = tmp_path / "earlier"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(_run_cfg(run)))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5 / s}) + "\n" for s in (1, 2)))
    model = prepare_for_training(tiny_qwen2(vocab_size=96, hidden=32, layers=1), _run_cfg(run).model)
    for step in (1, 2):
        ckpt.save_checkpoint(run / "checkpoints", step, model=model, optimizer=None, trainer_state={"sampler": {}})
    return run


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(context_mod, "load_model_and_tokenizer", fail)
    monkeypatch.setattr(evaluate_mod, "load_model_and_tokenizer", fail)


@pytest.fixture
def restore_sigint():
    """main() ignores SIGINT once it handled a Ctrl-C (the process is ending); put the test process's handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


# ---- 1. num_generations=1


def test_num_generations_1_is_refused_naming_the_advantage_options(earlier_run, capsys, no_model_load):
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", "--resume", str(earlier_run), "rollout.num_generations=1", "train.max_steps=3")
    assert code == 1
    assert "rollout.num_generations=1" in err and "advantage.estimator" in err and "num_generations=2 or more" in err
    assert _snapshot(earlier_run) == before
    assert _cli(capsys, "train", "--dry-run", "rollout.num_generations=1")[0] == 1  # --dry-run checks it too
    validate_config(demo_config(["rollout.num_generations=1"]), training=False)  # eval never groups: allowed


# ---- 2. a new run into a folder that holds a run; --overwrite


def test_new_run_into_a_finished_run_is_refused_and_overwrite_replaces_it(earlier_run, capsys, no_model_load):
    before = _snapshot(earlier_run)
    cfg_file = earlier_run.parent / "cfg.yaml"
    cfg_file.write_text((earlier_run / "config.yaml").read_text())
    code, err = _cli(capsys, "train", str(cfg_file))
    assert code == 1
    assert "train.output_dir=" in err and "already holds a run" in err and "step-000002" in err
    assert f"--resume {earlier_run}" in err and "--overwrite" in err and "nothing was changed" in err
    assert _snapshot(earlier_run) == before
    # --overwrite sets the old run aside, then loads; the new run failed before its first step: the old one is back
    with pytest.raises(AssertionError, match="model was loaded"), \
            pytest.warns(UserWarning, match=rf"the new run ended before finishing its first step, so the run it was "
                                            rf"to replace is back in {earlier_run}"):
        main(["train", str(cfg_file), "--overwrite"])
    assert _snapshot(earlier_run) == before and sorted(p.name for p in earlier_run.iterdir()) == [
        LOCK_FILE, "checkpoints", "config.yaml", "metrics.jsonl"]


def test_overwrite_never_clears_foreign_files(tmp_path, capsys, no_model_load):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    code, err = _cli(capsys, "train", f"train.output_dir={folder}", "--overwrite")
    assert code == 1 and "thesis.tex" in err and "train.output_dir=<a new or empty folder>" in err
    assert (folder / "thesis.tex").read_text() == "precious"


# ---- 3. the lock


LOCK_HOLDER = """
import sys
from logitless.trainer.config.schema import load_train_config, to_yaml
from logitless.trainer.rundir import claim_run_dir
run = claim_run_dir(load_train_config(None, [f"train.output_dir={sys.argv[1]}"]))
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_writer_is_refused_naming_the_running_process(tmp_path):
    run = tmp_path / "run"
    env = subprocess_env()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(run)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _snapshot(run)
        with pytest.raises(RunDirError, match=rf"in use by process {holder.pid} .*stop it, or set train.output_dir"):
            claim_run_dir(_run_cfg(run))
        assert _snapshot(run) == before
    finally:
        holder.kill()  # SIGKILL: no chance to release anything
        holder.communicate(timeout=60)
    # the holder is gone: its lock is stale and is taken over, with a warning naming it
    with pytest.warns(UserWarning, match=rf"stale lock.*\"pid\": {holder.pid}"):
        claim_run_dir(_run_cfg(run)).release()


def test_lock_is_exclusive_within_one_process_and_released(tmp_path):
    with claim_run_dir(_run_cfg(tmp_path / "run")):
        with pytest.raises(RunDirError, match=f"in use by process {os.getpid()}"):
            claim_run_dir(_run_cfg(tmp_path / "run"))
    claim_run_dir(_run_cfg(tmp_path / "run")).release()  # released: no stale warning, no error


# ---- 4. --resume from another working directory continues in the resumed folder


def test_resume_from_another_directory_continues_in_the_run_folder(earlier_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    cfg = _run_cfg(Path("runs/demo"), "train.max_steps=4", "data.task=jsonl", "data.options={path: prompts.jsonl}",
                   "model.name_or_path=runs/model")  # relative paths, as the demo's output_dir
    with pytest.warns(UserWarning, match=r"train.output_dir='runs/demo' .* continuing in .*earlier"):
        run = claim_run_dir(cfg, resume=earlier_run)
    with run:
        assert run.path == earlier_run.resolve() and run.cfg.train.output_dir == str(earlier_run.resolve())
        assert run.resume_from == earlier_run.resolve() / "checkpoints" / "step-000002"
        assert run.cfg.data.options["path"] == str(tmp_path / "prompts.jsonl")  # recorded absolute
        assert run.cfg.model.name_or_path == str(tmp_path / "runs" / "model")
    assert not (tmp_path / "runs" / "demo").exists()


# ---- checkpoints that check themselves


@pytest.mark.parametrize("bad_file", ["model/adapter_model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_damaged_latest_checkpoint_falls_back_naming_the_file(earlier_run, bad_file):
    f = earlier_run / "checkpoints" / "step-000002" / bad_file
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    before = _snapshot(earlier_run)
    with pytest.warns(UserWarning, match=rf"{bad_file}.*truncated.*Falling back to step-000001"):
        assert ckpt.resolve_checkpoint(earlier_run).name == "step-000001"
    with pytest.raises(ckpt.CheckpointError, match=rf"damaged checkpoint: .*{bad_file}.*give the run folder"):
        ckpt.resolve_checkpoint(earlier_run / "checkpoints" / "step-000002")  # a step folder given directly
    assert _snapshot(earlier_run) == before


def test_a_damaged_file_without_manifest_is_named_when_loaded(earlier_run):
    step = earlier_run / "checkpoints" / "step-000002"
    (step / ckpt.MANIFEST).unlink()  # a checkpoint written before manifests existed
    (step / "optimizer.pt").write_bytes(b"PK\x03\x04 truncated zip")
    model = prepare_for_training(tiny_qwen2(vocab_size=96, hidden=32, layers=1), _run_cfg(earlier_run).model)
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.pt is damaged or unreadable"):
        ckpt.load_checkpoint(step, model=model)


def test_leftover_temporaries_are_cleaned_by_the_owner(earlier_run):
    root = earlier_run / "checkpoints"
    (root / ".tmp-step-000003-4242").mkdir()
    (root / ".tmp-step-000003-4242" / "optimizer.pt").write_bytes(b"half")
    (root / "latest.tmp").write_text("step-000003")
    os.rename(root / "step-000002", root / ".old-step-000002-4242")  # crash between the two renames of a re-save
    with claim_run_dir(_run_cfg(earlier_run, "train.max_steps=5"), resume=earlier_run) as run:
        assert run.resume_from.name == "step-000002"  # moved back, intact
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]


def test_checkpoint_config_mismatch_names_the_keys(earlier_run, capsys, no_model_load):
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", "--resume", str(earlier_run), "model.lora_r=4", "train.max_steps=3")
    assert code == 1
    assert "trained with model.lora_r=16" in err and "this config has model.lora_r=4" in err
    assert "set model.lora_r=16" in err
    code, err = _cli(capsys, "eval", "--checkpoint", str(earlier_run), "model.lora_r=4")
    assert code == 1 and "--checkpoint" in err and "model.lora_r=16" in err
    assert _snapshot(earlier_run) == before


def test_resuming_a_finished_run_names_max_steps(earlier_run, capsys, no_model_load):
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", "--resume", str(earlier_run))
    assert code == 1 and "already at step 2 and train.max_steps=2" in err and "train.max_steps=4" in err
    assert _snapshot(earlier_run) == before


# ---- metrics.jsonl with a half-written last line


def test_truncated_last_metrics_line_is_dropped_with_a_warning(earlier_run, tmp_path):
    path = earlier_run / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 3, "lo')
    with pytest.warns(UserWarning, match=r"metrics.jsonl: dropping its last line 3, which is incomplete"):
        assert [r["step"] for r in read_metrics(earlier_run)] == [1, 2]
    from logitless.trainer.report.plot import plot_run

    with pytest.warns(UserWarning, match="incomplete"):
        assert plot_run(earlier_run, tmp_path / "c.png").is_file()
    from logitless.trainer.report.metrics import MetricsLogger

    with pytest.warns(UserWarning, match="incomplete"):  # --resume from step 2 keeps steps 1-2, drops the tail
        MetricsLogger(earlier_run, tensorboard=False, progress=False, resume_step=2).close()
    assert [r["step"] for r in read_metrics(earlier_run)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # a bad line elsewhere is not guessed at
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not a JSON record.*fix or delete that line"):
        read_metrics(earlier_run)


# ---- options checked before the model load (and by --dry-run)


@pytest.mark.parametrize(
    "override, needles",
    [
        ("rollout.top_p=1.5", ["rollout.top_p=1.5", "0 < top_p <= 1"]),
        ("rollout.min_p=1.0", ["rollout.min_p=1.0", "0 <= min_p < 1"]),
        ("rollout.top_k=-1", ["rollout.top_k=-1", "int >= 0"]),
        ("rollout.repetition_penalty=0", ["rollout.repetition_penalty=0", "positive value"]),
        ("rollout.temperature=-1", ["rollout.temperature must be > 0", "got -1.0"]),
        ("rollout.stop=['']", ["rollout.stop=['']", "non-empty strings"]),
        ("rollout.backend=vllm", ["rollout.backend='vllm'", "Use one of ('hf', 'static', 'continuous')"]),
        ("model.device=tpu", ["model.device='tpu'", "use auto, cpu, cuda"]),
        ("data.options.difficuly=2", ["data.options.difficuly", "did you mean 'data.options.difficulty'"]),
        ("eval.max_completion_length=0", ["eval.max_completion_length=0", ">= 1"]),
        ("reward.accuracy_reward=nope", ["reward.accuracy_reward='nope'", "reward.reward_funcs"]),
    ],
)
def test_options_are_checked_before_the_model_under_their_config_names(
    earlier_run, capsys, no_model_load, override, needles
):
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", "--dry-run", override)
    assert code in (1, 2) and all(n in err for n in needles), err
    assert "SamplingOptions" not in err and "Traceback" not in err
    code, err = _cli(capsys, "train", "--resume", str(earlier_run), "train.max_steps=3", override)
    assert code in (1, 2) and all(n in err for n in needles), err
    assert _snapshot(earlier_run) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda(capsys, no_model_load):
    code, err = _cli(capsys, "train", "--dry-run", "model.device=cuda")
    assert code == 1 and "model.device='cuda'" in err and "no usable CUDA GPU" in err and "model.device=cpu" in err


def test_task_override_does_not_inherit_the_demo_options(capsys):
    for task in ("gsm8k", "jsonl"):
        cfg = demo_config([f"data.task={task}"])
        assert cfg.data.options == {} and cfg.data.eval_options == {}
    assert demo_config(["data.task=jsonl", "data.options.path=p.jsonl"]).data.options == {"path": "p.jsonl"}
    assert demo_config(["data.task=arithmetic"]).data.options["difficulty"] == 2  # same task: demo options kept
    code, err = _cli(capsys, "train", "--dry-run", "data.task=gsm8k", "data.options.difficulty=2")
    assert code == 1 and "data.options.difficulty: data.task='gsm8k' has no option 'difficulty'" in err


def test_unwritable_output_dir_is_named_before_the_model(tmp_path, capsys, no_model_load):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _cli(capsys, "train", f"train.output_dir={blocker / 'run'}")
    assert code == 1 and f"train.output_dir='{blocker / 'run'}' is not a writable folder" in err
    assert "set train.output_dir=<a folder you can write to>" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_read_only_output_dir(tmp_path, capsys, no_model_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, err = _cli(capsys, "train", f"train.output_dir={ro / 'run'}")
    finally:
        ro.chmod(0o755)
    assert code == 1 and "is not a writable folder" in err and "PermissionError" in err


def test_eval_output_folder_and_checkpoint_path_are_checked_first(earlier_run, tmp_path, capsys, no_model_load):
    before = _snapshot(earlier_run)
    missing = tmp_path / "missing" / "eval.json"
    code, err = _cli(capsys, "eval", "--checkpoint", str(earlier_run), "--output", str(missing))
    assert code == 1 and f"--output '{missing}'" in err and "does not exist; create it" in err
    code, err = _cli(capsys, "eval", "--checkpoint", str(tmp_path / "nowhere"))
    assert code == 1 and "--checkpoint" in err and "--resume" not in err and "no checkpoint found" in err
    assert _snapshot(earlier_run) == before


def test_a_folder_given_as_config_file(earlier_run, capsys):
    before = _snapshot(earlier_run)
    code, err = _cli(capsys, "train", str(earlier_run))
    assert code == 2 and "is a folder, not a YAML config file" in err and f"--resume {earlier_run}" in err
    assert _snapshot(earlier_run) == before


def test_prompt_length_error_names_config_keys_only(gpt2_tokenizer):
    from logitless.data import PromptRow
    from logitless.trainer.builders import check_prompt_lengths
    from logitless.trainer.placement.engines import sampling_options

    cfg = demo_config(["rollout.max_prompt_length=4"])
    model = tiny_qwen2(vocab_size=50_257, hidden=16, layers=1)
    rows = [PromptRow(prompt="one two three four five six seven", fields={})]
    with pytest.raises(ValueError, match="over the limit of 4") as e:
        check_prompt_lengths(rows, gpt2_tokenizer, model, sampling_options(cfg.rollout, seed=None), "data")
    assert "truncate_prompt" not in str(e.value) and "raise rollout.max_prompt_length" in str(e.value)


# ---- unreachable hub model or dataset, empty model folder


@pytest.fixture
def no_hub(monkeypatch):
    """The hub endpoint is a closed local port: every request fails at once with a connection error."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["model.name_or_path=logitless-test/no-such-model"],
         ["model 'logitless-test/no-such-model'", "cannot be reached", "model.name_or_path=<a local folder"]),
        (["data.task=hub", "data.options={name: logitless-test/no-such-data}"],
         ["dataset 'logitless-test/no-such-data'", "cannot be reached", "data.task=jsonl data.options.path="]),
        (["data.task=gsm8k"], ["dataset 'openai/gsm8k'", "data.split=sample"]),
    ],
)
def test_unreachable_hub_gives_one_line_fast(tmp_path, capsys, no_hub, no_model_load, overrides, needles):
    t0 = time.monotonic()
    code, err = _cli(capsys, "train", f"train.output_dir={tmp_path / 'run'}", *overrides)
    assert code == 1 and all(n in err for n in needles), err
    assert len(err.strip().splitlines()) == 1 and time.monotonic() - t0 < 15


def test_offline_mode_and_empty_model_folder(tmp_path, capsys, monkeypatch, no_model_load):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = _cli(capsys, "eval", "model.name_or_path=logitless-test/no-such-model")
    assert code == 1 and "offline mode is on" in err and "model.name_or_path=<a local folder" in err
    (tmp_path / "empty").mkdir()
    code, err = _cli(capsys, "eval", f"model.name_or_path={tmp_path / 'empty'}")
    assert code == 1 and "folder without config.json" in err and "save_pretrained" in err


# ---- Ctrl-C


def test_ctrl_c_during_the_model_load_is_one_line(tmp_path, capsys, monkeypatch, restore_sigint):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what Python raises when Ctrl-C arrives inside from_pretrained

    monkeypatch.setattr(context_mod, "load_model_and_tokenizer", interrupted)
    code, err = _cli(capsys, "train", f"train.output_dir={tmp_path / 'run'}")
    assert code == 130 and err.strip().splitlines() == [err.strip()] and "interrupted (Ctrl-C)" in err
    claim_run_dir(_run_cfg(tmp_path / "run")).release()  # the lock was released on the way out


# ---- reward errors under on_error=penalty


def test_reward_errors_are_printed_rate_limited_with_the_exception_text():
    shown, now = [], [0.0]
    report = RewardErrorReport(shown.append, penalty=-1.0, interval_s=60.0, clock=lambda: now[0])
    for step in range(1, 6):
        now[0] = 20.0 * step
        report(step, ["numeric_answer", "flaky"], [0, 8], [None, "ValueError: no number in 'abc'"], 8)
    # step 1 (t=20 s) at once; steps 2-3 are within 60 s of it and held back; step 4 (t=80 s) reports steps 2-4;
    # step 5 (t=100 s) is held back again
    assert len(shown) == 2
    assert "step 1: reward function 'flaky' failed on 8 of 8 samples" in shown[0]
    assert "ValueError: no number in 'abc'" in shown[0] and "reward.on_error=raise" in shown[0]
    assert "step 4" in shown[1] and "failed on 24 of 24 samples" in shown[1]


# ---- end to end, with a tiny model


from tests.test_cli import _config, tiny_folder  # noqa: E402,F401  (fixture)
from tests.test_trainer import VOCAB  # noqa: E402


@pytest.fixture
def tok(gpt2_tokenizer):
    """A left-padding copy of the session's GPT-2 tokenizer (the shared one stays as other tests expect it)."""
    import copy

    t = copy.deepcopy(gpt2_tokenizer)
    t.pad_token = t.eos_token
    t.padding_side = "left"
    return t

ALWAYS_RAISES = '''
def always(prompts, completions, **fields):
    raise ValueError("no digits here")
'''


def _tiny_train(cfg, tok, **kw):
    return loop_mod.train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, **kw)


def _e2e_cfg(output_dir, *overrides):
    return load_train_config(None, [
        f"train.output_dir={output_dir}", "train.max_steps=2", "train.prompts_per_step=2", "rollout.num_generations=4",
        "rollout.max_completion_length=4", "data.options={difficulty: 1, n: 20, chat: false}", "model.lora_r=4",
        "model.lora_alpha=8", "logging.tensorboard=false", "logging.progress=false", "logging.log_completions=false",
        "logging.plot=false", "checkpoint.save_steps=1", *overrides,
    ])


def test_resume_from_another_directory_writes_into_the_resumed_run(tmp_path, tok, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _tiny_train(_e2e_cfg("runs/demo"), tok)  # a relative train.output_dir, as the demo's
    run = tmp_path / "a" / "runs" / "demo"
    monkeypatch.chdir(tmp_path / "b")
    with pytest.warns(UserWarning, match="continuing in"):
        result = _tiny_train(_e2e_cfg("runs/demo", "train.max_steps=3"), tok, resume=run)
    assert result.run_dir == run and not (tmp_path / "b" / "runs").exists()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert ckpt.read_latest(run / "checkpoints").name == "step-000003"
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["output_dir"] == str(run)  # absolute


def test_reward_errors_under_penalty_reach_the_console(tmp_path, tok, monkeypatch, capsys):
    (tmp_path / "raising_rewards.py").write_text(ALWAYS_RAISES)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _e2e_cfg(tmp_path / "run", "reward.reward_funcs=[numeric_answer, raising_rewards:always]",
                   "reward.on_error=penalty", "reward.error_penalty=-1.0")
    result = _tiny_train(cfg, tok)
    err = capsys.readouterr().err
    assert result.records[0]["reward/always/errors"] == 8
    assert err.count("reward function 'always' failed on 8 of 8 samples") == 1  # step 2 is within the rate limit
    assert "ValueError: no digits here" in err and "reward.error_penalty=-1.0" in err


def test_ctrl_c_twice_during_startup_prints_one_line(tmp_path, tiny_folder):
    cfg = _config(tmp_path, tiny_folder, max_steps=50)
    env = subprocess_env(OMP_NUM_THREADS="1")
    proc = start_with_sigint([sys.executable, "-m", "logitless", "train", str(cfg)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = tmp_path / "run" / LOCK_FILE
    deadline = time.monotonic() + 120
    while not (lock.is_file() and lock.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "the run folder was not claimed in time"
        time.sleep(0.05)  # polling for the claim (the model load starts right after), not synchronization
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # the second Ctrl-C comes while the first is being handled
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    said = [line for line in out.splitlines() if "Ctrl-C" in line or "interrupted" in line]
    assert "stopping now" in said[0] and "training had not started" in said[0], out
    assert said[1:] in ([], ["Ctrl-C again: exiting at once"]), out  # (if it came while the first was unwinding)
    # nothing was saved: no --resume that would fail, but how to start again
    assert "nothing to resume" in said[0] and "--resume" not in said[0], out
