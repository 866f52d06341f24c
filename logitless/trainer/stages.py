"""The stages of one GRPO step, each a function with typed inputs and outputs:

    rollout_stage → score_stage → plan_update → logprob_stage → update_stage → step_record

`loop.train` runs them in order; each can be called (and tested) alone on a `TrainContext`. The update stage
is the one place that knows how micro-batches become optimizer steps. With train.steps_per_rollout = k the step's
rows are split into k parts of whole prompt groups (`part_rows`), each planned on its own (its own normalizer) and
trained by its own optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from logitless.data import PromptRow
from logitless.models.routing import balance_of, check_routes, collect_balance, require_routing, routing_scope
from logitless.objectives import (
    AdvantageOutput,
    Stat,
    compute_advantages,
    controlled_entropy,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    loss_normalizer,
    merge_metrics,
    on_policy_logp_grad,
    policy_loss,
    update_entropy_coef,
)
from logitless.objectives.mismatch import sampler_mismatch
from logitless.rewards import RewardScores, add_reward_column, score_completions
from logitless.rollout import RolloutBatch, SamplingOptions
from logitless.trainer.batching import MicroBatch, padding_backward, rollout_micro_batches
from logitless.trainer.builders import clip_offloaded_grads, torch_threads
from logitless.trainer.context import TrainContext
from logitless.trainer.distributed.collectives import all_reduce_metrics, all_reduce_sum
from logitless.trainer.distributed.parallel import (
    clip_grad_norm,
    model_logprobs,
    rank_seed,
    rank_share,
)
from logitless.trainer.episodes import (
    ENVIRONMENT_REWARD,
    TurnCredit,
    environment_rewards,
    environment_weight,
    reward_completions,
    turn_credit,
)
from logitless.trainer.placement.engines import sampling_options
from logitless.trainer.policy.offload import ActivationOffload, optimizer_state

MAX_EMPTY_STEPS = 3  # consecutive steps whose completions are all empty before the run is stopped


@dataclass
class Rollout:
    rows: list[PromptRow]  # the step's prompts
    sample_rows: list[PromptRow]  # [B] the prompt row of each sample
    batch: RolloutBatch  # B = len(rows) * G samples, on the training device
    options: SamplingOptions


@dataclass
class Scored:
    scores: RewardScores  # rewards [B, R], weighted total [B], error counts
    adv: AdvantageOutput  # advantages [B] and their metrics (credit=turn: the turns' metrics and zero-variance rows)
    turn: TurnCredit | None = None  # advantage.credit=turn: each turn's and each token's advantage

    @property
    def advantages(self) -> torch.Tensor:
        """What the update trains with: [B, T] per token (advantage.credit=turn), else [B] per episode."""
        return self.turn.tokens if self.turn is not None else self.adv.advantages


@dataclass
class UpdatePlan:
    micro: list[MicroBatch]  # the rows that are trained, longest first
    trained: torch.Tensor  # [n] long, rows run in the update (all B unless zero-advantage rows are skipped)
    normalizer: float  # the objective's denominator over the whole step, all ranks
    n_tokens: int  # completion tokens of the step, all ranks
    temperature: float  # of the sampler's logprobs, which the trainer's logprobs must match
    padding: int = 0  # trailing micro-batches that only keep the ranks' collectives in step (zero gradient)


@dataclass
class OldRef:
    old_logp: list[torch.Tensor | None]  # per micro-batch [b, t] (μ > 1), else None
    ref_logp: list[torch.Tensor | None]  # per micro-batch [b, t] (β > 0), else None
    threshold: float | None  # top-entropy mask threshold over the step's tokens
    bonus_normalizer: float  # tokens the entropy bonus acts on, over the step and all ranks


@dataclass
class UpdateResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    grad_norms: list[float] = field(default_factory=list)
    metrics: list[dict[str, Stat]] = field(default_factory=list)  # objective metrics per optimizer step
    nonfinite: int = 0  # optimizer steps skipped because the loss or the gradient norm was nan or infinite


def _entropy_terms(ctx: TrainContext) -> tuple[bool, bool]:
    """(top-entropy mask on, entropy in the gradient)."""
    o = ctx.cfg.objective
    return o.top_entropy_quantile < 1.0, o.entropy_coef > 0 or o.use_adaptive_entropy


def rollout_seed(cfg: Any, step: int, round: int = 0) -> int:
    """The sampling seed of a step's rollout (`round` > 0: the extra rollouts of train.dynamic_sampling)."""
    return cfg.train.seed * 1_000_003 + step + round * 2**40


