"""Runs that train on nothing are announced (trainer/report/health.py), and non-finite numbers never train or get saved:
each warning fires on a planted tiny run (console and metrics.jsonl) and stays quiet on a healthy one; a nan/inf
config value is refused; a step whose loss or gradients are nan is skipped and nothing non-finite is checkpointed."""

from __future__ import annotations

import json

import pytest
import torch

from logitless.configlib import ConfigError
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import OptimConfig, RewardConfig, TrainConfig, load_train_config
from logitless.trainer.report.health import REPEAT_STEPS, NonFiniteTraining, RunHealth
from logitless.trainer.loop import train
from logitless.trainer.report.metrics import read_metrics
from tests.conftest import TINY_LORA_QUIET, reward_module, tiny_qwen2
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

VOCAB = 50_257


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "health_rewards", '''
        def varied(prompts, completions, **fields):
            return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in completions]

        def constant(prompts, completions, **fields):
            return [1.0] * len(completions)

        def nothing(prompts, completions, **fields):
            return [None] * len(completions)
    ''')


def _cfg(run_dir, *overrides):
    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=3", "train.prompts_per_step=2", "train.micro_batch_size=8",
        "rollout.num_generations=4", "rollout.max_completion_length=4", "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[health_rewards:varied]", "optim.learning_rate=0.05", *TINY_LORA_QUIET,
        "checkpoint.save_steps=1", "checkpoint.save_total_limit=null", *overrides,
    ])


def _model(hook=None):
    """The tiny model; `hook(output)` replaces the final norm's output in the forwards that build a graph (the
    update's), not in the rollout's."""
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    if hook is not None:
        model.model.norm.register_forward_hook(lambda m, i, out: hook(out) if torch.is_grad_enabled() else None)
    return model


def _warnings(records):
    return [sorted(k for k in r if k.startswith("warning/")) for r in records]


# ---------------------------------------------------------------------------------------------------------------
# nan / inf


@pytest.mark.parametrize("override", ["optim.max_grad_norm=nan", "optim.learning_rate=nan", "reward.timeout_s=nan",
                                      "train.memory_budget_gib=nan", "optim.weight_decay=inf",
                                      "reward.error_penalty=-inf", "reward.reward_weights=[.nan]"])
def test_non_finite_config_values_are_refused(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"config key '{key}(\[0\])?' expects a finite number"):
        load_train_config(None, [override, "reward.reward_funcs=[numeric_answer]"])


@pytest.mark.parametrize("section, kw", [(OptimConfig, {"max_grad_norm": float("nan")}),
                                         (OptimConfig, {"learning_rate": float("inf")}),
                                         (OptimConfig, {"weight_decay": float("nan")}),
                                         (RewardConfig, {"timeout_s": float("nan")}),
                                         (TrainConfig, {"memory_budget_gib": float("nan")})])
def test_non_finite_values_are_refused_from_python_too(section, kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        section(**kw)


def test_a_nan_gradient_skips_the_step_and_is_never_saved(tmp_path, tok, rewards, capsys, one_thread):
    """nan in the update's forward (so in the loss and every gradient): each optimizer step is skipped with a warning,
    the checkpoints hold the initial (finite) adapters, and the third such step in a row ends the run naming it."""
    model = _model(lambda out: out * float("nan"))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteTraining, match=r"step 3: 3 steps in a row trained nothing.*optim.learning_rate"):
        train(_cfg(tmp_path / "run"), model=model, tokenizer=tok)
    records = read_metrics(tmp_path / "run")
    assert [r["train/nonfinite_skipped"] for r in records] == [1.0, 1.0]
    assert "warning/nonfinite" in records[0] and "skipped" in records[0]["warning/nonfinite"]
    assert "nan or infinite" in capsys.readouterr().err
    for step in (1, 2):
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "run" / "checkpoints" / f"step-{step:06d}" / "model" / "adapter_model.safetensors"))
        assert saved and all(torch.isfinite(t).all() for t in saved.values())
        lora_b = [t for k, t in saved.items() if "lora_B" in k]
        assert lora_b and all(torch.equal(t, torch.zeros_like(t)) for t in lora_b)  # never stepped: still peft's init
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items() if k in initial)


# ---------------------------------------------------------------------------------------------------------------
# train-on-nothing warnings


def test_constant_reward_warns_and_prints_no_accuracy(tmp_path, tok, rewards, capsys, one_thread):
    cfg = _cfg(tmp_path / "run", "reward.reward_funcs=[health_rewards:constant]")
    records = train(cfg, model=_model(), tokenizer=tok).records
    got = _warnings(records)
    assert got[:2] == [["warning/truncated"], []]  # (a random model: shown once, not again within REPEAT_STEPS)
    assert got[2] == ["warning/constant_reward/constant", "warning/zero_variance"]
    assert "1" in records[2]["warning/constant_reward/constant"]
    assert "train.dynamic_sampling=true" in records[2]["warning/zero_variance"]
    assert all("accuracy" not in r for r in records)  # a constant 1.0 is no accuracy
    err = capsys.readouterr().err
    assert "acc 1.000" not in err and "gave every sample the same value 1" in err
    on_disk = read_metrics(tmp_path / "run")
    assert _warnings(on_disk) == got


