"""Triton passes over a bf16/fp16/fp32 logits tile that a cuBLAS GEMM has just written.

All softmax math is fp32; a tile element is z = logit * inv_t, where the GEMM that wrote the tile already added
the bias (one rounding, exactly like `F.linear`). Every pass is a 2-D grid (row, block of BLOCK_V columns), so
that a pass streams the tile at close to memory bandwidth whatever the tile's shape. Three kernels:

* `block_stats_kernel`: per (row, column block), the block's max m, Σ e^(z-m) and Σ e^(z-m)·z, written to
  column `col0 + block` of the partials [3, N, P]; the block that holds the row's target also records its z.
* `combine_kernel`: per row, folds the row's P partials into lse, logp = z_target - lse and entropy.
* `grad_tile_kernel`: overwrites a tile in place with the upstream-weighted gradient
  d = inv_t * (g_lp * (onehot - p) - g_ent * p * (z - lse + H)), using lse and H.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_z(row_ptr, cols, mask, inv_t, other):
    return tl.load(row_ptr + cols, mask=mask, other=other).to(tl.float32) * inv_t


@triton.jit
def block_stats_kernel(
    z_ptr, ld, vb, inv_t, tgt_ptr, v0, part_ptr, n_rows, n_parts, col0, zt_ptr,
    WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    start = blk * BLOCK_V
    cols = start + tl.arange(0, BLOCK_V)
    mask = cols < vb
    row_ptr = z_ptr + row * ld
    z = _load_z(row_ptr, cols, mask, inv_t, float("-inf"))
    m = tl.max(z, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a block of masked vocabulary (-inf) stays neutral
    e = tl.exp(z - m_safe)
    out = part_ptr + row * n_parts + col0 + blk
    plane = n_rows * n_parts
    tl.store(out, m)
    tl.store(out + plane, tl.sum(e, 0))
    if WITH_ENT:
        tl.store(out + 2 * plane, tl.sum(tl.where(e > 0, e * z, 0.0), 0))
    tv = tl.load(tgt_ptr + row).to(tl.int64) - v0
    hit = (tv >= start) & (tv < start + BLOCK_V) & (tv < vb)
    zt = tl.load(row_ptr + tl.where(hit, tv, 0)).to(tl.float32)
    tl.store(zt_ptr + row, zt * inv_t, mask=hit)


@triton.jit
def combine_kernel(
    part_ptr, n_rows, n_parts, zt_ptr, lse_ptr, logp_ptr, ent_ptr,
    WITH_ENT: tl.constexpr, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < n_parts
    base = part_ptr + row * n_parts + offs
    plane = n_rows * n_parts
    m = tl.load(base, mask=mask, other=float("-inf"))
    m_row = tl.max(m, 0)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    scale = tl.exp(m - m_safe)  # 0 for masked / all -inf blocks
    s = tl.sum(tl.load(base + plane, mask=mask, other=0.0) * scale, 0)
    lse = m_safe + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.load(zt_ptr + row) - lse)
    if WITH_ENT:
        t = tl.sum(tl.load(base + 2 * plane, mask=mask, other=0.0) * scale, 0)
        tl.store(ent_ptr + row, lse - t / s)


@triton.jit
def grad_tile_kernel(
    z_ptr, ld, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, v0, vb, inv_t,
    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, UNIT_GLP: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vb
    row_ptr = z_ptr + row * ld
    z = _load_z(row_ptr, cols, mask, inv_t, 0.0)
    lse = tl.load(lse_ptr + row)
    p = tl.exp(z - lse)
    d = tl.zeros((BLOCK_V,), tl.float32)
    if HAS_GLP:
        tv = tl.load(tgt_ptr + row).to(tl.int64) - v0
        d = tl.where(cols == tv, 1.0, 0.0) - p
        if not UNIT_GLP:
            d = d * tl.load(glp_ptr + row)
    if HAS_GENT:
        ge = tl.load(gent_ptr + row)
        ent = tl.load(ent_ptr + row)
        d -= ge * tl.where(p > 0, p * (z - lse + ent), 0.0)  # p = 0 where z = -inf (masked vocab)
    tl.store(row_ptr + cols, (d * inv_t).to(z_ptr.dtype.element_ty), mask=mask)