def rollout_stage(ctx: TrainContext, step: int, round: int = 0) -> Rollout:
    """G samples for each of the step's prompts, with the sampler's logprobs. With train.async_rollout they were
    started during the step before, and the next step's rollout starts here (trainer/placement/async_rollout.py). With an
    agent each sample is a multi-turn episode: the agent renders the prompts (tools in the chat template, an
    environment's first observation) and answers the model between turns. `round`: which rollout of the step this
    is (train.dynamic_sampling draws more than one)."""
    cfg = ctx.cfg

    def options_of(s: int) -> SamplingOptions:  # this rank's sampling options of step s's rollout
        return sampling_options(cfg.rollout, seed=rank_seed(rollout_seed(cfg, s, round), ctx.world),
                                chat_template_kwargs=cfg.data.chat_template_kwargs)

    options = options_of(step)
    prefetch = ctx.rollout.prefetch
    if prefetch is not None:  # under torchrun each rank's share, from its replica (the sync is a collective)
        if prefetch.pending is None:  # the first step of a run
            prefetch.start(step, options)
        rows, batch, options = prefetch.take(step)
        if step < cfg.train.max_steps:
            prefetch.start(step + 1, options_of(step + 1))
        batch = batch.to(ctx.device)
    else:
        rows = rank_share(ctx.sampler.next_batch(cfg.train.prompts_per_step), ctx.world)  # all of them on one process
        with torch_threads(cfg.rollout.num_threads), rollout_state(ctx):
            if ctx.agent is not None:
                driver = ctx.agent.driver(rows, cfg.rollout.num_generations)
                batch = ctx.rollout.generate(driver.prompt_ids, options, episodes=driver).to(ctx.device)
            else:
                batch = ctx.rollout.generate([r.prompt for r in rows], options).to(ctx.device)
    return Rollout(rows, [rows[i] for i in batch.prompt_index.tolist()], batch, options)


@contextlib.contextmanager
def rollout_state(ctx: TrainContext) -> Iterator[None]:
    """The rollout's weights current (`rollout_weights`) and, with train.offload_during_rollout, the training state
    parked (`parked_state`). With a replica the shards are parked first and the sync reads them back one unit (a
    weight) at a time, so the device never holds every shard beside the whole replica; without one (the hf
    backend decodes from the sharded model) the optimizer states are parked after the weights are gathered."""
    if ctx.rollout.replica is not None and ctx.cfg.train.offload_during_rollout:
        with parked_state(ctx), ctx.rollout.weights(ctx.model, lend=ctx.parked.lend):
            yield
    else:
        with ctx.rollout.weights(ctx.model), parked_state(ctx):
            yield


@contextlib.contextmanager
def parked_state(ctx: TrainContext) -> Iterator[None]:
    """With train.offload_during_rollout: the optimizer states (and the parameter shards, when the engine decodes
    from a replica) in host memory for the duration of the block."""
    if not ctx.cfg.train.offload_during_rollout:
        yield
        return
    tensors = optimizer_state(ctx.optimizer, ctx.device)
    if ctx.rollout.replica is not None:  # the shards on the device (with train.fsdp_offload they are on the host already)
        tensors += [p for p in ctx.model.parameters() if p.device.type == ctx.device.type]  # (a DTensor: its shard's)
    ctx.parked.park(tensors)
    try:
        yield
    finally:
        ctx.parked.unpark()


def score_stage(ctx: TrainContext, ro: Rollout) -> Scored:
    """Rewards [B, R] of every sample and group advantages (`advantages_of`)."""
    r = ctx.cfg.reward
    prompts = [x.prompt for x in ro.sample_rows]
    scores = score_completions(  # multi-turn episodes: the whole conversation (trainer/episodes.py)
        ctx.reward_fns, r.reward_weights, prompts, reward_completions(ctx.tokenizer, ro.batch, prompts), ro.sample_rows,
        on_error=r.on_error, penalty=r.error_penalty, timeout_s=r.timeout_s,
    )
    weight = environment_weight(ctx.cfg)
    if weight is not None:  # the environment's own episode rewards: one more column (ctx.adv_options weighs it)
        scores = add_reward_column(scores, ENVIRONMENT_REWARD, environment_rewards(ro.batch), weight)
    return advantages_of(ctx, ro.batch, scores)


