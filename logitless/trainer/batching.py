"""Micro-batches of a rollout for the training passes: rows sorted by length, padding columns trimmed, split by
row count or by a token budget; the padding passes of a rank with fewer micro-batches than another."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from logitless.models.vision import ImageInputs
from logitless.rollout import RolloutBatch
from logitless.trainer.distributed.collectives import is_distributed
from logitless.trainer.distributed.parallel import model_logprobs


@dataclass
class MicroBatch:
    rows: torch.Tensor  # [b] long, indices into the rollout's B rows
    prompt_ids: torch.Tensor  # [b, p] left-padded (p <= P: all-padding columns trimmed)
    prompt_mask: torch.Tensor  # [b, p]
    completion_ids: torch.Tensor  # [b, t] right-padded (t <= T)
    completion_mask: torch.Tensor  # [b, t] every completion token (attended to)
    sampler_logp: torch.Tensor  # [b, t] fp32
    truncated: torch.Tensor  # [b] bool
    advantages: torch.Tensor  # [b] fp32, or [b, t] per token (advantage.credit=turn: each model turn its own)
    # [b, t] the completion tokens that are trained: the model's (completion_mask less the observation tokens of
    # multi-turn episodes, RolloutBatch.env_mask); the same tensor as completion_mask without episodes
    loss_mask: torch.Tensor | None = None
    # [b, p, layers, k] / [b, t, layers, k] the rollout's mixture-of-experts routes of prompt_ids / completion_ids
    # (RolloutBatch.prompt_routes / completion_routes, trimmed alike), replayed by the trainer's forwards; None: none
    prompt_routes: torch.Tensor | None = None
    completion_routes: torch.Tensor | None = None
    # a vision-language model's image tensors of the b rows (RolloutBatch.images): passed to every forward of them
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    @property
    def routes(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of `completion_logprobs` that replay the routes (empty without routes)."""
        if self.prompt_routes is None:
            return {}
        return {"prompt_routes": self.prompt_routes, "completion_routes": self.completion_routes}

    @property
    def inputs(self) -> dict[str, object]:
        """The keyword arguments of `completion_logprobs` beyond ids and masks: the routes, the rows' images."""
        return {**self.routes, **({"images": self.images} if self.images is not None else {})}

    @property
    def num_tokens(self) -> int:
        """Trained (model) tokens."""
        return int(self.loss_mask.sum())


