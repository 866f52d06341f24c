"""Triton row passes over a bf16/fp16/fp32 logits tile that a cuBLAS GEMM has just written.

All softmax math is fp32; a tile element is z = logit * inv_t, where the GEMM that wrote the tile already added
the bias (one rounding, exactly like `F.linear`). Three kernels:

* `tile_stats_kernel`: one program per row of a column tile [N, vb] (columns v0..v0+vb of the vocabulary);
  folds the tile (per-lane online softmax, one reduction at the end) into a running log-sum-exp state per row
  (m = max, s = Σ e^(z-m), t = Σ e^(z-m)·z) and records the target's z when the target falls in the tile.
* `rows_kernel`: one program per full row [V] (frozen-head forward); computes lse, logp, entropy and, with
  WRITE_GRAD, overwrites the row in place with d logp / d logit = (onehot - p) * inv_t.
* `grad_tile_kernel`: 2-D grid over a column tile; overwrites it in place with the upstream-weighted
  gradient d = inv_t * (g_lp * (onehot - p) - g_ent * p * (z - lse + H)), using lse and H saved by forward.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lane_update(m, s, t, z, WITH_ENT: tl.constexpr):
    """Fold a block z (masked entries = -inf) into per-lane running (max, Σ e^(z-max), Σ e^(z-max)·z).

    Elementwise per lane (no cross-warp reduction inside the loop); `_lane_finish` reduces once at the end.
    """
    m_new = tl.maximum(m, z)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only -inf (masked vocab) stay neutral
    alpha = tl.exp(m - m_safe)
    e = tl.exp(z - m_safe)
    s = s * alpha + e
    if WITH_ENT:
        t = t * alpha + tl.where(e > 0, e * z, 0.0)
    return m_new, s, t


@triton.jit
def _lane_finish(m, s, t, WITH_ENT: tl.constexpr):
    """Reduce per-lane (max, sum-exp, sum-exp·z) to one row's scalars."""
    m_row = tl.max(m, 0)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    scale = tl.exp(m - m_safe)
    s_row = tl.sum(s * scale, 0)
    t_row = tl.sum(t * scale, 0)  # zeros unless WITH_ENT
    return m_row, s_row, t_row


@triton.jit
def _load_z(row_ptr, cols, mask, inv_t, other):
    return tl.load(row_ptr + cols, mask=mask, other=other).to(tl.float32) * inv_t


@triton.jit
def _row_scan(row_ptr, n, inv_t, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    """(max, Σ e^(z-max), Σ e^(z-max)·z) of z = row[:n] * inv_t, in BLOCK_V-wide per-lane online passes."""
    offs = tl.arange(0, BLOCK_V)
    mv = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    sv = tl.zeros((BLOCK_V,), tl.float32)
    tv = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, n, BLOCK_V):
        cols = start + offs
        z = _load_z(row_ptr, cols, cols < n, inv_t, float("-inf"))
        mv, sv, tv = _lane_update(mv, sv, tv, z, WITH_ENT)
    return _lane_finish(mv, sv, tv, WITH_ENT)


@triton.jit
def tile_stats_kernel(
    z_ptr, ld, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, v0, vb, inv_t,
    WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * ld
    m_b, s_b, t_b = _row_scan(row_ptr, vb, inv_t, WITH_ENT, BLOCK_V)
    # combine this tile with the running state of the row
    m_o = tl.load(m_ptr + row)
    m = tl.maximum(m_o, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a_o = tl.exp(m_o - m_safe)
    a_b = tl.exp(m_b - m_safe)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, tl.load(s_ptr + row) * a_o + s_b * a_b)
    if WITH_ENT:
        tl.store(t_ptr + row, tl.load(t_ptr + row) * a_o + t_b * a_b)
    tv = tl.load(tgt_ptr + row).to(tl.int64) - v0
    hit = (tv >= 0) & (tv < vb)
    tvc = tl.where(hit, tv, 0)
    zt = tl.load(row_ptr + tvc).to(tl.float32)
    tl.store(zt_ptr + row, zt * inv_t, mask=hit)


@triton.jit
def rows_kernel(
    z_ptr, ld, tgt_ptr, logp_ptr, lse_ptr, ent_ptr, V, inv_t,
    WITH_ENT: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * ld
    m, s, t = _row_scan(row_ptr, V, inv_t, WITH_ENT, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    lse = m + tl.log(s)
    tv = tl.load(tgt_ptr + row).to(tl.int64)
    zt = tl.load(row_ptr + tv).to(tl.float32)
    tl.store(logp_ptr + row, zt * inv_t - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, lse - t / s)
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z = _load_z(row_ptr, cols, mask, inv_t, 0.0)
            d = (tl.where(cols == tv, 1.0, 0.0) - tl.exp(z - lse)) * inv_t
            tl.store(row_ptr + cols, d.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grad_tile_kernel(
    z_ptr, ld, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, v0, vb, inv_t,
    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr,
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
        g = tl.load(glp_ptr + row)
        tv = tl.load(tgt_ptr + row).to(tl.int64) - v0
        d += g * (tl.where(cols == tv, 1.0, 0.0) - p)
    if HAS_GENT:
        ge = tl.load(gent_ptr + row)
        ent = tl.load(ent_ptr + row)
        d -= ge * tl.where(p > 0, p * (z - lse + ent), 0.0)  # p = 0 where z = -inf (masked vocab)
    tl.store(row_ptr + cols, (d * inv_t).to(z_ptr.dtype.element_ty), mask=mask)