def advantages_of(ctx: TrainContext, batch: RolloutBatch, scores: RewardScores) -> Scored:
    """The advantages of this process's rows (whole prompt groups: under torchrun each rank holds whole groups, so
    every group statistic is the one-process value; the batch-wide options are refused there): per episode, and
    with advantage.credit=turn per model turn and token (trainer/episodes.py), before any micro-batch split."""
    G, o = ctx.cfg.rollout.num_generations, ctx.adv_options
    adv = compute_advantages(scores.rewards, G, o)
    if o.credit != "turn":
        return Scored(scores, adv)
    turn = turn_credit(batch, scores.rewards, scores.names, o, G)
    adv = AdvantageOutput(adv.advantages, adv.total_reward, turn.turns.zero_variance, {**adv.metrics, **turn.turns.metrics})
    return Scored(scores, adv, turn)


def check_empty(ctx: TrainContext, ro: Rollout, step: int) -> None:
    """Warn on a step whose completions are all empty; stop the run after MAX_EMPTY_STEPS of them."""
    if not all(not c.strip() for c in ro.batch.completions):
        ctx.empty_steps = 0
        return
    ctx.empty_steps += 1
    warnings.warn(f"step {step}: every completion is empty (the model ends at once)", stacklevel=2)
    if ctx.empty_steps >= MAX_EMPTY_STEPS:
        raise ValueError(
            f"every completion of the last {MAX_EMPTY_STEPS} steps is empty: the model emits EOS first. Check the "
            "tokenizer's EOS token and chat template (model.name_or_path), rollout.stop and "
            "rollout.max_completion_length"
        )


