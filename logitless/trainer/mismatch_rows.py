"""The sampler–trainer mismatch of a step on which no row trains.

`rollout/mismatch_*` (objectives/mismatch.py) is measured on the update's first forward over the trained rows, at
no extra cost. With sparse rewards (agents, hard tasks) most steps have equal rewards in every group: every
advantage is 0, `train.skip_zero_advantage` runs no row, and the mismatch would go unmeasured exactly on those
steps. There `untrained_mismatch` measures it on a sample instead: one no-grad forward over up to
`train.mismatch_sample_rows` rows of the step, spread evenly over its rows (the same positions every step), with
the policy the rollout sampled from (before the step's optimizer step, which moves the weights even with zero
gradients: weight decay, Adam's moments).
"""

from __future__ import annotations

import torch

from logitless.objectives import Stat, merge_metrics
from logitless.objectives.mismatch import sampler_mismatch
from logitless.rollout import RolloutBatch
from logitless.trainer.batching import rollout_micro_batches
from logitless.trainer.context import TrainContext
from logitless.trainer.distributed.collectives import all_reduce_metrics, all_reduce_sum
from logitless.trainer.distributed.parallel import model_logprobs
from logitless.trainer.report.traces import traced_rows


def rank_sample(num_rows: int, n: int, rank: int, world: int) -> list[int]:
    """This rank's rows of the sample: its share of `n` rows over `world` ranks (n // world, one more on the first
    n % world ranks), spread evenly over its `num_rows` rows."""
    share = n // world + (rank < n % world)
    return traced_rows(num_rows, share)


@torch.no_grad()
def untrained_mismatch(ctx: TrainContext, batch: RolloutBatch, trained: int, temperature: float) -> dict[str, Stat]:
    """The mismatch Stats (rollout/mismatch, rollout/mismatch_kl) over the model's tokens of a sample of the step's
    rows, merged over the ranks, when no row of the step trains on any rank (`trained`: this rank's trained rows);
    {} when some row trains (the update measures it) or train.mismatch_sample_rows is 0.

    `batch`: the step's RolloutBatch on the training device; `temperature`: of the sampler's logprobs. The forward
    is split into micro-batches as the update's are (train.micro_batch_size / micro_batch_tokens, packed or padded),
    and under torchrun every rank runs as many (padding ones count nothing)."""
    cfg, dev = ctx.cfg, ctx.device
    n = cfg.train.mismatch_sample_rows
    if n == 0 or all_reduce_sum(trained, dev) > 0:
        return {}
    rows = torch.tensor(rank_sample(batch.completion_mask.shape[0], n, ctx.world.rank, ctx.world.size),
                        dtype=torch.long, device=dev)
    micro, padding = rollout_micro_batches(batch, torch.zeros(batch.completion_mask.shape[0], device=dev), rows,
                                           cfg.train.micro_batch_size, cfg.train.micro_batch_tokens,
                                           cfg.train.packed, dev)
    parts = []
    with ctx.lora_compute.stage():  # the policy's logprobs as the update computes them
        for i, m in enumerate(micro + padding):  # (padding: none on one process)
            with ctx.lora_compute.forward():
                logp, _ = model_logprobs(ctx.model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                         temperature=temperature, packed=cfg.train.packed, logp_mask=m.loss_mask,
                                         **m.inputs)
            if i < len(micro):
                parts.append(sampler_mismatch(logp, m.sampler_logp, m.loss_mask))
    return all_reduce_metrics(merge_metrics(parts), dev)
