"""Micro-batches of a rollout for the training passes: rows sorted by length, padding columns trimmed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    rows: torch.Tensor  # [b] long, indices into the rollout's B rows
    prompt_ids: torch.Tensor  # [b, p] left-padded (p <= P: all-padding columns trimmed)
    prompt_mask: torch.Tensor  # [b, p]
    completion_ids: torch.Tensor  # [b, t] right-padded (t <= T)
    completion_mask: torch.Tensor  # [b, t]
    sampler_logp: torch.Tensor  # [b, t] fp32
    truncated: torch.Tensor  # [b] bool
    advantages: torch.Tensor  # [b] fp32

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def make_micro_batches(
    prompt_ids: torch.Tensor,  # [B, P]
    prompt_mask: torch.Tensor,  # [B, P]
    completion_ids: torch.Tensor,  # [B, T]
    completion_mask: torch.Tensor,  # [B, T]
    sampler_logp: torch.Tensor,  # [B, T]
    truncated: torch.Tensor,  # [B]
    advantages: torch.Tensor,  # [B]
    size: int,
    rows: torch.Tensor | None = None,  # [n] long, only these rows (default: all B)
) -> list[MicroBatch]:
    """Split the B rows (or the given `rows`) into micro-batches of at most `size` rows, longest sequences first.

    Sorting by total length (prompt + completion) groups similar lengths so little padding is computed; each
    micro-batch keeps only the columns some of its rows use. Row order inside the step does not change any
    result: the objective's normalizer is global and its per-row terms are independent.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if rows is None:
        rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    if rows.numel() == 0:
        return []
    lengths = prompt_mask[rows].sum(1) + completion_mask[rows].sum(1)  # [n]
    order = rows[torch.sort(lengths, descending=True, stable=True).indices]  # [n]
    out = []
    for chunk in order.split(size):
        pm, cm = prompt_mask[chunk], completion_mask[chunk]
        p = max(int(pm.sum(1).max()), 1)  # left-padded: keep the last p columns
        t = int(cm.sum(1).max())  # right-padded: keep the first t columns
        out.append(
            MicroBatch(
                rows=chunk,
                prompt_ids=prompt_ids[chunk][:, -p:],
                prompt_mask=pm[:, -p:],
                completion_ids=completion_ids[chunk][:, :t],
                completion_mask=cm[:, :t],
                sampler_logp=sampler_logp[chunk][:, :t],
                truncated=truncated[chunk],
                advantages=advantages[chunk],
            )
        )
    return out