def part_rows(ro: Rollout, k: int) -> list[torch.Tensor | None]:
    """The rows of each of k optimizer steps on one rollout batch (train.steps_per_rollout): k parts of whole prompt
    groups in order, [B / k] long each; [None] (all rows) for k = 1."""
    if k == 1:
        return [None]
    B, G = ro.batch.prompt_index.numel(), ro.options.num_generations
    groups = torch.arange(B // G).tensor_split(k)  # k parts (a short dynamic-sampling step: some may be empty)
    return [(g.view(-1, 1) * G + torch.arange(G)).view(-1) for g in groups]


def merge_plans(plans: list[UpdatePlan]) -> UpdatePlan:
    """One plan standing for the parts of a step (for its metrics): every trained row and token."""
    if len(plans) == 1:
        return plans[0]
    return UpdatePlan([m for p in plans for m in p.micro], torch.cat([p.trained for p in plans]),
                      sum(p.normalizer for p in plans), sum(p.n_tokens for p in plans), plans[0].temperature,
                      sum(p.padding for p in plans))


def plan_update(ctx: TrainContext, ro: Rollout, scored: Scored, rows: torch.Tensor | None = None) -> UpdatePlan:
    """Micro-batches of the rows worth training, and the global loss normalizer of one optimizer step; `rows`: the
    part of the batch that step trains on (train.steps_per_rollout), default all."""
    cfg, b = ctx.cfg, ro.batch
    o = cfg.objective
    top_entropy, entropy_grad = _entropy_terms(ctx)
    adv = scored.advantages.to(ctx.device)  # [B], or [B, T] with advantage.credit=turn
    # Rows with advantage 0 add exactly 0 to the loss and its gradient when there is no KL or entropy term, so
    # they are not run (they still count in the normalizer, which is taken over all rows).
    part = torch.arange(b.completion_mask.shape[0], device=ctx.device) if rows is None else rows.to(ctx.device)
    trained = part
    if cfg.train.skip_zero_advantage and o.beta == 0 and not (entropy_grad or top_entropy or
                                                              cfg.model.router_aux_loss_coef):
        nonzero = adv[part] != 0
        trained = part[nonzero if nonzero.dim() == 1 else nonzero.any(1)]
    loss = b.loss_mask()  # [B, T] the model's tokens (completion_mask itself without episodes)
    if b.prompt_routes is not None:  # once per step (one host sync): a route naming no expert of the model fails here
        for r in (b.prompt_routes, b.completion_routes):
            check_routes(r, require_routing(ctx.model, "model.routing_replay").num_experts)
    # (the mixture-of-experts routes and the images of the rows go with them: every forward replays / reads them)
    micro, padding = rollout_micro_batches(b, adv, trained, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens,
                                           cfg.train.packed, ctx.device)
    mask, truncated = (loss, b.truncated) if rows is None else (loss[part], b.truncated[part])
    n_local = int(mask.sum())
    n_tokens = int(all_reduce_sum(n_local, ctx.device))
    normalizer = all_reduce_sum(loss_normalizer(o, [mask], [truncated]) if n_local else 0.0, ctx.device)
    return UpdatePlan(micro + padding, trained, normalizer, n_tokens, ro.options.logp_temperature, len(padding))


@torch.no_grad()
def logprob_stage(ctx: TrainContext, plan: UpdatePlan) -> OldRef:
    """Old-policy (μ > 1 or several optimizer steps per rollout, or the entropies of the top-entropy mask) and
    reference (β > 0) logprobs, no grad."""
    mu = ctx.cfg.train.num_iterations * ctx.cfg.train.steps_per_rollout  # optimizer steps on this rollout
    top_entropy, packed = _entropy_terms(ctx)[0], ctx.cfg.train.packed
    old: list[torch.Tensor | None] = [None] * len(plan.micro)
    ref: list[torch.Tensor | None] = [None] * len(plan.micro)
    entropies = []
    with ctx.lora_compute.stage():  # the old-policy logprobs computed as the update computes them
        for i, m in enumerate(plan.micro):
            args = (ctx.model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask)
            if mu > 1 or top_entropy:
                with ctx.lora_compute.forward():
                    logp, ent = model_logprobs(*args, temperature=plan.temperature, with_entropy=top_entropy,
                                               packed=packed, logp_mask=m.loss_mask, **m.inputs)
                old[i] = logp if mu > 1 else None
                entropies += [ent] if top_entropy else []
            if ctx.reference is not None:
                with ctx.reference.use(ctx.model) as ref_model, ctx.lora_compute.forward():
                    ref[i] = model_logprobs(ref_model, *args[1:], temperature=plan.temperature, packed=packed,
                                            logp_mask=m.loss_mask, **m.inputs)[0]
    real = plan.micro[: len(plan.micro) - plan.padding]  # padding passes (torchrun) keep collectives in step only
    threshold = None  # one threshold over the whole step's tokens
    if top_entropy:
        q = ctx.cfg.objective.top_entropy_quantile
        threshold = entropy_quantile_threshold(entropies[: len(real)], [m.loss_mask for m in real], q)
    bonus_normalizer = all_reduce_sum(entropy_bonus_normalizer(
        ctx.cfg.objective, [m.loss_mask for m in real], [m.truncated for m in real],
        entropies=entropies[: len(real)] or None, threshold=threshold), ctx.device)
    return OldRef(old, ref, threshold, bonus_normalizer)


def micro_batch_backward(ctx: TrainContext, plan: UpdatePlan, oldref: OldRef, i: int,
                         first: bool = False) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Loss of micro-batch i (already divided by the step's normalizer), back-propagated; (loss, metrics). In the
    step's first optimizer pass (`first`) the metrics also hold the sampler–trainer mismatch of its tokens."""
    o, m = ctx.cfg.objective, plan.micro[i]
    if ctx.on_micro_batch is not None:
        ctx.on_micro_batch(i)
    if i >= len(plan.micro) - plan.padding:
        return padding_backward(ctx.model, m, plan.temperature, forward=ctx.lora_compute.forward), {}
    entropy_grad = _entropy_terms(ctx)[1]
    # On-policy without KL/IS/entropy terms d loss / d logp is known before the forward, so the fused op can form
    # its gradients there (a speed hint; None otherwise).
    off_policy = ctx.cfg.train.num_iterations > 1 or ctx.cfg.train.steps_per_rollout > 1
    hint = None if off_policy else on_policy_logp_grad(
        m.loss_mask, m.advantages, o, plan.normalizer, sampler_logp=m.sampler_logp, truncated=m.truncated,
        entropy_coef=ctx.entropy_coef.effective if entropy_grad else 0.0,
    )
    balance_coef = ctx.cfg.model.router_aux_loss_coef
    # The routes stay set through the backward, whose gradient-checkpoint recompute replays them too.
    with routing_scope(ctx.model) as routing:
        if balance_coef:
            collect_balance(routing)
        # Activation offload: the tensors this forward saves for backward wait in host memory
        # (trainer/policy/offload.py).
        with ActivationOffload(ctx.model) if ctx.cfg.model.activation_offload else contextlib.nullcontext(), \
                ctx.lora_compute.forward():
            logp, entropy = model_logprobs(
                ctx.model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                temperature=plan.temperature, with_entropy=True, grad_hint=hint, packed=ctx.cfg.train.packed,
                logp_mask=m.loss_mask, **m.inputs,
            )
        # the routers' own top-k against the sampler's routes, in this forward (before the optimizer step)
        disagreement = route_disagreement(routing.stats) if first and m.routes and routing is not None else {}
        out = policy_loss(
            logp, m.loss_mask, m.advantages, o, plan.normalizer, old_logp=oldref.old_logp[i],
            ref_logp=oldref.ref_logp[i], sampler_logp=m.sampler_logp,
            entropy=entropy if entropy_grad else entropy.detach(), truncated=m.truncated,
            entropy_coef=ctx.entropy_coef.effective, entropy_threshold=oldref.threshold,
            entropy_normalizer=oldref.bonus_normalizer,
        )
        loss, metrics = out.loss, out.metrics
        if balance_coef:  # weighted by the micro-batch's share of the step's trained tokens (all ranks)
            balance = balance_of(routing)
            loss = loss + balance_coef * balance * (m.loss_mask.sum() / max(plan.n_tokens, 1))
            metrics = {**metrics, "train/router_balance_loss": Stat.of(balance)}
        loss.backward()
    if first:  # the policy the rollout sampled from (no optimizer step yet), against the engine's logprobs
        # over the model's tokens (multi-turn episodes: observations have neither logprob)
        return loss.detach(), {**metrics, **sampler_mismatch(logp, m.sampler_logp, m.loss_mask), **disagreement}
    return loss.detach(), metrics


ROUTE_DISAGREEMENT = "rollout/route_disagreement"


def route_disagreement(stats: torch.Tensor) -> dict[str, Stat]:
    """{rollout/route_disagreement: Stat}: the share of routed (token, MoE layer) pairs whose live router's top-k
    differs as a set from the sampler's recorded route, from a forward's per-layer counts `stats` [layers, 2]."""
    differ, routed = stats[:, 0].sum(), stats[:, 1].sum()
    return {ROUTE_DISAGREEMENT: Stat(differ, routed, (differ == routed).to(torch.float64),
                                     (differ > 0).to(torch.float64))}


def optimizer_step(ctx: TrainContext, loss: float) -> tuple[float, bool]:
    """Clip, step, schedule, zero; returns the gradient norm before clipping and whether the weights were updated.

    A non-finite `loss` (the step's, all ranks) or gradient norm (over all ranks, so every rank decides alike) skips
    the AdamW step and the schedule's: the weights, the optimizer's moments and the learning rate stay as they were
    (finite), and the gradients are dropped, as a mixed-precision loss scaler skips an overflowing step."""
    for p in ctx.params:  # a step without trained rows still is an AdamW step with zero gradients
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    max_norm = ctx.cfg.optim.max_grad_norm if ctx.cfg.optim.max_grad_norm is not None else math.inf
    norm = clip_grad_norm(ctx.params, max_norm)  # plain or FSDP2 DTensor gradients
    finite = math.isfinite(norm) and math.isfinite(loss)
    if finite:
        clip_offloaded_grads(ctx.optimizer, norm, max_norm)
        ctx.optimizer.step()
        ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return norm, finite


def update_stage(ctx: TrainContext, plan: UpdatePlan | list[UpdatePlan], oldref: OldRef | list[OldRef]) -> UpdateResult:
    """μ passes, each one optimizer step over all micro-batches of each plan (one plan, or one per part of the
    batch with train.steps_per_rollout); adapts the entropy coefficient after each optimizer step."""
    res = UpdateResult()
    ctx.model.train()
    plans, oldrefs = (plan, oldref) if isinstance(plan, list) else ([plan], [oldref])
    # the sampler-trainer mismatch is measured where the policy is still the sampler's: the first part's first pass
    passes = [(it == 0 and j == 0, p, o) for it in range(ctx.cfg.train.num_iterations)
              for j, (p, o) in enumerate(zip(plans, oldrefs))]
    for first, plan, oldref in passes:
        step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)  # on device: no host sync per micro-batch
        parts = []
        with ctx.lora_compute.stage():  # forwards and backwards (recomputes) alike
            for i in range(len(plan.micro)):
                loss, metrics = micro_batch_backward(ctx, plan, oldref, i, first=first)
                step_loss += loss
                parts += [metrics] if i < len(plan.micro) - plan.padding else []
        res.losses.append(all_reduce_sum(float(step_loss), ctx.device))
        norm, applied = optimizer_step(ctx, res.losses[-1])
        res.grad_norms.append(norm)
        res.nonfinite += not applied
        merged = all_reduce_metrics(merge_metrics(parts), ctx.device)
        res.metrics.append(merged)
        if ctx.cfg.objective.use_adaptive_entropy:
            ctx.entropy_coef = update_entropy_coef(ctx.entropy_coef.coef, controlled_entropy(merged), ctx.cfg.objective)
    return res
