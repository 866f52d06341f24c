"""train.steps_per_rollout (TRL's steps_per_generation): k optimizer steps on k disjoint parts of one rollout batch,
each normalized over its own part, old logprobs taken before the first; the same parameters as two optimizer
steps on the two halves of the batch, each planned as a batch of its own."""

from __future__ import annotations


import pytest
import torch

from logitless.objectives import AdvantageOutput
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.context import build_context
from logitless.trainer.dynamic import select_rows, select_scores
from logitless.trainer.loop import train
from logitless.trainer.policy.modeling import trainable_parameters
from logitless.trainer.distributed.parallel import World
from logitless.trainer.stages import Rollout, Scored, logprob_stage, plan_update, rollout_stage, score_stage, update_stage
from tests.conftest import TINY_LORA_QUIET, reward_module, tiny_qwen2
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

VOCAB = 50_257


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "spr_rewards", '''
        def digits(prompts, completions, **fields):
            return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in completions]
    ''')


def _cfg(run_dir, *overrides):
    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=1", "train.prompts_per_step=4", "train.micro_batch_size=3",
        "rollout.num_generations=4", "rollout.max_completion_length=5", "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[spr_rewards:digits]", "optim.learning_rate=0.05", *TINY_LORA_QUIET,
        "checkpoint.save_steps=0", "objective.loss_type=grpo", *overrides,
    ])


def _half(ro: Rollout, scored: Scored, groups: list[int], G: int) -> tuple[Rollout, Scored]:
    """The groups `groups` of a step as a rollout of its own, with the advantages of the whole batch."""
    rows = torch.tensor([g * G + j for g in groups for j in range(G)])
    a = scored.adv
    adv = AdvantageOutput(a.advantages[rows], a.total_reward[rows], a.zero_variance[rows], a.metrics)
    sub = Rollout([ro.rows[g] for g in groups], [ro.sample_rows[i] for i in rows.tolist()],
                  select_rows(ro.batch, rows), ro.options)
    return sub, Scored(select_scores(scored.scores, rows), adv)


def _params(model):
    return [p.detach().clone() for p in trainable_parameters(model)]


def test_two_steps_per_rollout_equal_two_steps_on_the_halves(tmp_path, tok, rewards_module, one_thread):
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    rec = train(_cfg(tmp_path / "a", "train.steps_per_rollout=2"), model=model, tokenizer=tok).records[0]
    got = _params(model)

    cfg = _cfg(tmp_path / "b", "train.steps_per_rollout=2")
    ctx = build_context(cfg, World(), model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok)
    start = _params(ctx.model)
    ro = rollout_stage(ctx, 1)
    scored = score_stage(ctx, ro)
    halves = [_half(ro, scored, g, 4) for g in ([0, 1], [2, 3])]
    plans = [plan_update(ctx, sub, sc) for sub, sc in halves]  # each half normalized as a batch of its own
    oldrefs = [logprob_stage(ctx, p) for p in plans]  # old logprobs of the policy that sampled
    lrs = []
    for p, o in zip(plans, oldrefs):  # two optimizer steps, one per half
        lrs.append(ctx.optimizer.param_groups[0]["lr"])
        update_stage(ctx, p, o)
    ctx.logger.close()
    want = _params(ctx.model)
    assert all(torch.allclose(g, w, rtol=0, atol=1e-7) for g, w in zip(got, want))
    assert lrs == [0.05, 0.05] and rec["trained_rows"] == 16
    assert max((g - s).abs().max().item() for g, s in zip(got, start)) > 1e-3  # the steps moved the adapters


def test_one_step_on_the_whole_batch_differs(tmp_path, tok, rewards_module, one_thread):
    """The split changes the result (so the test above can fail): one optimizer step on all 4 groups."""
    m1, m2 = (tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1) for _ in range(2))
    a = train(_cfg(tmp_path / "a", "train.steps_per_rollout=2"), model=m1, tokenizer=tok).records[0]
    b = train(_cfg(tmp_path / "b"), model=m2, tokenizer=tok).records[0]
    assert a["reward/mean"] == b["reward/mean"]  # the same rollout
    assert max((x - y).abs().max().item() for x, y in zip(_params(m1), _params(m2))) > 1e-4


def test_steps_per_rollout_must_divide_the_prompts(tmp_path):
    with pytest.raises(ValueError, match=r"train.prompts_per_step=4 is not a multiple of it"):
        _cfg(tmp_path / "a", "train.steps_per_rollout=3")
