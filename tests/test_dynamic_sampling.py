"""train.dynamic_sampling (DAPO): on a task where every '+' prompt's group is all-equal, each step is filled with
prompts_per_step informative groups; the prompt sampler moves on by every round's prompts; a resumed run equals the
uninterrupted one; a step that finds too few keeps what it has and logs the shortfall."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from logitless.trainer.preflight import validate_config
from tests.conftest import TINY_LORA_QUIET, reward_module, sigint_handler, tiny_qwen2
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

VOCAB = 50_257
TIMING = ("time/", "tokens_per_s", "train_tokens_per_s", "memory/")


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "dyn_rewards", '''
        def half_constant(prompts, completions, **fields):
            """0 for every sample of a '+' prompt (a group with no signal); varies with the completion otherwise."""
            return [0.0 if "+" in e else sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c)
                    for c, e in zip(completions, fields["expression"])]

        def varied(prompts, completions, **fields):
            return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in completions]

        def constant(prompts, completions, **fields):
            return [1.0] * len(completions)
    ''')


def _cfg(run_dir, *overrides):
    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=4", "train.prompts_per_step=3", "train.micro_batch_size=6",
        "rollout.num_generations=4", "rollout.max_completion_length=4", "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[dyn_rewards:half_constant]", "optim.learning_rate=0.05", *TINY_LORA_QUIET,
        "checkpoint.save_steps=2", "checkpoint.save_total_limit=null", "train.dynamic_sampling=true",
        "train.dynamic_sampling_max_rounds=6", *overrides,
    ])


def _run(cfg, tok, **kw):
    return train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, **kw)


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def test_steps_are_filled_with_informative_groups(tmp_path, tok, rewards_module, one_thread):
    plain = _run(_cfg(tmp_path / "plain", "train.dynamic_sampling=false"), tok).records
    assert any(r["trained_rows"] < 12 for r in plain)  # without it, '+' groups leave steps short of signal
    dyn = _run(_cfg(tmp_path / "dyn"), tok).records
    assert all(r["dynamic/kept"] == 3 and r["dynamic/shortfall"] == 0 for r in dyn)
    assert all(r["trained_rows"] == 12 for r in dyn)  # every row of every kept group has a non-zero advantage
    assert any(r["dynamic/rounds"] > 1 for r in dyn) and all(r["dynamic/groups"] == 3 * r["dynamic/rounds"] for r in dyn)
    assert all(r["dynamic/informative"] >= 3 for r in dyn)
    # the sampler moved on by every round's prompts: the checkpoint of step 4 holds that position
    state = json.loads((ckpt.resolve_checkpoint(tmp_path / "dyn") / "trainer_state.json").read_text())
    assert state["sampler"]["epoch"] * 20 + state["sampler"]["index"] == 3 * sum(r["dynamic/rounds"] for r in dyn)


def test_first_round_is_the_plain_rollout(tmp_path, tok, rewards_module, one_thread):
    """A step whose first rollout already has enough signal is the step without dynamic sampling, bit for bit."""
    varied = "reward.reward_funcs=[dyn_rewards:varied]"
    plain = _run(_cfg(tmp_path / "plain", varied, "train.dynamic_sampling=false", "train.max_steps=2"), tok).records
    dyn = _run(_cfg(tmp_path / "dyn", varied, "train.max_steps=2"), tok).records
    assert all(r["dynamic/rounds"] == 1 and r["dynamic/informative"] == 3 for r in dyn)
    assert [{k: v for k, v in r.items() if not k.startswith("dynamic/")} for r in _untimed(dyn)] == _untimed(plain)


def test_resumed_run_is_identical(tmp_path, tok, rewards_module, one_thread):
    full = _run(_cfg(tmp_path / "full"), tok)

    def crash(event, step):
        if event == "after_rollout" and step == 3:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        _run(_cfg(tmp_path / "cut"), tok, hook=crash)
    resumed = _run(_cfg(tmp_path / "cut"), tok, resume=tmp_path / "cut")
    assert _untimed(resumed.records) == _untimed(full.records[2:])
    a = ckpt.resolve_checkpoint(tmp_path / "full") / "model" / "adapter_model.safetensors"
    b = ckpt.resolve_checkpoint(tmp_path / "cut") / "model" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_shortfall_is_logged_and_the_step_keeps_its_first_rollout(tmp_path, tok, rewards_module, one_thread):
    cfg = _cfg(tmp_path / "run", "reward.reward_funcs=[dyn_rewards:constant]", "train.max_steps=1",
               "train.dynamic_sampling_max_rounds=2")
    r = _run(cfg, tok).records[0]
    assert (r["dynamic/rounds"], r["dynamic/groups"], r["dynamic/informative"]) == (2, 6, 0)
    assert (r["dynamic/kept"], r["dynamic/shortfall"]) == (0, 3)
    assert r["trained_rows"] == 0 and r["reward/mean"] == 1.0


@pytest.mark.parametrize("overrides, match", [
    (["train.dynamic_sampling_max_rounds=0"], r"train.dynamic_sampling_max_rounds must be > 0"),
    (["train.async_rollout=true", "rollout.backend=static"], r"train.dynamic_sampling=true samples more prompts"),
])
def test_bad_settings_are_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(tmp_path / "run", *overrides))


def test_rounds_without_signal_warn_and_a_ctrl_c_between_rounds_stops(tmp_path, tok, rewards_module, one_thread,
                                                                      monkeypatch, capfd):
    """Equal rewards and many dynamic_sampling_max_rounds: a warning after WARN_ROUNDS rounds names the cause and
    the setting, and a Ctrl-C between rounds drops the step and stops the run (it used to sample on in silence)."""
    from logitless.trainer import dynamic

    rounds, real = [], dynamic.rollout_stage

    def rollout_then_ctrl_c(ctx, step, round=0):  # the round's rollout, then Ctrl-C after the 10th
        out = real(ctx, step, round=round)
        rounds.append(round)
        if len(rounds) == 10:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(dynamic, "rollout_stage", rollout_then_ctrl_c)
    cfg = _cfg(tmp_path / "run", "reward.reward_funcs=[dyn_rewards:constant]", "train.dynamic_sampling_max_rounds=40")
    with sigint_handler(signal.default_int_handler):
        result = _run(cfg, tok)
    assert result.interrupted == signal.SIGINT and result.exit_code == 130 and result.step == 0
    assert rounds == list(range(10))  # none after the signal (the starting code sampled all 40 rounds)
    out = capfd.readouterr()
    text = " ".join((out.out + out.err).split())
    assert (f"warning: step 1: {dynamic.WARN_ROUNDS} rounds of dynamic sampling found no prompt whose samples got "
            "different rewards (no gradient signal); it goes on for up to train.dynamic_sampling_max_rounds=40") in text
    assert "Ctrl-C: stopping. Step 1 has not begun its update, so it is dropped" in text
