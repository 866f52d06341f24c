"""One-token decode attention for grouped-query models as one Triton kernel (flash-decoding).

    out = decode_attention(q, k, v, mask, scale)
    # q [B, kv, g, d] (the g query heads of each KV head as rows), k/v [B, kv, L, d], mask [B, L] bool or None
    # -> out [B, kv, g, d], in q's dtype

Equivalent to (`decode_attention_reference`):

    s = (q.float() @ k.float().transpose(-1, -2)) * scale        # [B, kv, g, L]
    s = s.masked_fill(~mask[:, None, None, :], -inf)
    out = (softmax(s, -1) @ v.float()).to(q.dtype)

One program reads one (row, KV head)'s cache once for all g query heads of the group, keeping an online softmax
(running max and sum) in fp32 and never writing the [g, L] scores: the three kernels of the matmul path (q k^T,
softmax, p v) become one. With a mask it reads only the visible span of the cache: it first scans the row's mask
(one byte per slot, against 4 * d bytes of keys and values per KV head) for the first and last visible slot, so the
unfilled end of a static cache (and what a sliding window hides) costs nothing, with no recompile as it fills.
The cache length can be split over more programs (`splits`, or MIN_ROWS_PER_SM), each writing its unnormalized
partial output with its max and sum, and a second step combines them (torch ops over [B, kv, splits, g, d], which
inductor fuses inside the compiled decode step); off by default, since a chunk's own running max rounds p otherwise
than the trainer's attention does.

Keys are read in blocks of `block_keys(d)`, the blocks of torch's memory-efficient attention (the trainer's padded
sdpa): the online softmax then rounds p at the same running maxima, and the output equals sdpa's to its last bits.

The scores are accumulated in fp32 from the bf16 inputs (not rounded to bf16 as the matmul path's q k^T is); the
probabilities are rounded to v's dtype for the p v product, as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    Q, K, V, M, O, Mx, Sm,  # inputs; output (or partial output), its running max and sum (split mode)
    stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_mb,
    KV, G, L, D, chunk, scale,
    HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_SCAN: tl.constexpr,
):
    bh = tl.program_id(0)  # b * KV + h
    s = tl.program_id(1)  # which chunk of the cache length
    b = bh // KV
    h = bh % KV
    og = tl.arange(0, BLOCK_G)
    od = tl.arange(0, BLOCK_D)
    gd = (og[:, None] < G) & (od[None, :] < D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + og[:, None] * stride_qg + od[None, :], mask=gd, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = s * chunk
    end = tl.minimum(start + chunk, L)
    k_row = K + b * stride_kb + h * stride_kh
    v_row = V + b * stride_vb + h * stride_vh
    if HAS_MASK:  # the visible span [lo, hi) of this chunk: slots outside it are never read (unfilled, windowed out)
        lo = end
        hi = start
        for c0 in range(start, end, BLOCK_SCAN):
            oc = c0 + tl.arange(0, BLOCK_SCAN)
            seen = tl.load(M + b * stride_mb + oc, mask=oc < end, other=0) != 0
            lo = tl.minimum(lo, tl.min(tl.where(seen, oc, end)))
            hi = tl.maximum(hi, tl.max(tl.where(seen, oc + 1, start)))
        lo = start + (lo - start) // BLOCK_L * BLOCK_L  # whole blocks from the chunk's start
    else:
        lo = start
        hi = end
    for l0 in range(lo, hi, BLOCK_L):
        ol = l0 + tl.arange(0, BLOCK_L)
        valid = ol < hi
        if HAS_MASK:
            valid = valid & (tl.load(M + b * stride_mb + ol, mask=ol < hi, other=0) != 0)
        ld = (ol[:, None] < hi) & (od[None, :] < D)
        k = tl.load(k_row + ol[:, None] * stride_kl + od[None, :], mask=ld, other=0.0)  # [BLOCK_L, BLOCK_D]
        # [BLOCK_G, BLOCK_L] fp32; under torch.compile a scale not exact in fp32 arrives as fp64, hence the cast
        scores = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep everything at 0
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_row + ol[:, None] * stride_vl + od[None, :], mask=ld, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLIT:  # partial results [B * KV, splits, G, D] and [B * KV, splits, G], combined by the caller
        base = (bh * tl.num_programs(1) + s) * G
        tl.store(O + (base + og[:, None]) * D + od[None, :], acc, mask=gd)
        tl.store(Mx + base + og, m_i, mask=og < G)
        tl.store(Sm + base + og, l_i, mask=og < G)
    else:  # out [B, KV, G, D] contiguous
        out = acc / l_i[:, None]
        tl.store(O + (bh * G + og[:, None]) * D + od[None, :], out.to(O.dtype.element_ty), mask=gd)


# Keys per block: those of torch's memory-efficient attention (64 for head dims up to 64, 128 above), the trainer's
# padded sdpa. The online softmax rounds p to bf16 relative to the running max of the blocks seen so far, so the same
# partition of the keys gives the trainer's roundings: measured on an H200, this kernel's output equals sdpa's to
# 1e-10 (d 64) and 3e-6 (d 128), against 4.8e-4 with 64-key blocks at d 128, about the error of either against fp64
# (bench/LOG.md, "The decode kernel rounds as the trainer does").
def block_keys(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128


NUM_WARPS = 4
# software-pipeline stages: 2 from FEW_STAGES_FROM programs per SM, else Triton's default (3). On an H200 at the
# 1.5B shape, 2 stages made the kernel 1.04x faster at 512 rows (7.8 programs per SM) and 3 stages 1.10x faster at
# 128 rows (1.9 per SM) (bench/tune_decode_attention.py, bench/LOG.md); the threshold lies between the two. Blocks of
# 128 keys always take 2 stages: 29.3 against 36.1 us per layer call at 128 rows (results/tune_decode_attention_h200_
# a9ea2c5.json; 64-key blocks with 3 stages: 27.1), 96.2 against 128.2 at 512 rows (64 keys, 2 stages: 87.0)
FEW_STAGES_FROM = 4
# mask slots read per step of the scan for the visible span: a chunk's whole mask in one load up to this many (the
# scan's steps are dependent loads; one step of 2,048 against three of 512 made the kernel 1.03-1.04x faster)
BLOCK_SCAN = 2048
# programs per SM below which the cache length is split; 0: never. Splitting gives each chunk a running max of its own,
# so p is rounded differently from the trainer's attention (3x hf's sampler-trainer mismatch at 16 rows of a tiny
# model, bench/LOG.md), and at the trainer's 128+ rows there is more than a program per SM anyway
MIN_ROWS_PER_SM = 0
SMS = {"count": 132}  # the GPU's SM count, set eagerly by `set_sm_count` (a compiled graph reads it as a constant)


def set_sm_count(device: torch.device) -> None:
    """Record `device`'s SM count for `num_splits` (call outside torch.compile)."""
    if device.type == "cuda":
        SMS["count"] = torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(programs: int, length: int) -> int:
    """How many chunks of the cache length each (row, KV head) is split into: enough programs to give every SM
    MIN_ROWS_PER_SM, never chunks shorter than BLOCK_L."""
    want = -(-MIN_ROWS_PER_SM * SMS["count"] // programs)
    return max(1, min(want, -(-length // 64)))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     splits: int | None = None, block_l: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, block_scan: int | None = None) -> torch.Tensor:
    """Attention of one query token per row: q [B, kv, g, d], k/v [B, kv, L, d] (any strides, last dim
    contiguous), mask [B, L] (bool or 0/1; None: every slot) -> [B, kv, g, d] in q's dtype. splits: chunks of L
    per (row, KV head) (None: `num_splits`). block_l, num_warps, num_stages, block_scan: the kernel's launch
    configuration (None: `block_keys` of the head dim, NUM_WARPS, the FEW_STAGES_FROM rule, a chunk's mask in one scan step up to
    BLOCK_SCAN; bench/tune_decode_attention.py measures them)."""
    B, KV, G, D = q.shape
    L = k.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention needs the head dimension contiguous in q, k and v")
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    block_l = block_l or block_keys(D)
    splits = splits if splits is not None else num_splits(B * KV, L)
    chunk = -(-L // splits)
    chunk = -(-chunk // block_l) * block_l  # whole blocks per chunk
    splits = -(-L // chunk)
    block_g = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows at least
    block_d = max(16, triton.next_power_of_2(D))
    m = mask if mask is not None else q  # any tensor: not read without HAS_MASK
    args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), m.stride(0) if mask is not None else 0,
            KV, G, L, D, chunk, scale)
    block_scan = block_scan or min(BLOCK_SCAN, max(16, triton.next_power_of_2(chunk)))
    meta = dict(HAS_MASK=mask is not None, SPLIT=splits > 1, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_L=block_l,
                BLOCK_SCAN=block_scan, num_warps=num_warps or NUM_WARPS)
    if num_stages is None and (block_l >= 128 or B * KV * splits >= FEW_STAGES_FROM * SMS["count"]):
        num_stages = 2
    if num_stages is not None:
        meta["num_stages"] = num_stages
    if splits == 1:
        out = torch.empty((B, KV, G, D), dtype=q.dtype, device=q.device)
        unused = torch.empty(0, dtype=torch.float32, device=q.device)  # no max / sum without splits
        _decode_kernel[(B * KV, 1)](q, k, v, m, out, unused, unused, *args, **meta)
        return out
    part = torch.empty((B, KV, splits, G, D), dtype=torch.float32, device=q.device)
    mx = torch.empty((B, KV, splits, G), dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    _decode_kernel[(B * KV, splits)](q, k, v, m, part, mx, sm, *args, **meta)
    top = mx.amax(2, keepdim=True)  # [B, KV, 1, G]: finite (each row sees its own token)
    w = torch.exp(mx - top)  # an all-masked chunk: exp(-inf) = 0
    out = (part * w[..., None]).sum(2) / (sm * w).sum(2)[..., None]
    return out.to(q.dtype)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                               scale: float) -> torch.Tensor:
    """The naive computation `decode_attention` is equivalent to (fp32 scores, or the inputs' wider dtype)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale  # [B, kv, g, L]
    if mask is not None:
        s = s.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v.to(wide)).to(q.dtype)
