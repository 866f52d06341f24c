"""Exactly mergeable statistics for objective and advantage metrics.

Each metric is a `Stat`: the sum, count, min and max of a set of values (detached float64 0-dim tensors,
on the device of the inputs, so computing them never synchronizes). Stats of micro-batches and ranks merge
exactly: sums and counts add, mins take the min, maxes the max. The mean of the merged stat is therefore
the mean over the whole optimizer step, whatever the micro-batch split.

Across ranks: `pack_metrics` gives three tensors; all-reduce `sum_count` with SUM, `mins` with MIN and
`maxs` with MAX, then `unpack_metrics`. Every rank must hold the same metric names (policy_loss emits a
name whenever its option or input is enabled, even for an all-masked micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class Stat:
    total: Tensor  # [] float64, sum of the values
    count: Tensor  # [] float64, number of values
    min: Tensor  # [] float64, +inf when count == 0
    max: Tensor  # [] float64, -inf when count == 0

    @staticmethod
    def of(values: Tensor, where: Tensor | None = None) -> Stat:
        """Statistic of `values` at the positions where `where` is true (all positions if None)."""
        with torch.no_grad():
            v = values.detach().to(torch.float64)
            if where is None:
                where = torch.ones_like(v, dtype=torch.bool)
            v, where = torch.broadcast_tensors(v, where.to(torch.bool))
            inf = torch.tensor(float("inf"), dtype=torch.float64, device=v.device)
            return Stat(
                total=torch.where(where, v, 0.0).sum(),
                count=where.sum().to(torch.float64),
                min=torch.where(where, v, inf).amin() if v.numel() else inf.clone(),
                max=torch.where(where, v, -inf).amax() if v.numel() else -inf.clone(),
            )

    def merge(self, other: Stat) -> Stat:
        return Stat(self.total + other.total, self.count + other.count,
                    torch.minimum(self.min, other.min), torch.maximum(self.max, other.max))

    @property
    def mean(self) -> Tensor:
        """total / count; NaN when count == 0."""
        return self.total / self.count


def stats_of(items: dict[str, tuple[Tensor, Tensor | None]]) -> dict[str, Stat]:
    """{name: Stat.of(values, where)} computed with a few batched reductions (one stack per broadcast
    shape) instead of ~8 small kernels per metric, which dominate the objective's GPU time."""
    groups: dict[tuple, list] = {}
    with torch.no_grad():
        for name, (v, w) in items.items():
            v = v.detach()
            w = torch.ones((), dtype=torch.bool, device=v.device) if w is None else w.to(torch.bool)
            v, w = torch.broadcast_tensors(v, w)
            groups.setdefault((tuple(v.shape), v.device), []).append((name, v, w))
        out: dict[str, Stat] = {}
        for (shape, _), group in groups.items():
            if math.prod(shape) == 0:
                out.update({name: Stat.of(v, w) for name, v, w in group})
                continue
            vals = torch.stack([v for _, v, _ in group]).flatten(1)  # [K, n] (promoted dtype)
            where = torch.stack([w for _, _, w in group]).flatten(1)  # [K, n]
            total = torch.where(where, vals, 0).sum(1, dtype=torch.float64)
            count = where.sum(1, dtype=torch.float64)
            mins = torch.where(where, vals, math.inf).amin(1).to(torch.float64)
            maxs = torch.where(where, vals, -math.inf).amax(1).to(torch.float64)
            for i, (name, _, _) in enumerate(group):
                out[name] = Stat(total[i], count[i], mins[i], maxs[i])
    return {name: out[name] for name in items}


def merge_metrics(parts: list[dict[str, Stat]]) -> dict[str, Stat]:
    """Merge metric dicts of micro-batches (or ranks): the union of names, each merged exactly."""
    out: dict[str, Stat] = {}
    for part in parts:
        for name, stat in part.items():
            out[name] = out[name].merge(stat) if name in out else stat
    return out


# Metrics whose min and max are worth logging; the others are fractions (only the mean is meaningful).
RANGE_METRICS = ("ratio", "kl", "entropy", "is/ratio", "is/logp_diff", "completion_length", "reward", "advantage")


def summarize(metrics: dict[str, Stat]) -> dict[str, float]:
    """Plain floats for logging: `name` → mean, plus `name/min` and `name/max` for range metrics.
    Metrics with count == 0 are left out. Synchronizes with the device (call once per step)."""
    out: dict[str, float] = {}
    for name in sorted(metrics):
        s = metrics[name]
        if float(s.count) == 0.0:
            continue
        out[name] = float(s.mean)
        if name in RANGE_METRICS or name.startswith("reward/"):
            out[f"{name}/min"] = float(s.min)
            out[f"{name}/max"] = float(s.max)
    return out


def pack_metrics(metrics: dict[str, Stat]) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """(names, sum_count [K, 2], mins [K], maxs [K]) in sorted name order, for all-reduce SUM / MIN / MAX."""
    names = sorted(metrics)
    if not names:
        z = torch.zeros(0, dtype=torch.float64)
        return names, z.view(0, 2), z, z
    sum_count = torch.stack([torch.stack([metrics[n].total, metrics[n].count]) for n in names])
    mins = torch.stack([metrics[n].min for n in names])
    maxs = torch.stack([metrics[n].max for n in names])
    return names, sum_count, mins, maxs


def unpack_metrics(names: list[str], sum_count: Tensor, mins: Tensor, maxs: Tensor) -> dict[str, Stat]:
    """Inverse of `pack_metrics`."""
    return {n: Stat(sum_count[i, 0], sum_count[i, 1], mins[i], maxs[i]) for i, n in enumerate(names)}
