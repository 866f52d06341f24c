"""`attn_implementation="logitless_varlen"`: packed (padding-free) sequences through torch's own varlen attention.

transformers runs a packed batch (one [1, S] sequence, no attention mask, position_ids restarting at 0 for each
row) as per-row causal attention with flash_attention_2/3 (needs the flash-attn package), flex_attention
(a compiled document mask), or sdpa/eager (a dense block-diagonal [S, S] mask: exact, but its cost grows with
S², not with the rows' own lengths). This attention function gives the varlen cost without extra packages:

- packed or single sequences (batch 1, no mask, no KV cache, no sliding window): the row boundaries come from
  the forward's `cu_seq_lens_q` / `max_length_q` keyword arguments (transformers' names for flash attention;
  `completion_logprobs(packed=True)` passes them, so a compiled layer needs no host sync), else from
  position_ids (a new row wherever the position does not go up by 1, transformers' own rule), and the rows go
  to `torch.nn.attention.varlen.varlen_attn` (flash-attention kernels inside torch, CUDA) as one causal call;
  on CPU each row is one causal `scaled_dot_product_attention` call (same math, for tests), or under
  torch.compile one call with a block-diagonal causal mask (no host values, so no graph break);
- everything else (padded batches, generation with a cache, sliding windows) runs transformers' sdpa path.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "logitless_varlen"


def _sdpa_or_none_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                       mask_function=None, attention_mask: Tensor | None = None, local_size: int | None = None,
                       **kwargs):
    """No mask where the varlen path runs (batch 1, no padding mask, no cache offset, no window); sdpa's otherwise."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if attention_mask is None and batch_size == 1 and q_length == kv_length and not kv_offset and local_size is None:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                     attention_mask, local_size=local_size, **kwargs)


def row_boundaries(position_ids: Tensor) -> tuple[Tensor, int]:  # [S] -> cu_seqlens [R + 1] int32, longest row
    """Cumulative row starts of a packed sequence: a row starts wherever the position does not go up by 1."""
    S = position_ids.shape[0]
    step = torch.diff(position_ids, prepend=position_ids[:1] - 1)  # [S]
    starts = (step != 1).nonzero().view(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_full((1,), S)]).to(torch.int32)  # [R + 1]
    return cu, int((cu[1:] - cu[:-1]).max())


_LAST: list = [None, None]  # (position_ids, its row boundaries): every layer of a forward gets the same tensor


def packed_kwargs(lengths: Tensor) -> dict:  # [R] real tokens per packed row, in order -> forward kwargs
    """The varlen keyword arguments of a packed forward (transformers' flash-attention names), from the rows'
    lengths: one host sync per forward, none inside the layers."""
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)  # [R + 1]
    longest = int(lengths.max()) if lengths.numel() else 0
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def _boundaries_of(position_ids: Tensor) -> tuple[Tensor, int]:
    """`row_boundaries` once per forward (and its recompute) rather than once per layer: one host sync."""
    if _LAST[0] is not position_ids:
        _LAST[:] = [position_ids, row_boundaries(position_ids.reshape(-1))]
    return _LAST[1]


def _varlen_rows(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None) -> Tensor:
    """Causal attention of each row [cu[i], cu[i+1]) of q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq, D]."""
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        if gqa and "enable_gqa" not in inspect.signature(varlen_attn).parameters:  # torch < 2.13: expand K/V heads
            rep = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        extra = {"enable_gqa": True} if gqa else {}
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), **extra)
    if torch.compiler.is_compiling():  # no host values under compile: one call, block-diagonal causal mask
        pos = torch.arange(q.shape[0], device=q.device)
        row = torch.searchsorted(cu, pos.to(cu.dtype), right=True)  # [S] row of each token
        allowed = (row[:, None] == row[None, :]) & (pos[:, None] >= pos[None, :])  # [S, S]
        qs, ks, vs = (t.transpose(0, 1) for t in (q, k, v))  # [H, S, D]
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa).transpose(0, 1)
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1))
    return torch.cat(out, 0)


def varlen_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers attention function: query [B, Hq, S, D], key/value [B, Hkv, S, D] -> ([B, S, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    varlen = (
        attention_mask is None and query.shape[0] == 1 and position_ids is not None
        and query.shape[2] == key.shape[2] and sliding_window is None and kwargs.get("softcap") is None
    )
    if not varlen:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if dropout > 0 and module.training:
        raise ValueError(f"attn_implementation={NAME!r} has no attention dropout; set the model's attention dropout to 0")
    if kwargs.get("cu_seq_lens_q") is not None:
        cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    else:
        cu, longest = _boundaries_of(position_ids)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [S, H, D]
    return _varlen_rows(q, k, v, cu, longest, scaling).unsqueeze(0), None


def register() -> None:
    """Make `attn_implementation="logitless_varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _sdpa_or_none_mask)
