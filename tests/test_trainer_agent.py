"""Training and evaluation with an agent (agent.environment / agent.tools) end to end on CPU: multi-turn episodes
through the `hf` engine, the environment's reward column, the episode metrics, exact resume after a SIGTERM, and
the settings refused before anything slow."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import textwrap
import time

import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.evaluate import evaluate
from logitless.trainer.loop import train
from logitless.trainer.preflight import validate_config
from tests.conftest import tiny_qwen2
from tests.test_trainer import VOCAB, _cfg, _lora, _train, _untimed, rewards_module, tok  # noqa: F401 (fixtures)

ENV_MODULE = '''
class Countdown:
    """Answers each model turn with the turns left; done after `turns` steps. Step rewards: the turn's length mod
    3, none for turns of even length."""

    def __init__(self, turns=3):
        self.turns = turns

    def reset(self, row):
        self.left = self.turns
        return f" ({row['expression']}: {self.left} turns)"

    def step(self, text):
        self.left -= 1
        return f" [{self.left} left]", (float(len(text) % 3) if len(text) % 2 else None), self.left <= 0
'''

AGENT = ["agent.environment=my_env:Countdown", "agent.env_options={turns: 3}", "agent.environment_reward_weight=0.5",
         "rollout.max_completion_length=24", "rollout.stop=[e]"]  # a turn ends at its first "e" (or at 24 tokens)


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_env", raising=False)


def test_training_runs_episodes_and_logs_them(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    result = _train(_cfg(tmp_path / "run", *AGENT, "train.max_steps=2"), tok)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and result.step == 2
    for r in records:
        assert 1 < r["episode/turns_mean"] <= 3 and r["episode/tool_calls_mean"] == 0
        assert r["tokens/env_mean"] > 3 and r["tokens/model_mean"] == pytest.approx(r["completion/length_mean"])
        assert r["completion/length_max"] < 24  # model tokens only: the observations take part of the budget
        assert 0 <= r["episode/truncated"] == r["completion/truncated"] <= 1
        assert "episode/observation_tokens" in r  # the driver's own metrics, averaged
        # the environment's column: the sum of 3 step rewards of 0-2 (None for even turn lengths)
        assert 0 <= r["reward/environment/mean"] <= 6 and r["reward/environment/none"] > 0
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0


def test_training_on_the_static_engine(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    """The static engine's episodes (KV cache across turns, from the merged LoRA copy): the sampler's logprobs of
    the model's tokens are the trainer's over the whole conversation."""
    cfg = _cfg(tmp_path / "run", *AGENT, "train.max_steps=1", "rollout.backend=static",
               "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0")
    (r,) = _train(cfg, tok).records
    assert r["episode/turns_mean"] > 1 and r["tokens/env_mean"] > 3
    assert r["is/logp_diff"] < 1e-4 and r["is/logp_diff/max"] < 1e-3


def test_resume_with_episodes_reproduces_the_uninterrupted_run(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    full = _train(_cfg(tmp_path / "full", *AGENT, "train.max_steps=2"), tok)

    def hook(event, step):  # a real SIGTERM after the rollout of step 2: the step is dropped and redone on resume
        if event == "after_rollout" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    cut = _train(_cfg(tmp_path / "cut", *AGENT, "train.max_steps=2"), tok, hook=hook)
    assert cut.interrupted == signal.SIGTERM and cut.step == 1
    resumed = _train(_cfg(tmp_path / "cut", *AGENT, "train.max_steps=2"), tok, resume=tmp_path / "cut")
    assert resumed.step == 2 and ckpt.read_latest(tmp_path / "cut" / "checkpoints").name == "step-000002"
    assert _untimed(cut.records + resumed.records) == _untimed(full.records)
    assert all(r["episode/turns_mean"] > 1 for r in full.records)
    a, b = _lora(tmp_path / "full"), _lora(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluation_runs_episodes(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    from logitless.trainer.builders import load_rows

    cfg = _cfg(tmp_path / "run", *AGENT, "eval.num_prompts=3", "eval.pass_k=2", "data.eval_options={unique: false}")
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    result = evaluate(model, tok, load_rows(cfg.data, eval=True), cfg, split="test")
    assert len(result.samples) == 6 and result.episodes["episode/turns_mean"] > 1
    # raw prompts too: the messages the rewards scored, the environment's observations among them
    assert all(any("left]" in m["content"] for m in s["completion"] if m["role"] == "user") for s in result.samples)
    assert "turns and" in result.summary()


def test_a_stuck_environment_step_fails_the_run_naming_it(tmp_path, tok, rewards_module):  # noqa: F811
    """A step() in a busy loop is abandoned at agent.tool_timeout_s; still running as long again, it fails the run
    (its thread cannot be stopped) instead of slowing every later step."""
    from logitless.agents.runner import TaskStuck

    t0 = time.monotonic()
    with pytest.raises(TaskStuck, match=r"SpinningStep.step\(\) did not return within 0.5 s .*Where it runs:"):
        _train(_cfg(tmp_path / "run", "agent.environment=tests.agent_fixtures:SpinningStep", "agent.tool_timeout_s=0.5",
                    "rollout.max_completion_length=24", "rollout.stop=[e]", "train.prompts_per_step=1",
                    "rollout.num_generations=2"), tok)
    assert time.monotonic() - t0 < 30.0  # (the starting code trained on, each step slower than the one before)


def test_sigterm_while_the_rollout_waits_on_reset_stops_the_run(tmp_path, tok, rewards_module, capfd):  # noqa: F811
    """The first SIGTERM abandons the wait on a hung reset() (here within agent.tool_timeout_s=30): step 1 is
    dropped and the run stops at once with 143."""
    t0 = time.monotonic()
    result = _train(_cfg(tmp_path / "run", "agent.environment=tests.agent_fixtures:SignalledReset",
                         "agent.tool_timeout_s=30", "rollout.max_completion_length=24", "rollout.stop=[e]"), tok)
    assert result.interrupted == signal.SIGTERM and result.exit_code == 143 and result.step == 0
    assert time.monotonic() - t0 < 20.0
    assert "SIGTERM: stopping. Step 1 has not begun its update, so it is dropped" in capfd.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("setting, match", [
    ("rollout.backend=continuous", r"agent.environment='my_env:Countdown' runs multi-turn episodes, which "
                                   r"rollout.backend=continuous cannot: set rollout.backend=hf"),
    ("reward.reward_funcs=[numeric_answer, my_rewards:environment]",
     r"reward.reward_funcs names a function 'environment'.*rename the function"),
])
def test_settings_that_cannot_run_episodes_are_refused(tmp_path, setting, match, rewards_module,  # noqa: F811
                                                       env_module):
    with open(tmp_path / "my_rewards.py", "a") as f:  # a reward function named like the environment's column
        f.write("\ndef environment(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(tmp_path / "run", *AGENT, setting))


def test_async_rollout_with_episodes_resumes_exactly(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    """train.async_rollout: the next step's episodes run during the update; a checkpoint holds them (with their
    records), so a run stopped and resumed takes the samples and makes the updates of the uninterrupted one."""
    run = [*AGENT, "rollout.backend=static", "train.async_rollout=true", "train.max_steps=2",
           "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]
    full = _train(_cfg(tmp_path / "full", *run), tok)
    assert [r["episode/turns_mean"] > 1 for r in full.records] == [True, True]
    assert full.records[1]["is/logp_diff"] > 1e-3  # step 2's episodes came from the weights before update 1

    def hook(event, step):
        if event == "after_rollout" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    cut = _train(_cfg(tmp_path / "cut", *run), tok, hook=hook)
    assert cut.step == 1
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert state["prefetch"]["step"] == 2 and len(state["prefetch"]["batch"]["episodes"]) == 8
    resumed = _train(_cfg(tmp_path / "cut", *run), tok, resume=tmp_path / "cut")
    assert _untimed(cut.records + resumed.records) == _untimed(full.records)
    a, b = _lora(tmp_path / "full"), _lora(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_advantages_weigh_the_environment_column(tmp_path, rewards_module):  # noqa: F811
    from logitless.trainer.context import advantage_options

    assert advantage_options(_cfg(tmp_path / "a", *AGENT)).reward_weights == (1.0, 1.0, 0.5)
    assert advantage_options(_cfg(tmp_path / "b", *AGENT, "reward.reward_weights=[2.0, 3.0]")).reward_weights == (
        2.0, 3.0, 0.5)
    assert advantage_options(_cfg(tmp_path / "c", "agent.tools=[calculator]")).reward_weights is None  # no column


CHAT_REWARDS = '''
SEEN = []

def assistant_turns(prompts, completions, **fields):
    """The number of assistant messages of each conversation (the completions are message lists)."""
    SEEN.extend(completions)
    return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]
'''


def test_chat_prompts_reward_the_messages(tmp_path, qwen_tokenizer, env_module, monkeypatch):
    """Chat prompts (Qwen2.5's template): reward functions get the messages after the prompt, the built-ins score
    the last assistant message."""
    (tmp_path / "chat_rewards.py").write_text(textwrap.dedent(CHAT_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "chat_rewards", raising=False)
    cfg = _cfg(tmp_path / "run", *AGENT, "train.max_steps=1", "data.options={difficulty: 1, n: 40, chat: true}",
               "reward.reward_funcs=[numeric_answer, chat_rewards:assistant_turns]", "rollout.stop=[]",
               "agent.max_turn_tokens=3", "rollout.max_completion_length=64")
    model = tiny_qwen2(vocab_size=len(qwen_tokenizer), hidden=32, layers=1, tie=False)
    head = torch.nn.Linear(32, len(qwen_tokenizer), bias=True)  # a bias (the fused op takes it too) that makes
    with torch.no_grad():  # <|im_end|> about every other token: turns end at the template's end of turn
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()[qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")] = 12.0
    model.lm_head = head
    (r,) = train(cfg, model=model, tokenizer=qwen_tokenizer).records
    import chat_rewards

    assert len(chat_rewards.SEEN) == 8 and all(isinstance(c, list) for c in chat_rewards.SEEN)
    roles = [m["role"] for c in chat_rewards.SEEN for m in c]
    assert roles.count("assistant") > 8 and "user" in roles  # several turns, the environment's observations
    assert r["reward/assistant_turns/mean"] == pytest.approx(r["episode/turns_mean"]) and r["episode/turns_mean"] > 1
    assert r["accuracy"] == r["reward/numeric_answer/mean"]  # the built-in scored every conversation


def test_an_environment_reward_alone_needs_no_reward_function(monkeypatch):
    """examples/guess_number.yaml: `reward.reward_funcs: []` with an environment (its module imported from the
    current folder, as `python -m` would); without an environment an empty list is refused, naming the key."""
    from pathlib import Path

    from logitless.trainer.config.schema import load_train_config

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    cfg = load_train_config(root / "examples" / "guess_number.yaml")
    validate_config(cfg)
    with pytest.raises(ValueError, match=r"reward\.reward_funcs is empty; name at least one reward function"):
        validate_config(load_train_config(root / "examples" / "guess_number.yaml",
                                          ["agent.environment=null", "agent.env_options={}", "agent.tools=[calculator]"]))
