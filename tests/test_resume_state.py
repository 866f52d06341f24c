"""Resume carries every piece of state between steps: a run that crashes after a periodic checkpoint and is
resumed must equal the uninterrupted run exactly (every metric of every step and the final weights), with all
the stateful options on at once: the adaptive entropy coefficient, μ = num_iterations > 1, a KL term (β > 0),
the shuffled prompt sampler's position and a warmed-up cosine learning-rate schedule."""

from __future__ import annotations

import json

import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from tests.conftest import TINY_LORA_QUIET, reward_module, tiny_qwen2

VOCAB = 50_257  # GPT-2 tokenizer
TIMING = ("time/", "tokens_per_s", "train_tokens_per_s", "memory/")
STATEFUL = [
    "objective.use_adaptive_entropy=true",  # coefficient carried from step to step
    "objective.entropy_coef=0.01",
    "objective.entropy_coef_delta=0.02",
    "objective.entropy_target=100.0",  # always above the entropy: the coefficient grows every optimizer step
    "train.num_iterations=2",  # μ: two optimizer (and scheduler) steps per rollout
    "objective.beta=0.05",  # KL to the reference policy
    "data.shuffle=true",  # the sampler's position and permutation
    "optim.lr_scheduler_type=cosine",
    "optim.warmup_steps=2",
]


class Crash(Exception):
    pass


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "resume_rewards", '''
        def digits(prompts, completions, **fields):
            """Varies with the completion and with the prompt (so a resumed run on other prompts shows)."""
            return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) + sum(map(ord, p)) % 97 / 97
                    for p, c in zip(prompts, completions)]
    ''')


@pytest.fixture
def tok(gpt2_tokenizer_dir):
    """A GPT-2 tokenizer of its own (the session's `gpt2_tokenizer` must keep having no pad token)."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir))
    t.pad_token = t.eos_token
    t.padding_side = "left"
    return t


def _cfg(run_dir):
    return load_train_config(None, [
        f"train.output_dir={run_dir}",
        "train.max_steps=4",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "rollout.num_generations=4",
        "rollout.max_completion_length=5",
        "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[numeric_answer, resume_rewards:digits]",
        "optim.learning_rate=0.05",
        *TINY_LORA_QUIET,
        "checkpoint.save_steps=2",
        "checkpoint.save_total_limit=null",
        *STATEFUL,
    ])


def _train(run_dir, tok, **kw):
    return train(_cfg(run_dir), model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, **kw)


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(ckpt.resolve_checkpoint(run_dir) / "model" / "adapter_model.safetensors"))


def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path, tok, rewards_module, one_thread):
    full = _train(tmp_path / "full", tok)
    recs = full.records
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    # the options really carry state here: otherwise a dropped state would go unseen
    coefs = [r["entropy_coef"] for r in recs]
    assert coefs == pytest.approx([0.01 + 0.02 * 2 * s for s in (1, 2, 3, 4)])  # μ = 2 updates per step
    lrs = [r["learning_rate"] for r in recs]
    # after 2, 4, 6, 8 scheduler steps: end of the 2-step warmup, then cosine over the 6 remaining steps
    assert lrs == pytest.approx([0.05, 0.0375, 0.0125, 0.0], abs=1e-9)
    assert all(r["kl"] > 0 for r in recs[1:])  # the policy moved away from the reference

    def crash(event, step):  # an exception (not a clean stop) after the rollout of step 3
        if event == "after_rollout" and step == 3:
            raise Crash

    with pytest.raises(Crash):
        _train(tmp_path / "cut", tok, hook=crash)
    assert ckpt.read_latest(tmp_path / "cut" / "checkpoints").name == "step-000002"
    resumed = _train(tmp_path / "cut", tok, resume=tmp_path / "cut")
    assert [r["step"] for r in resumed.records] == [3, 4]
    assert _untimed(resumed.records) == _untimed(recs[2:])
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [3, 4]
