"""The token draw over a vocabulary split across a group of processes (the tensor-parallel rollout's lm_head split
by vocabulary rows, `trainer/placement/tensor_parallel.py`): each process holds the logits of its own token ids only, and no
[B, V] tensor is gathered.

The static engine's unfiltered draw (`sampling.py`) is a Gumbel-max race, argmax over v of z[v] + g(key, v) with
z = logits / T and the noise g hashed from (the row's step key, the token id v), and the recorded logprob is
z[token] - logsumexp(z). Both reduce over the vocabulary with associative operations, so each process reduces its
own columns to one partial per row (or per block of columns):

    m = max z,  s = sum exp(z - m),  best = max (z + g),  z_best = z at that column,  id = its global token id

and the partials of every process (`VocabShard.gather`: a collective over the group, [B, K, 5] per process, a few
numbers per row instead of the [B, V / N] logits) combine, on every process alike, into

    token = id of the first partial holding the largest best (partials in token-id order: the lowest id among
            equal scores, as argmax over the whole row takes it)
    logp  = z_best of that partial - (M + log sum_k s_k exp(m_k - M)),  M = max_k m_k

The noise of each column is its global token id's (`shard_codes`), so the tokens are those of the draw over the
gathered row, bit for bit, and the logprobs equal its to fp32 rounding (the log-sum-exp is summed in another
order). The partials come from torch ("torch": one partial per row, compiled on CUDA) or from the Triton draw's
first kernel ("triton": one per 4,096-column block, `ops.triton_sampling.block_partials`); they travel and
combine in fp64 (the token ids exactly).

Top-k, top-p, min-p and the repetition penalty need the whole distribution: with them the engine gathers the
logits (`whole_logits`) and draws as one process does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from logitless.models.compiled import EAGER_NUMERICS
from logitless.ops.hash32 import mix32

from .sampling import StepSampler, gumbel, step_keys, step_salt

PARTIAL = 5  # numbers per partial: m, s, best, z_best, id


@dataclass(frozen=True)
class VocabShard:
    """This process's logits are the columns [start, start + size) of a vocabulary of `vocab` token ids split in
    `ranks` chunks of `chunk` = ceil(vocab / ranks) columns, one per process of its group in rank order (the last
    one may be shorter; every chunk holds a column: `shard_of` checks it)."""

    start: int  # the token id of this process's first column
    size: int  # this process's columns
    vocab: int  # V, the whole vocabulary
    ranks: int  # N, the processes of the group
    # t [...] -> [N, ...]: every process's t, in rank order (a collective over the group: every process calls it
    # with a tensor of the same shape and dtype, at the same point of its decode)
    gather: Callable[[torch.Tensor], torch.Tensor]

    @property
    def chunk(self) -> int:
        return -(-self.vocab // self.ranks)


def shard_of(vocab: int, ranks: int, rank: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> VocabShard:
    """The shard `rank` holds of a vocabulary split as torch.chunk splits it (DTensor's Shard(0) of the lm_head's
    weight). Raises where a process would hold no column (where ranks - 1 chunks already cover the vocabulary)."""
    chunk = -(-vocab // ranks)
    if (ranks - 1) * chunk >= vocab:
        raise ValueError(f"a vocabulary of {vocab} tokens in chunks of {chunk} leaves a process of {ranks} without a "
                         "column")
    start = rank * chunk
    return VocabShard(start, min(chunk, vocab - start), vocab, ranks, gather)


def shard_codes(start: int, size: int, device: torch.device | str) -> torch.Tensor:
    """[size] int64 hashed token ids start .. start + size - 1: `sampling.vocab_codes(V)[start : start + size]`."""
    return mix32(torch.arange(start, start + size, dtype=torch.long, device=device) * 2 + 1)


def shard_partials(
    logits: torch.Tensor,  # [B, n] this process's columns (any float dtype; computed in fp32)
    keys: torch.Tensor,  # [B] int64 step keys (`sampling.step_keys`)
    codes: torch.Tensor,  # [n] int64 (`shard_codes`)
    start: int,  # the token id of column 0
    temperature: float,
    greedy: bool,
) -> torch.Tensor:  # [B, 1, PARTIAL] fp64
    """One partial per row over this process's columns (see the module docstring)."""
    z = logits.float()
    z = z / temperature if temperature != 1.0 else z
    m = z.amax(-1)
    s = torch.exp(z - m.masked_fill(m == float("-inf"), 0.0)[:, None]).sum(-1)  # (columns all -inf: 0)
    score = z if greedy else z + gumbel(keys, codes)
    i = score.argmax(-1, keepdim=True)  # the first column of the maximum
    best, z_best = score.gather(1, i)[:, 0], z.gather(1, i)[:, 0]
    stats = torch.stack([m, s, best, z_best], -1).double()  # (fp32 values, exact in fp64)
    return torch.cat([stats, (i + start).double()], -1)[:, None]


