"""The metrics record of one step (`step_record`): rewards, advantages, objective, lengths, time and memory per
phase, and the step against its physical limit (`efficiency_metrics`), every per-row value over all ranks."""

from __future__ import annotations

import math
from typing import Any

import torch

from logitless.objectives import merge_metrics, summarize
from logitless.objectives.mismatch import ABS as MISMATCH
from logitless.objectives.mismatch import mismatch_summary
from logitless.trainer.context import TrainContext
from logitless.trainer.distributed.collectives import all_reduce_metrics, all_reduce_sum, gather_rows
from logitless.trainer.episodes import episode_metrics
from logitless.trainer.report.accounting import PhaseTimer, decode_ideal_seconds, update_flops
from logitless.trainer.report.metrics import reward_metrics
from logitless.trainer.stages import Rollout, Scored, UpdatePlan, UpdateResult


def efficiency_metrics(ctx: TrainContext, ro: Rollout, plan: UpdatePlan, timer: PhaseTimer) -> dict[str, float]:
    """Rollout share of the HBM-bandwidth ceiling, update MFU and the step against its physical limit
    (trainer/report/accounting.py defines them), over all ranks: the ranks' ideal seconds and FLOPs are summed and
    set against world size × this rank's phase seconds (the phases end in step across ranks). Empty where the
    device's peaks are unknown (CPU), since a ratio to an unknown peak says nothing."""
    if not all(math.isfinite(x) for x in ctx.peaks):
        return {}
    b, dev, world = ro.batch, ctx.device, ctx.world.size
    p_lens, t_lens = b.prompt_mask.sum(1).tolist(), b.completion_mask.sum(1).tolist()
    env = getattr(b, "env_mask", None)  # multi-turn episodes: the model's tokens; all completion tokens otherwise
    m_lens = t_lens if env is None else (b.completion_mask * (1 - env)).sum(1).tolist()
    # the decode ideal counts the model's tokens as decoded, each row's observations as prefilled context
    context = [p + t - m for p, t, m in zip(p_lens, t_lens, m_lens)]
    if ctx.rollout.shared:  # one GPU decoded every rank's rows as one batch
        lens = gather_rows(torch.tensor([context, m_lens], dtype=torch.float64).T, dev).long()
        ideal, gpus = decode_ideal_seconds(ctx.shape, lens[:, 0].tolist(), lens[:, 1].tolist(), ctx.peaks[1]), 1
    else:
        ideal, gpus = all_reduce_sum(decode_ideal_seconds(ctx.shape, context, m_lens, ctx.peaks[1]), dev), world
    trained = plan.trained.tolist()
    flops = update_flops(ctx.shape, [(p_lens[i], t_lens[i]) for i in trained],
                         head_lens=[m_lens[i] for i in trained]) * ctx.cfg.train.num_iterations
    flops = all_reduce_sum(flops, dev)
    train_s = timer.seconds.get("train", math.nan)
    limit = ideal / gpus + flops / world / ctx.peaks[0]  # decode at the HBM bandwidth, the update at peak FLOP/s
    return {
        # the rollout's own seconds: with async_rollout the generate phase is only the wait for it
        "rollout/ceiling_fraction": ideal / gpus / max(b.timing.seconds, 1e-9),
        "step/limit_s": limit,  # the step's physical limit on this GPU (docs/benchmarks.md)
        "step/x_limit": sum(timer.seconds.values()) / max(limit, 1e-9),  # the step's phases over that limit
        "train/mfu": flops / world / max(train_s, 1e-9) / ctx.peaks[0],
        "train/tflops_per_s": flops / max(train_s, 1e-9) / 1e12,  # all ranks together
        "train/tflop": flops / 1e12,  # the step's update FLOPs, all ranks (recompute not counted)
    }


def timer_metrics(ctx: TrainContext, timer: PhaseTimer) -> dict[str, Any]:
    """The step's time and memory per phase; a shared rollout GPU's peak (rank 0) is the replica's, in this process,
    plus the decode process's own."""
    out = timer.metrics()
    if "memory/rollout_device_peak_gb" in out:
        out["memory/rollout_device_peak_gb"] += ctx.rollout.extra_peak_gib()
    return out


def step_record(ctx: TrainContext, ro: Rollout, scored: Scored, plan: UpdatePlan, upd: UpdateResult,
                timer: PhaseTimer) -> dict[str, Any]:
    """The step's metrics: rewards, advantages, objective, lengths, time and memory per phase, efficiency."""
    s, b, dev = scored.scores, ro.batch, ctx.device  # every per-row value gathered over the ranks (rank order)
    lengths = gather_rows(b.loss_mask().sum(1).float(), dev)  # the model's tokens (multi-turn: not observations)
    empty = gather_rows(torch.tensor([float(not c.strip()) for c in b.completions]), dev)
    record: dict[str, Any] = reward_metrics(gather_rows(s.rewards, dev), gather_rows(s.total, dev), s.names, ctx.acc_col)
    record.update({f"reward/{n}/errors": e for n, e in zip(s.names, [int(all_reduce_sum(e, dev)) for e in s.num_errors]) if e})
    record.update({f"reward/{n}/none": c for n, c in zip(s.names, [int(all_reduce_sum(c, dev)) for c in s.num_none]) if c})
    adv = summarize(all_reduce_metrics(scored.adv.metrics, dev))
    record.update({k: v for k, v in adv.items() if k.startswith(("advantage", "zero_var", "unscorable"))})
    merged = merge_metrics(upd.metrics)  # the mismatch Stats come from the first optimizer pass only
    obj = summarize({k: v for k, v in merged.items() if not k.startswith(MISMATCH)})
    record.update({k: v for k, v in obj.items() if not k.startswith("completion_length")})
    record.update(mismatch_summary(merged))  # rollout/mismatch_*: the trained rows' tokens (none: mismatch_rows.py)
    train_s = timer.seconds.get("logprobs", 0.0) + timer.seconds.get("train", 0.0)
    record.update({
        "loss": sum(upd.losses) / len(upd.losses) if upd.losses else math.nan,
        "grad_norm": sum(upd.grad_norms) / len(upd.grad_norms) if upd.grad_norms else math.nan,
        "train/nonfinite_skipped": float(upd.nonfinite),  # optimizer steps skipped (non-finite loss or gradients)
        "learning_rate": ctx.optimizer.param_groups[0]["lr"],
        "entropy_coef": ctx.entropy_coef.effective,
        **episode_metrics(b, dev),  # multi-turn episodes only
        "completion/length_mean": float(lengths.mean()),
        "completion/length_max": float(lengths.max()),
        "completion/truncated": float(gather_rows(b.truncated.float(), dev).mean()),
        "completion/empty": float(empty.mean()),
        "tokens_per_s": all_reduce_sum(b.timing.tokens_per_s, dev),  # the ranks' rows (side by side, or of one
        # shared decode: each rank's tokens over its seconds)
        "train_tokens_per_s": plan.n_tokens * ctx.cfg.train.num_iterations / max(train_s, 1e-9),
        **timer_metrics(ctx, timer),
        **{f"rollout/{part}_s": sec for part, sec in b.timing.parts.items()},  # rollout.profile=true
        **ctx.rollout.metrics(),  # its weight copy and replica
        "memory/parked_gib": ctx.parked.parked_bytes / 2**30 if ctx.cfg.train.offload_during_rollout else 0.0,
        **efficiency_metrics(ctx, ro, plan, timer),
        "skipped": float(plan.n_tokens == 0),
        "trained_rows": all_reduce_sum(len(plan.trained), dev) if plan.n_tokens > 0 else 0.0,
    })
    return record