def make_micro_batches(
    prompt_ids: torch.Tensor,  # [B, P]
    prompt_mask: torch.Tensor,  # [B, P]
    completion_ids: torch.Tensor,  # [B, T]
    completion_mask: torch.Tensor,  # [B, T]
    sampler_logp: torch.Tensor,  # [B, T]
    truncated: torch.Tensor,  # [B]
    advantages: torch.Tensor,  # [B], or [B, T] per token
    size: int,
    rows: torch.Tensor | None = None,  # [n] long, only these rows (default: all B)
    *,
    max_tokens: int | None = None,
    packed: bool = False,
    loss_mask: torch.Tensor | None = None,  # [B, T] the trained tokens (default: completion_mask)
    routes: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B, P, layers, k], [B, T, layers, k]) MoE routes
    images: ImageInputs | None = None,  # the B rows' image tensors (a vision-language model)
) -> list[MicroBatch]:
    """Split the B rows (or the given `rows`) into micro-batches, longest sequences first.

    Without `max_tokens` a micro-batch holds at most `size` rows. With it, rows are added while the tokens the
    micro-batch computes stay within `max_tokens`: rows x (longest prompt + longest completion) when padded,
    the sum of the rows' prompt + completion tokens when `packed`. Sorting by total length (prompt +
    completion) groups similar lengths so little padding is computed; each micro-batch keeps only the columns
    some of its rows use. Row order and split do not change any result: the objective's normalizer is global
    and its per-row terms are independent. Lengths and budgets count every completion token (observations of
    multi-turn episodes are computed as context); `loss_mask` only says which of them are trained.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if rows is None:
        rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    if rows.numel() == 0:
        return []
    p_len, c_len = prompt_mask.sum(1).clamp(min=1), completion_mask.sum(1)  # [B]
    order = rows[torch.sort((p_len + c_len)[rows], descending=True, stable=True).indices]  # [n]
    if max_tokens is None:
        chunks = list(order.split(size))
    else:
        chunks = token_budget_chunks(order, p_len, c_len, max_tokens, packed=packed)
    out = []
    for chunk in chunks:
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
                advantages=advantages[chunk] if advantages.dim() == 1 else advantages[chunk][:, :t],
                loss_mask=None if loss_mask is None else loss_mask[chunk][:, :t],
                prompt_routes=None if routes is None else routes[0][chunk][:, -p:],
                completion_routes=None if routes is None else routes[1][chunk][:, :t],
                images=None if images is None else images.select(chunk),
            )
        )
    return out


def token_budget_chunks(
    order: torch.Tensor,  # [n] long, rows longest first
    p_len: torch.Tensor,  # [B] prompt tokens of each row (>= 1)
    c_len: torch.Tensor,  # [B] completion tokens of each row
    max_tokens: int,
    *,
    packed: bool,
) -> list[torch.Tensor]:
    """Consecutive groups of `order` whose computed tokens stay within `max_tokens` (greedy, in order).

    A group's tokens are len x (max prompt + max completion) when padded, sum(prompt + completion) when packed.
    """
    ps, cs = p_len[order].tolist(), c_len[order].tolist()
    longest = max(p + c for p, c in zip(ps, cs))
    if longest > max_tokens:
        raise ValueError(
            f"train.micro_batch_tokens={max_tokens} is smaller than the longest row of this step ({longest} "
            f"prompt + completion tokens); set train.micro_batch_tokens >= {longest} (at most "
            "rollout.max_prompt_length + rollout.max_completion_length is always enough)"
        )
    bounds, start, p_max, c_max, total = [], 0, 0, 0, 0
    for i, (p, c) in enumerate(zip(ps, cs)):
        np_, nc, nt = max(p_max, p), max(c_max, c), total + p + c
        cost = nt if packed else (i - start + 1) * (np_ + nc)
        if cost > max_tokens:
            bounds.append(i)
            start, np_, nc, nt = i, p, c, p + c
        p_max, c_max, total = np_, nc, nt
    edges = [0, *bounds, len(ps)]
    return [order[a:b] for a, b in zip(edges[:-1], edges[1:])]


def rollout_micro_batches(batch: RolloutBatch, advantages: torch.Tensor, rows: torch.Tensor, size: int,
                          max_tokens: int | None, packed: bool, device: torch.device
                          ) -> tuple[list[MicroBatch], list[MicroBatch]]:
    """The micro-batches of `rows` of a rollout (`make_micro_batches`: the model's tokens as the trained ones in
    multi-turn episodes, the rows' MoE routes and images with them) and the padding ones this rank runs beside them
    under torchrun (`padding_micro_batches`; a rank without a row pads with row 0). `advantages`: [B] or [B, T]."""
    loss = None if batch.env_mask is None else batch.loss_mask()  # observations stay in the sequence as context
    routes = (batch.prompt_routes, batch.completion_routes) if batch.prompt_routes is not None else None
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, batch.sampler_logp,
            batch.truncated, advantages)
    kw = dict(loss_mask=loss, routes=routes, images=batch.images)
    micro = make_micro_batches(*args, size, rows=rows, max_tokens=max_tokens, packed=packed, **kw)
    spare = lambda: make_micro_batches(*args, 1, rows=torch.zeros(1, dtype=torch.long, device=device), **kw)[0]  # noqa: E731
    return micro, padding_micro_batches(micro, spare, device)


def padding_micro_batches(
    micro: list[MicroBatch], spare: Callable[[], MicroBatch], device: torch.device
) -> list[MicroBatch]:
    """Copies of a micro-batch (the last, or `spare()` for a rank with none) for a rank with fewer micro-batches
    than the most any rank has.

    Every forward and backward of a sharded model is a collective, so all ranks must run as many; the padding
    passes add exactly zero to the gradient (`padding_backward`) and nothing to the metrics.
    """
    if not is_distributed():
        return []
    count = torch.tensor([len(micro)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    missing = int(count.item()) - len(micro)
    return [micro[-1] if micro else spare()] * missing


def padding_backward(model: nn.Module, m: MicroBatch, temperature: float,
                     forward: Callable[[], AbstractContextManager] = nullcontext) -> torch.Tensor:
    """A forward (under `forward()`, as the real micro-batches run) and backward of micro-batch `m` whose gradient
    is exactly zero; returns the zero loss."""
    ids = (m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask)
    with forward():
        logp, _ = model_logprobs(model, *ids, temperature=temperature, logp_mask=m.loss_mask, **m.inputs)
    loss = logp.sum() * 0.0
    loss.backward()
    return loss.detach()