def combine_partials(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, logp [B] fp32) from every partial of the rows, parts [B, K, PARTIAL] fp64 in token-id
    order (see the module docstring)."""
    m, s, best, z_best, ids = parts.unbind(-1)
    top = m.amax(1, keepdim=True)
    lse = top[:, 0] + torch.log((s * torch.exp(m - top)).sum(1))
    k = best.argmax(1, keepdim=True)  # the first partial of the maximum
    token = ids.gather(1, k)[:, 0].long()
    return token, (z_best.gather(1, k)[:, 0] - lse).float()


def gathered_partials(shard: VocabShard, parts: torch.Tensor) -> torch.Tensor:
    """[B, N * K, PARTIAL] every process's partials [B, K, PARTIAL] of the rows, in token-id order."""
    every = shard.gather(parts)  # [N, B, K, PARTIAL]
    return every.transpose(0, 1).reshape(parts.shape[0], -1, PARTIAL)


def whole_logits(shard: VocabShard, logits: torch.Tensor) -> torch.Tensor:
    """[B, V] the whole rows of the group's logits [B, size] (a collective; for the filters that need them)."""
    pad = shard.chunk - logits.shape[-1]
    every = shard.gather(torch.nn.functional.pad(logits, (0, pad)) if pad else logits)  # [N, B, chunk]
    return every.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, : shard.vocab]


_compiled: dict[bool, Callable] = {}


def split_sampler(shard: VocabShard, device: torch.device, kernel: str, compile: bool) -> StepSampler:
    """`sampling.step_sampler` over this process's columns of the vocabulary: draw(logits [B, size], keys [B] row
    keys, step, codes [size] (`shard_codes`), T, greedy) -> (token [B] global id, logp [B]), the same as the draw
    over the whole rows (a collective over the group). kernel "torch": `shard_partials` (compiled on CUDA when
    `compile`); "triton": the Triton draw's block partials."""
    if kernel == "triton":
        from logitless.ops.triton_sampling import block_partials

        def triton_draw(logits, keys, step, codes, temperature, greedy):
            salt = step if torch.is_tensor(step) else step_salt(step)
            part, idx = block_partials(logits, keys, salt, temperature, greedy, offset=shard.start,
                                       width=shard.chunk)
            parts = torch.cat([part.permute(1, 2, 0).double(), idx[..., None].double()], -1)  # [B, nb, 5]
            return combine_partials(gathered_partials(shard, parts))

        return triton_draw
    fn = shard_partials
    if compile and device.type == "cuda":
        if True not in _compiled:  # one compiled function per process, as `sampling.fused_sampler`
            _compiled[True] = torch.compile(shard_partials, options=EAGER_NUMERICS)
        fn = _compiled[True]

    def torch_draw(logits, keys, step, codes, temperature, greedy):
        parts = fn(logits, step_keys(keys, step), codes, shard.start, temperature, greedy)
        return combine_partials(gathered_partials(shard, parts))

    return torch_draw
