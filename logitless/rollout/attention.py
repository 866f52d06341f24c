"""Decode attention for grouped-query models without expanding the KV cache.

transformers' "sdpa" attention repeats K and V to all query heads whenever a mask is given (left padding
always gives one), so every decode step writes and reads num_heads/num_kv_heads copies of the whole cache.
For a one-token query the query heads of a KV group can instead be laid out as query rows of that group:
equivalent to
    sdpa(q [B, H, 1, d], repeat_kv(k), repeat_kv(v), mask [B, 1, 1, L])
    == sdpa(q.view(B, kv, H/kv, d), k [B, kv, L, d], v, mask).view(B, H, 1, d)
since transformers' repeat_kv maps query head h to KV head h // (H/kv). Multi-token queries (prefill) use
transformers' sdpa unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "logitless_gqa_decode"
SDPA_LIKE = ("sdpa", "logitless_varlen")  # attention implementations whose padded-batch path is transformers' sdpa


def gqa_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, kv, L, d]
    value: torch.Tensor,  # [B, kv, L, d]
    attention_mask: torch.Tensor | None,  # [B, 1, q, L] bool (True = attend) or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    B, H, q, d = query.shape
    kv = key.shape[1]
    plain = q != 1 or H == kv or dropout > 0 or key.shape[-1] != value.shape[-1]
    # a sliding window or attention chunk needs nothing here: the mask carries it (sdpa ignores those kwargs too)
    if plain or kwargs.get("softcap") or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(
        query.reshape(B, kv, H // kv, d), key, value, attn_mask=attention_mask, scale=scaling
    )  # [B, kv, H/kv, d]
    return out.reshape(B, H, 1, d).transpose(1, 2).contiguous(), None  # [B, 1, H, d]


_registered = False


@contextlib.contextmanager
def gqa_decode(model_config: Any) -> Iterator[bool]:
    """Use `gqa_decode_attention` for the block if the model uses "sdpa" or "logitless_varlen" (whose unpacked
    batches are sdpa) (yields whether it does)."""
    global _registered
    impl = getattr(model_config, "_attn_implementation", None)
    if impl not in SDPA_LIKE:
        yield False
        return
    if not _registered:
        AttentionInterface.register(NAME, gqa_decode_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    model_config._attn_implementation = NAME
    try:
        yield True
    finally:
        model_config._attn_implementation = impl
