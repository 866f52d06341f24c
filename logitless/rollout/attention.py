"""Decode attention for grouped-query models without expanding the KV cache.

transformers' "sdpa" attention repeats K and V to all query heads whenever a mask is given (left padding
always gives one), so every decode step writes and reads num_heads/num_kv_heads copies of the whole cache.
For a one-token query the query heads of a KV group can instead be laid out as query rows of that group:
equivalent to
    sdpa(q [B, H, 1, d], repeat_kv(k), repeat_kv(v), mask [B, 1, 1, L])
    == sdpa(q.view(B, kv, H/kv, d), k [B, kv, L, d], v, mask).view(B, H, 1, d)
since transformers' repeat_kv maps query head h to KV head h // (H/kv). A masked multi-token query (a prompt's or
an observation's prefill) is laid out the same way, its q tokens times H/kv heads as query rows of the group and
the mask repeated over them, where that mask is smaller than the repeated K and V (`_fold_query`: under 2·H·d·2 /
(H/kv) tokens in bf16, 1,023 at the 1.5B shape); longer queries, and unmasked ones (sdpa's causal kernels), use
transformers' sdpa unchanged. Traced by torch.compile (the static engine's decode graph), the grouped one-token
query runs as two matmuls around a masked fp32 softmax, which inductor fuses: on an H200 that reads the cache
faster than sdpa's kernels for these shapes (q of H/kv rows: 67 vs 94 us at 512 rows x 384 slots, 208 vs 241 us at
1,280; bench/results/attn_decode_h200.json). `rollout.decode_attention=triton` runs one flash-decoding kernel
instead (`ops/triton_decode.py`: scores, online softmax and p v in one pass over the cache).
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
    plain = H == kv or dropout > 0 or key.shape[-1] != value.shape[-1]
    # a sliding window or attention chunk needs nothing here: the mask carries it (sdpa ignores those kwargs too)
    if plain or kwargs.get("softcap") or kwargs.get("position_bias") is not None or (
            q != 1 and not _fold_query(query, key, attention_mask)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if q != 1:  # the g = H/kv heads of each KV head as g·q query rows of it, the mask repeated over the g heads
        g, L = H // kv, key.shape[2]
        rows = query.reshape(B, kv, g * q, d)  # [B, kv, g·q, d]: row j·q + t is head kv_i·g + j at token t
        mask = attention_mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(attention_mask.shape[0], 1, g * q, L)
        out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)  # [B, kv, g·q, d]
        return out.reshape(B, H, q, d).transpose(1, 2).contiguous(), None  # [B, q, H, d]
    grouped = query.reshape(B, kv, H // kv, d)
    scale = d**-0.5 if scaling is None else scaling
    if _KERNEL["name"] == "triton" and query.is_cuda and (attention_mask is None or attention_mask.dtype == torch.bool):
        from logitless.ops.triton_decode import decode_attention  # one kernel: scores, online softmax, p v

        mask = None if attention_mask is None else attention_mask[:, 0, 0, :]  # [B, L]
        out = decode_attention(grouped, key, value, mask, scale)
    elif _KERNEL["name"] == "sdpa" or not torch.compiler.is_compiling():
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    else:
        out = _matmul_attention(grouped, key, value, attention_mask, scale)
    # out: [B, kv, H/kv, d]
    return out.reshape(B, H, 1, d).transpose(1, 2).contiguous(), None  # [B, 1, H, d]


def _fold_query(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a multi-token query [B, H, q, d] attends as grouped query rows (see the module doc): eagerly, with a
    [B or 1, 1, q, L] mask (without one, sdpa runs its causal kernels with grouped heads already), and only where
    the mask repeated over the H/kv heads of a group (one byte a slot) is smaller than K and V repeated to the H
    heads (2·H·d elements a slot)."""
    if mask is None or torch.compiler.is_compiling() or mask.dim() != 4 or mask.shape[1] != 1:
        return False
    H, q, d = query.shape[1:]
    g = H // key.shape[1]
    return mask.shape[2] == q and g * q * mask.element_size() < 2 * H * d * key.element_size()


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with the softmax in fp32 (or the inputs' wider dtype); q [B, kv, g, d],
    k/v [B, kv, L, d], mask [B, 1, 1, L] bool (True = attend) or additive, or None."""
    s = torch.matmul(q, k.transpose(-1, -2))  # [B, kv, g, L]
    s = s.to(torch.promote_types(s.dtype, torch.float32)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(torch.softmax(s, -1).to(v.dtype), v)


_registered = False
KERNELS = ("matmul", "triton", "sdpa")
_KERNEL = {"name": "matmul"}  # read while tracing: a compiled decode step keeps the kernel it was traced with


@contextlib.contextmanager
def gqa_decode(model_config: Any, kernel: str = "matmul", device: torch.device | None = None) -> Iterator[bool]:
    """Use `gqa_decode_attention` for the block if the model uses "sdpa" or "logitless_varlen" (whose unpacked
    batches are sdpa) (yields whether it does). kernel: how a one-token query attends. "matmul": in a compiled
    decode step two matmuls around an fp32 softmax (fused by inductor), eagerly sdpa; "triton" (CUDA, eager or
    compiled): `ops.triton_decode`, one flash-decoding kernel reading each KV head's cache once. device: where the
    model decodes."""
    global _registered
    impl = getattr(model_config, "_attn_implementation", None)
    if impl not in SDPA_LIKE:
        yield False
        return
    if kernel == "triton" and device is not None and device.type == "cuda":
        from logitless.ops.triton_decode import set_sm_count

        set_sm_count(device)
    if not _registered:
        AttentionInterface.register(NAME, gqa_decode_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    model_config._attn_implementation = NAME
    before, _KERNEL["name"] = _KERNEL["name"], kernel
    try:
        yield True
    finally:
        model_config._attn_implementation = impl
        _KERNEL["name"] = before


def resolve_decode_attention(kernel: str, device: torch.device, dtype: torch.dtype, has_triton: bool,
                             capability: tuple[int, int] = (0, 0)) -> str:
    """The decode attention kernel the static engine runs (`attention.gqa_decode`). "auto": "triton" (one
    flash-decoding kernel per layer, `ops/triton_decode.py`) for bf16 weights on a CUDA GPU with bf16 tensor cores
    (compute capability 8.0 or newer: `capability`) and triton installed, where it was measured faster
    (bench/LOG.md), else "matmul". "triton" asked for explicitly is refused off CUDA, without triton, and for fp32
    weights (its tensor-core dots would round the scores to TF32); any other name is refused."""
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"rollout.decode_attention={kernel!r}: use one of {('auto', *KERNELS)}")
    if kernel == "auto":
        fits = device.type == "cuda" and has_triton and dtype == torch.bfloat16 and capability >= (8, 0)
        return "triton" if fits else "matmul"
    if kernel in ("matmul", "sdpa"):
        return kernel
    if device.type != "cuda" or not has_triton:
        raise ValueError(f"rollout.decode_attention=triton runs a Triton kernel on a CUDA GPU, but the rollout "
                         f"decodes on {device}{'' if device.type != 'cuda' else ' without the triton package'}; "
                         "set rollout.decode_attention=matmul (or auto)")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rollout.decode_attention=triton computes scores with bf16/fp16 tensor-core dots, but the "
                         f"rollout decodes in {dtype}; set rollout.decode_attention=matmul (or auto), or load the "
                         "model in bf16 (model.dtype=bfloat16)")
    return kernel
