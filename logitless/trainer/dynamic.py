"""The rollout and scoring of a step, with DAPO's dynamic sampling when `train.dynamic_sampling` is on.

Dynamic sampling (DAPO §3.2; verl's `algorithm.filter_groups`, open-instruct's `active_sampling`; TRL has none)
drops the prompt groups whose advantages are all zero (every sample got the same reward: no gradient signal)
and samples `train.prompts_per_step` more prompts until the step holds `train.prompts_per_step` groups with a
non-zero advantage, in sampling order (extra ones are dropped, as in verl), or until
`train.dynamic_sampling_max_rounds` rollouts were drawn. A step still short trains on the informative groups it
has and logs the shortfall; a step with none keeps its first rollout (a no-op update, as without dynamic sampling).

Reproducible and resumable: round r of step s samples with its own seed (`stages.rollout_seed(cfg, s, r)`; round
0 is the seed of a step without dynamic sampling), the extra prompts come from the run's prompt sampler (whose
position the checkpoint holds), and nothing carries from one step to the next, so a resumed run equals the
uninterrupted one. Advantages are computed again over the kept groups (batch-level scaling sees the kept batch).

A stop signal is honoured between rounds (`signals.check_stop`: the step is dropped), and a warning says so when
WARN_ROUNDS rounds (then 2x, 4x as many...) brought no informative group.

Metrics: reward/*, accuracy and reward errors over every sampled row of every round (what the policy did);
dynamic/rounds, dynamic/groups (sampled), dynamic/informative (groups with a signal among them),
dynamic/kept (trained), dynamic/shortfall (prompts_per_step - kept).
"""

from __future__ import annotations

import torch

from logitless.models.vision import ImageInputs
from logitless.models.routing import no_route
from logitless.rewards import RewardScores
from logitless.rollout import RolloutBatch, RolloutTiming
from logitless.trainer.report.accounting import PhaseTimer
from logitless.trainer.context import TrainContext
from logitless.trainer.distributed.parallel import agree
from logitless.trainer.signals import check_stop
from logitless.trainer.report.metrics import reward_metrics
from logitless.trainer.stages import Rollout, Scored, advantages_of, rollout_stage, score_stage

WARN_ROUNDS = 8  # rounds without an informative group before the first warning (then at 2x, 4x, ...)


def _pad(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    """[n, w, ...] -> [n, width, ...], padded with `value` on the left or right."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One RolloutBatch of several rollouts' rows in order: prompts left-padded, completions right-padded to the
    widest; prompt_index counts on across batches; timing summed."""
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_ids.shape[1] for b in batches)
    T = max(b.completion_ids.shape[1] for b in batches)
    offsets, n = [], 0
    for b in batches:
        offsets.append(n)
        n += int(b.prompt_index.max()) + 1 if b.prompt_index.numel() else 0
    with_env = any(b.env_mask is not None for b in batches)
    seconds = sum(b.timing.seconds for b in batches)
    tokens = sum(b.timing.num_tokens for b in batches)
    return RolloutBatch(
        prompt_ids=torch.cat([_pad(b.prompt_ids, P, pad_id, left=True) for b in batches]),
        prompt_mask=torch.cat([_pad(b.prompt_mask, P, 0, left=True) for b in batches]),
        completion_ids=torch.cat([_pad(b.completion_ids, T, pad_id, left=False) for b in batches]),
        completion_mask=torch.cat([_pad(b.completion_mask, T, 0, left=False) for b in batches]),
        sampler_logp=torch.cat([_pad(b.sampler_logp, T, 0.0, left=False) for b in batches]),
        finished=torch.cat([b.finished for b in batches]),
        truncated=torch.cat([b.truncated for b in batches]),
        prompt_index=torch.cat([b.prompt_index + off for b, off in zip(batches, offsets)]),
        completions=[c for b in batches for c in b.completions],
        timing=RolloutTiming(seconds=seconds, num_tokens=tokens, tokens_per_s=tokens / max(seconds, 1e-9),
                             generate_seconds=sum(b.timing.generate_seconds for b in batches)),
        env_mask=torch.cat([_pad(b.env_mask if b.env_mask is not None else torch.zeros_like(b.completion_mask), T, 0,
                                 left=False) for b in batches]) if with_env else None,
        episodes=[e for b in batches for e in (b.episodes or [None] * len(b.completions))]
        if any(b.episodes is not None for b in batches) else None,
        images=ImageInputs([r for b in batches for r in (b.images.rows if b.images is not None
                                                           else [None] * len(b.completions))])
        if any(b.images is not None for b in batches) else None,
        **_concat_routes(batches, P, T),
    )


def _concat_routes(batches: list[RolloutBatch], P: int, T: int) -> dict[str, torch.Tensor]:
    """The batches' mixture-of-experts routes padded like their ids (with the no-route sentinel); {} without."""
    if batches[0].prompt_routes is None:
        return {}
    none = no_route(batches[0].prompt_routes.dtype)
    return {"prompt_routes": torch.cat([_pad(b.prompt_routes, P, none, left=True) for b in batches]),
            "completion_routes": torch.cat([_pad(b.completion_routes, T, none, left=False) for b in batches])}


