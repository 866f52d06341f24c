"""Triton row passes over a bf16/fp16/fp32 logits tile that a cuBLAS GEMM has just written.

All softmax math is fp32; a tile element is z = (logit + bias) * inv_t. Three kernels:

* `tile_stats_kernel`: one program per row of a column tile [N, vb] (columns v0..v0+vb of the vocabulary);
  folds the tile into a running online log-sum-exp state per row (m = max, s = Σ e^(z-m), t = Σ e^(z-m)·z)
  and records the target's z when the target falls in the tile.
* `rows_kernel`: one program per full row [V] (frozen-head forward); computes lse, logp, entropy and, with
  WRITE_GRAD, overwrites the row in place with d logp / d logit = (onehot - p) * inv_t.
* `grad_tile_kernel`: 2-D grid over a column tile; overwrites it in place with the upstream-weighted
  gradient d = inv_t * (g_lp * (onehot - p) - g_ent * p * (z - lse + H)), using lse and H saved by forward.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _online_update(m, s, t, z, WITH_ENT: tl.constexpr):
    """Fold a block z (masked entries = -inf) into the running (max, sum-exp, sum-exp·z) of one row."""
    m_new = tl.maximum(m, tl.max(z, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of only -inf (masked bias) stays neutral
    alpha = tl.exp(m - m_safe)
    e = tl.exp(z - m_safe)
    s = s * alpha + tl.sum(e, 0)
    if WITH_ENT:
        t = t * alpha + tl.sum(tl.where(e > 0, e * z, 0.0), 0)
    return m_new, s, t


@triton.jit
def _load_z(row_ptr, bias_ptr, v0, cols, mask, inv_t, other, HAS_BIAS: tl.constexpr):
    z = tl.load(row_ptr + cols, mask=mask, other=other).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + v0 + cols, mask=mask, other=0.0).to(tl.float32)
    return z * inv_t


@triton.jit
def tile_stats_kernel(
    z_ptr, ld, bias_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr, v0, vb, inv_t,
    HAS_BIAS: tl.constexpr, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * ld
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    t = tl.load(t_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, vb, BLOCK_V):
        cols = start + offs
        z = _load_z(row_ptr, bias_ptr, v0, cols, cols < vb, inv_t, float("-inf"), HAS_BIAS)
        m, s, t = _online_update(m, s, t, z, WITH_ENT)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)
    tv = tl.load(tgt_ptr + row).to(tl.int64) - v0
    hit = (tv >= 0) & (tv < vb)
    tvc = tl.where(hit, tv, 0)
    zt = tl.load(row_ptr + tvc).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(bias_ptr + v0 + tvc).to(tl.float32)
    tl.store(zt_ptr + row, zt * inv_t, mask=hit)


@triton.jit
def rows_kernel(
    z_ptr, ld, bias_ptr, tgt_ptr, logp_ptr, lse_ptr, ent_ptr, V, inv_t,
    HAS_BIAS: tl.constexpr, WITH_ENT: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * ld
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        z = _load_z(row_ptr, bias_ptr, 0, cols, cols < V, inv_t, float("-inf"), HAS_BIAS)
        m, s, t = _online_update(m, s, t, z, WITH_ENT)
    lse = m + tl.log(s)
    tv = tl.load(tgt_ptr + row).to(tl.int64)
    zt = tl.load(row_ptr + tv).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(bias_ptr + tv).to(tl.float32)
    tl.store(logp_ptr + row, zt * inv_t - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, lse - t / s)
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z = _load_z(row_ptr, bias_ptr, 0, cols, mask, inv_t, 0.0, HAS_BIAS)
            d = (tl.where(cols == tv, 1.0, 0.0) - tl.exp(z - lse)) * inv_t
            tl.store(row_ptr + cols, d.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grad_tile_kernel(
    z_ptr, ld, bias_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, v0, vb, inv_t,
    HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vb
    row_ptr = z_ptr + row * ld
    z = _load_z(row_ptr, bias_ptr, v0, cols, mask, inv_t, 0.0, HAS_BIAS)
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
        d -= ge * p * (z - lse + ent)
    tl.store(row_ptr + cols, (d * inv_t).to(z_ptr.dtype.element_ty), mask=mask)
