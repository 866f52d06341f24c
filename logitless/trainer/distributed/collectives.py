"""The trainer's only collectives: sums/min/max of counts and metrics across ranks (identity on one process).

Under torchrun with FSDP2 every rank runs the same loop on its own prompts; the step normalizer and the
metrics are all-reduced here, so the math modules stay free of collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from logitless.objectives import Stat, pack_metrics, unpack_metrics


def is_distributed() -> bool:
    """Several ranks (a 1-rank group, train.fsdp_offload on one process, needs no collective here)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main_process() -> bool:
    return not is_distributed() or dist.get_rank() == 0


def all_reduce_sum(value: float, device: torch.device) -> float:
    """Σ over ranks of a per-rank count (e.g. this rank's share of the loss normalizer)."""
    if not is_distributed():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def _with_every_rank_names(metrics: dict[str, Stat]) -> dict[str, Stat]:
    """`metrics` plus an empty Stat (count 0) for each name only other ranks have, so that every rank reduces
    the same names (a rank may have none: all its rows skipped)."""
    every: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, sorted(metrics))
    device = next(iter(metrics.values())).total.device if metrics else torch.device("cpu")
    empty = Stat.of(torch.zeros(0, device=device))
    return {**{n: empty for names in every for n in names}, **metrics}


def all_reduce_metrics(metrics: dict[str, Stat], device: torch.device | None = None) -> dict[str, Stat]:
    """Merge every rank's Stats exactly (SUM of sums/counts, MIN of mins, MAX of maxes); `device`: where the
    collective runs (a CUDA device for nccl when the Stats live on the CPU)."""
    if not is_distributed():
        return metrics
    metrics = _with_every_rank_names(metrics)
    names, sum_count, mins, maxs = pack_metrics(metrics)
    if device is not None:
        sum_count, mins, maxs = sum_count.to(device), mins.to(device), maxs.to(device)
    dist.all_reduce(sum_count, op=dist.ReduceOp.SUM)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
    return unpack_metrics(names, sum_count, mins, maxs)


def gather_rows(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The ranks' [n_rank, ...] tensors concatenated in rank order, on x's device: n_rank may differ between ranks
    (uneven prompt shares), the other dimensions may not."""
    if not is_distributed():
        return x
    k = dist.get_world_size()
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(k)]
    dist.all_gather(counts, torch.tensor([x.shape[0]], dtype=torch.long, device=device))
    sizes = [int(c) for c in counts]
    padded = torch.zeros((max(sizes), *x.shape[1:]), dtype=x.dtype, device=device)  # all_gather needs one shape
    padded[: x.shape[0]] = x.to(device)
    parts = [torch.empty_like(padded) for _ in range(k)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(x.device)
