"""The trainer's update on multi-turn episodes: the real stages (plan_update, logprob_stage, micro_batch_backward)
on an episode rollout of the `hf` engine give the gradient of a hand-built full-batch oracle in which only the
model's tokens are trained and counted, for every micro-batch split (rows, token budgets, padded and packed);
only the model's tokens go through the lm_head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models import logprobs as logprobs_module
from logitless.objectives import (
    AdvantageOutput,
    ObjectiveOptions,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    initial_entropy_coef,
    loss_normalizer,
    merge_metrics,
    policy_loss,
)
from logitless.trainer.placement.engines import sampling_options
from logitless.trainer.memory.auto import resolve
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.context import build_context
from logitless.trainer.distributed.parallel import World
from logitless.trainer.stages import Rollout, Scored, logprob_stage, micro_batch_backward, plan_update
from tests.conftest import TINY_LORA_QUIET
from tests.episode_driver import ScriptedDriver
from tests.test_rollout_families import TOK, make_model

T = 0.9  # sampling temperature


def obs(b: int, k: int) -> list[int]:
    return TOK(f"[{b}:{k}]" + "~" * (b % 4), add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def episode_ctx(tmp_path_factory, one_thread):
    """A training context on a tiny Llama (LoRA, a reference policy for beta > 0) and one episode rollout of it:
    3 prompts x 4 samples, 1-4 turns each, some cut by the budget."""
    cfg = load_train_config(None, [
        f"train.output_dir={tmp_path_factory.mktemp('run')}", "train.prompts_per_step=3", "rollout.num_generations=4",
        "rollout.max_completion_length=40", f"rollout.temperature={T}", "objective.beta=0.04",
        "data.options={difficulty: 1, n: 40, chat: false, system_prompt: null, template: '{expression} ='}",
        *TINY_LORA_QUIET,
    ])
    ctx = build_context(cfg, World(), model=make_model("llama", "sdpa"), tokenizer=TOK)
    with torch.no_grad():  # adapters away from zero, so the policy differs from the reference
        for name, p in ctx.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    rows = ctx.sampler.next_batch(3)
    options = sampling_options(cfg.rollout, seed=7)
    drv = ScriptedDriver(lambda b: 1 + b % 4, obs, max_turn_tokens=7)
    batch = ctx.rollout.generate([r.prompt for r in rows], options, episodes=drv)
    assert batch.env_mask.sum() > 20 and batch.truncated.any() and not batch.truncated.all()
    ro = Rollout(rows, [rows[i] for i in batch.prompt_index.tolist()], batch, options)
    adv = torch.randn(12, generator=torch.Generator().manual_seed(3))
    adv[5] = 0.0  # a zero-advantage row (skipped when nothing else acts on it)
    scored = Scored(scores=None, adv=AdvantageOutput(adv, adv, torch.zeros(12, dtype=torch.bool), {}))
    return ctx, ro, scored


CASES = {
    "dapo": (dict(loss_type="dapo"), []),  # on-policy, the gradient hint path
    "dapo_rows1": (dict(loss_type="dapo"), ["train.micro_batch_size=1"]),
    "dapo_tokens_padded": (dict(loss_type="dapo"), ["train.micro_batch_tokens=160"]),
    "dapo_tokens_packed": (dict(loss_type="dapo"), ["train.micro_batch_tokens=160", "train.packed=true"]),
    "grpo_everything": (dict(loss_type="grpo", beta=0.04, entropy_coef=0.01, sampler_is_mode="token_truncate",
                             sampler_is_clip_max=2.0, top_entropy_quantile=0.5, mask_truncated_completions=True),
                        ["train.micro_batch_size=5", "train.packed=true"]),
    "bnpo_mu2": (dict(loss_type="bnpo", off_policy_mask_threshold=0.01), ["train.num_iterations=2",
                                                                         "train.micro_batch_tokens=120"]),
}


def trainer_gradient(ctx, ro, scored):
    """The stages' gradient of one optimizer step's first pass, and the rows the fused op computed."""
    seen = []
    real = logprobs_module.token_logprobs

    def spy(h, *args, **kwargs):
        seen.append(h.shape[0])
        return real(h, *args, **kwargs)

    logprobs_module.token_logprobs = spy
    try:
        plan = plan_update(ctx, ro, scored)
        oldref = logprob_stage(ctx, plan)
        seen.clear()
        ctx.model.train()
        metrics = []
        with ctx.lora_compute.stage():
            for i in range(len(plan.micro)):
                metrics.append(micro_batch_backward(ctx, plan, oldref, i, first=True)[1])
    finally:
        logprobs_module.token_logprobs = real
    grads = [p.grad.clone() for p in ctx.params]
    ctx.optimizer.zero_grad(set_to_none=True)
    return grads, plan, sum(seen), merge_metrics(metrics)


def oracle_gradient(ctx, ro, scored, o: ObjectiveOptions):
    """Full batch, every completion token through the lm_head, the objective on the loss mask."""
    b, adv = ro.batch, scored.adv.advantages
    loss_mask = b.completion_mask * (1 - b.env_mask)
    args = (b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)
    ctx.model.train()
    with ctx.lora_compute.stage():
        with torch.no_grad():
            old, old_ent = completion_logprobs(ctx.model, *args, temperature=T, with_entropy=True)
            with ctx.reference.use(ctx.model) as ref_model:
                ref = completion_logprobs(ref_model, *args, temperature=T)[0]
        logp, ent = completion_logprobs(ctx.model, *args, temperature=T, with_entropy=True)
        threshold = entropy_quantile_threshold(old_ent, loss_mask, o.top_entropy_quantile)  # as logprob_stage
        bonus = entropy_bonus_normalizer(o, [loss_mask], [b.truncated], entropies=[old_ent], threshold=threshold)
        out = policy_loss(logp, loss_mask, adv, o, loss_normalizer(o, [loss_mask], [b.truncated]), old_logp=old,
                          ref_logp=ref, sampler_logp=b.sampler_logp, entropy=ent, truncated=b.truncated,
                          entropy_threshold=threshold, entropy_normalizer=bonus)
        out.loss.backward()
    grads = [p.grad.clone() for p in ctx.params]
    ctx.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("case", list(CASES))
def test_stages_train_only_the_models_tokens(case, episode_ctx):
    ctx, ro, scored = episode_ctx
    objective, train = CASES[case]
    cfg = resolve(load_train_config(None, train), device=torch.device("cpu")).cfg  # "auto" decided, as a run's
    o = dataclasses.replace(ctx.cfg.objective, **{"beta": 0.0, **objective})
    saved = ctx.cfg, ctx.entropy_coef
    ctx.cfg = dataclasses.replace(ctx.cfg, train=cfg.train, objective=o)
    ctx.entropy_coef = initial_entropy_coef(o)
    try:
        grads, plan, computed, metrics = trainer_gradient(ctx, ro, scored)
    finally:
        ctx.cfg, ctx.entropy_coef = saved
    b = ro.batch
    loss_mask = b.completion_mask * (1 - b.env_mask)
    assert all(torch.equal(m.loss_mask, loss_mask[m.rows][:, : m.loss_mask.shape[1]]) for m in plan.micro)
    assert plan.n_tokens == int(loss_mask.sum())  # the step's token count: the model's tokens
    # only the model's tokens of the trained rows went through the lm_head (observations cost no FLOPs there)
    assert computed == int(loss_mask[plan.trained].sum())
    # the sampler-trainer mismatch: over the same tokens, where the hf sampler is the trainer's policy
    mismatch = metrics["rollout/mismatch"]
    assert int(mismatch.count) == computed and float(mismatch.max) < 1e-4
    expected = oracle_gradient(ctx, ro, scored, o)
    assert sum(float(g.abs().sum()) for g in expected) > 0
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-7)


def test_hand_built_dapo_oracle(episode_ctx):
    """On-policy dapo by hand: -Σ_model tokens A_i logp_it / (number of model tokens), from a dense forward of
    the whole sequence (observations attended to); the stages give its gradient."""
    ctx, ro, scored = episode_ctx
    saved = ctx.cfg
    ctx.cfg = dataclasses.replace(ctx.cfg, objective=dataclasses.replace(ctx.cfg.objective, beta=0.0))
    try:
        grads, _, _, _ = trainer_gradient(ctx, ro, scored)
    finally:
        ctx.cfg = saved
    b = ro.batch
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1)
    ctx.model.train()
    with ctx.lora_compute.stage():
        logits = ctx.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        P, W = b.prompt_ids.shape[1], b.completion_ids.shape[1]
        lp = torch.log_softmax(logits[:, P - 1 : P + W - 1].float() / T, -1)
        lp = lp.gather(-1, b.completion_ids[..., None])[..., 0]
        model_tokens = (b.completion_mask * (1 - b.env_mask)).bool()
        loss = -(scored.adv.advantages[:, None] * lp)[model_tokens].sum() / model_tokens.sum()
        loss.backward()
    for g, p in zip(grads, ctx.params):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
    ctx.optimizer.zero_grad(set_to_none=True)