def select_rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """The rows `rows` ([n] long, whole groups in order) of a batch, prompt_index renumbered 0, 1, ..."""
    idx = rows.to(batch.prompt_index.device)
    take = lambda t: t.index_select(0, idx.to(t.device)) if t is not None else None  # noqa: E731
    _, prompt_index = torch.unique_consecutive(batch.prompt_index.index_select(0, idx), return_inverse=True)
    keep = rows.tolist()
    return RolloutBatch(
        prompt_ids=take(batch.prompt_ids), prompt_mask=take(batch.prompt_mask), completion_ids=take(batch.completion_ids),
        completion_mask=take(batch.completion_mask), sampler_logp=take(batch.sampler_logp), finished=take(batch.finished),
        truncated=take(batch.truncated), prompt_index=prompt_index, completions=[batch.completions[i] for i in keep],
        timing=batch.timing, env_mask=take(batch.env_mask), prompt_routes=take(batch.prompt_routes),
        completion_routes=take(batch.completion_routes),
        episodes=[batch.episodes[i] for i in keep] if batch.episodes is not None else None,
        images=batch.images.select(keep) if batch.images is not None else None,
    )


def concat_scores(parts: list[RewardScores]) -> RewardScores:
    """The scores of several rollouts' rows in order; error counts summed, each function's first error kept."""
    if len(parts) == 1:
        return parts[0]
    texts = [next((p.error_texts[k] for p in parts if p.error_texts and p.error_texts[k]), None)
             for k in range(len(parts[0].names))]
    return RewardScores(
        rewards=torch.cat([p.rewards for p in parts]), total=torch.cat([p.total for p in parts]), names=parts[0].names,
        num_none=[sum(c) for c in zip(*(p.num_none for p in parts))],
        num_errors=[sum(c) for c in zip(*(p.num_errors for p in parts))], error_texts=texts,
    )


def select_scores(scores: RewardScores, rows: torch.Tensor) -> RewardScores:
    idx = rows.to(scores.rewards.device)
    return RewardScores(rewards=scores.rewards.index_select(0, idx), total=scores.total.index_select(0, idx),
                        names=scores.names, num_none=scores.num_none, num_errors=scores.num_errors,
                        error_texts=scores.error_texts)


def sample_step(ctx: TrainContext, step: int, timer: PhaseTimer) -> tuple[Rollout, Scored, RewardScores, dict]:
    """(rollout to train on, its scores and advantages, the scores of every sampled row, extra metrics)."""
    if not ctx.cfg.train.dynamic_sampling:
        with timer("generate"):
            ro = rollout_stage(ctx, step)
        with timer("score"):
            scored = score_stage(ctx, ro)
        return ro, scored, scored.scores, {}
    cfg, G = ctx.cfg, ctx.cfg.rollout.num_generations
    want, rounds = cfg.train.prompts_per_step, cfg.train.dynamic_sampling_max_rounds
    rollouts: list[Rollout] = []
    scores: list[RewardScores] = []
    informative: list[torch.Tensor] = []  # per round: [groups] bool
    for r in range(rounds):
        if r:  # a stop signal: the step is dropped (under torchrun the ranks agree, as their rounds must match)
            check_stop((lambda v: agree(v, ctx.device)) if ctx.world.distributed else None)
        if r >= WARN_ROUNDS and r & (r - 1) == 0 and not any(bool(x.any()) for x in informative):
            ctx.logger.print(
                f"[yellow]warning:[/] step {step}: {r} rounds of dynamic sampling found no prompt whose samples got "
                f"different rewards (no gradient signal); it goes on for up to train.dynamic_sampling_max_rounds="
                f"{rounds}. Check that the reward functions can tell the completions apart (a constant reward, "
                f"completions cut at rollout.max_completion_length), or lower train.dynamic_sampling_max_rounds")
        with timer("generate"):
            ro = rollout_stage(ctx, step, round=r)
        with timer("score"):
            scored = score_stage(ctx, ro)
        rollouts.append(ro)
        scores.append(scored.scores)
        informative.append(~scored.adv.zero_variance.view(-1, G)[:, 0].cpu())
        if int(sum(int(x.sum()) for x in informative)) >= want:
            break
    flags = torch.cat(informative)  # [groups of every round]
    groups = flags.nonzero().view(-1)[:want]
    if groups.numel() == 0:  # nothing to learn from: the first rollout, as a step without dynamic sampling has
        groups = torch.arange(want)
    rows = (groups.view(-1, 1) * G + torch.arange(G)).view(-1)  # [kept groups * G]
    pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else 0
    every = concat_batches([x.batch for x in rollouts], pad)
    all_scores = concat_scores(scores)
    sample_rows = [row for x in rollouts for row in x.sample_rows]
    batch = select_rows(every, rows.to(every.prompt_index.device))
    kept = Rollout(rows=[sample_rows[int(g) * G] for g in groups], sample_rows=[sample_rows[i] for i in rows.tolist()],
                   batch=batch, options=rollouts[0].options)
    kept_scores = select_scores(all_scores, rows)
    scored = advantages_of(ctx, batch, kept_scores)
    n_informative = int(flags.sum())
    metrics = reward_metrics(all_scores.rewards, all_scores.total, all_scores.names, ctx.acc_col)
    metrics.update({f"reward/{n}/errors": e for n, e in zip(all_scores.names, all_scores.num_errors) if e})
    metrics.update({f"reward/{n}/none": c for n, c in zip(all_scores.names, all_scores.num_none) if c})
    metrics.update({
        "dynamic/rounds": len(rollouts), "dynamic/groups": flags.numel(), "dynamic/informative": n_informative,
        "dynamic/kept": min(n_informative, want), "dynamic/shortfall": want - min(n_informative, want),
    })
    return kept, scored, all_scores, metrics