def test_reward_of_only_none_is_filed_in_the_metrics(tmp_path, tok, rewards, one_thread):
    cfg = _cfg(tmp_path / "run", "reward.reward_funcs=[health_rewards:nothing, health_rewards:varied]",
               "train.max_steps=1")
    records = read_metrics(train(cfg, model=_model(), tokenizer=tok).run_dir)
    assert "warning/reward_none/nothing" in records[0]


def test_truncation_warns_and_names_the_setting(tmp_path, tok, rewards, capsys, one_thread):
    run = train(_cfg(tmp_path / "run", "train.max_steps=1"), model=_model(), tokenizer=tok).run_dir
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert line["warning/truncated"].startswith("100% of the completions were cut at rollout.max_completion_length=4")
    assert "Raise rollout.max_completion_length" in capsys.readouterr().err


def test_no_gradient_warns(tmp_path, tok, rewards, one_thread):
    """The trained adapters' output is detached before the head: the loss has a graph but no gradient reaches
    them."""
    model = _model(lambda out: out.detach() + 0 * out)
    records = train(_cfg(tmp_path / "run", "train.max_steps=1"), model=model, tokenizer=tok).records
    assert records[0]["grad_norm"] == 0.0 and records[0]["trained_rows"] > 0
    assert "model.lora_target_modules" in records[0]["warning/no_gradient"]


def test_healthy_steps_warn_of_nothing():
    """Records as the CPU demo logs them (some truncation, mixed rewards, a gradient): no warning, over many
    steps; a condition that holds long enough warns once per REPEAT_STEPS steps."""
    cfg = load_train_config(None, [])
    shown = []
    health = RunHealth(cfg, shown.append)
    demo = {"completion/truncated": 0.05, "zero_variance_groups": 0.5, "reward/mean": 0.2, "reward/std": 0.4,
            "reward/numeric_answer/mean": 0.2, "reward/numeric_answer/std": 0.4, "grad_norm": 0.3,
            "trained_rows": 64.0, "train/nonfinite_skipped": 0.0}
    assert all(health(step, dict(demo)) == {} for step in range(1, 50)) and shown == []
    flat = {**demo, "zero_variance_groups": 1.0, "reward/numeric_answer/std": 0.0, "reward/numeric_answer/mean": 0.0}
    due = [step for step in range(1, 50) if health(step, dict(flat))]
    assert due == [3, 3 + REPEAT_STEPS, 3 + 2 * REPEAT_STEPS]
    assert len(shown) == 2 * len(due)  # zero variance and the constant reward each time


def test_a_checkpoint_of_non_finite_weights_is_refused(tmp_path):
    model = tiny_qwen2(vocab_size=256, hidden=16, layers=1)
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=None)
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(ckpt.CheckpointError, match=r"step-000002 not written: 1 trained tensor\(s\) hold nan or inf"):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=None)
    assert ckpt.read_latest(tmp_path).name == "step-000001" and not (tmp_path / "step-000002").exists()


def test_dry_run_estimates_truncation_from_reference_answers(tmp_path, tok):
    """GSM8K rows carry their worked solutions: at 64 new tokens most would be cut (a warning), at 512 none; the
    demo's arithmetic rows have no reference answer, so no estimate."""
    from logitless.trainer.builders import load_rows
    from logitless.trainer.report.health import estimate_truncation
    from logitless.trainer.preflight import preflight

    rows = load_rows(load_train_config(None, ["data.task=gsm8k", "data.split=sample"]).data)
    lengths = sorted(len(tok(r.fields["solution"])["input_ids"]) for r in rows)
    line, share = estimate_truncation(rows, 64, tok)
    assert share == sum(n > 64 for n in lengths) / len(rows) > 0.5 and f"longest {lengths[-1]} tokens" in line
    assert estimate_truncation(rows, 512, tok)[1] == 0.0 and estimate_truncation(rows, 64)[1] > 0.5
    cfg = _cfg(tmp_path / "run", "data.task=gsm8k", "data.split=sample", "data.options={chat: false}",
               "reward.reward_funcs=[numeric_answer]", "rollout.max_completion_length=64")
    with pytest.warns(UserWarning, match=r"truncation estimate: \d+% of the first 50 rows' reference answers .*raise "
                                         r"rollout.max_completion_length"):
        preflight(cfg, model_given=True, tokenizer=tok)
    demo = load_rows(load_train_config(None, []).data, limit=64)
    assert estimate_truncation(demo, 8, tok) is None


def test_a_resumed_run_warns_as_the_uninterrupted_one(tmp_path, tok, rewards, one_thread):
    """The warnings' memory (streaks, what was shown when) is checkpointed: a run resumed after step 2 files the
    constant-reward and zero-variance warnings at step 3, as the uninterrupted run does."""
    cfg = lambda run: _cfg(run, "reward.reward_funcs=[health_rewards:constant]", "train.max_steps=3")  # noqa: E731
    full = train(cfg(tmp_path / "full"), model=_model(), tokenizer=tok).records

    def crash(event, step):
        if event == "step_start" and step == 3:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train(cfg(tmp_path / "cut"), model=_model(), tokenizer=tok, hook=crash)
    resumed = train(cfg(tmp_path / "cut"), model=_model(), tokenizer=tok, resume=tmp_path / "cut").records
    assert _warnings(resumed) == _warnings(full[2:]) == [["warning/constant_reward/constant", "warning/zero_variance"]]
