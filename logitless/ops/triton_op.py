"""CUDA backend of the fused token-logprob op: cuBLAS GEMMs on logits tiles + Triton passes over each tile.

Equivalent to (the logits are a GEMM in the inputs' dtype, the softmax math is fp32)::

    z = (hidden @ weight.T + bias) / temperature                        # [N, V], never allocated whole
    logp = torch.log_softmax(z.float(), -1).gather(-1, targets[:, None]).squeeze(-1)   # [N]
    entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)               # [N]

The logits only ever exist as one bounded tile (`TILE_BYTES`, or `ROW_CHUNK_BYTES` for the frozen-head
forward), written by cuBLAS and consumed in place by the kernels of `triton_kernels`:

* no grad / trainable head, forward: column tiles [N, vb] (vb vocabulary columns, all rows); each
  (row, 2048-column block) of a tile leaves its (max, sum-exp, sum-exp·z) in a small partials array that one
  last pass folds into lse / logp / entropy (1 GEMM). Saved for backward: lse and entropy ([N] fp32).
* trainable head, backward: the same column tiles are recomputed (same GEMM shapes as the forward), turned
  in place into the upstream-weighted logits gradient, then grad_W[tile] = Dᵀ·h (one GEMM reducing over all
  N, no cross-tile accumulation) and grad_h += D·W[tile] (fp32 accumulator [N, H]): 4 GEMMs in all.
* trainable head with a gradient hint g (the expected d loss / d logp, e.g. on-policy GRPO where it is known
  before the forward): row chunks [C, V] as below, each turned in place into g·(onehot - p)/T, then
  grad_h[chunk] = D·W and grad_W += Dᵀ·h[chunk] right away (3 GEMMs in all). Backward hands these over when
  its upstream equals g exactly (one device sync to compare), else it recomputes as above: a wrong hint costs
  time, never correctness.
* frozen head (only `hidden` needs grad), forward: row chunks [C, V]; the same block/fold passes give
  lse/logp/entropy, one more overwrites the chunk with d logp / d logit = (onehot - p) / T, and A = that · W
  is formed right away (2 GEMMs
  in all). Backward scales A in place by the upstream g_logp (A becomes grad_h). When the entropy output
  also receives a gradient (an entropy bonus; not when entropy is only a metric), backward instead does one
  column-tiled recompute pass with both upstream terms (2 more GEMMs; A is then unused).
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

try:
    import triton

    from logitless.ops import triton_kernels as _k
except ImportError:  # pragma: no cover - triton is optional
    triton = None
    _k = None

# Bytes of the logits tile (trainable head / no grad): vb = TILE_BYTES // (N * itemsize) columns (capped by
# the weight's size and 1/8 of the [N, V] logits, see _tile_cols).
TILE_BYTES = 512 << 20
# Bytes of a frozen-head forward row chunk [C, V]: C = ROW_CHUNK_BYTES // (V * itemsize) rows.
ROW_CHUNK_BYTES = 128 << 20
# Frozen head: form A = (onehot - p)/T · W in the forward (2 GEMMs). False: recompute in backward (3 GEMMs).
PRECOMPUTE_FROZEN_GRAD = True
# Trainable head with a gradient hint: row chunks of HINT_ROW_BYTES, but never more than HINT_MAX_CHUNKS chunks.
# grad_W is accumulated across chunks in the weight's dtype (one rounding per chunk, no extra memory), or with
# HINT_FP32_ACCUMULATE in an fp32 [V, H] buffer (as accurate as one GEMM, 6 bytes per weight more at the peak).
HINT_ROW_BYTES = 576 << 20
HINT_MAX_CHUNKS = 16
HINT_FP32_ACCUMULATE = False

_BLOCK = 4096  # vocabulary columns per Triton program (every pass is a (row, column block) grid)
_addmm_out_dtype_ok: bool | None = None


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on `device` (a CUDA device with Triton installed)."""
    device = torch.device(device)
    return _k is not None and device.type == "cuda" and torch.cuda.is_available()


def triton_token_logprobs(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] int
    bias: torch.Tensor | None,  # [V]
    temperature: float,
    with_entropy: bool,
    grad_hint: torch.Tensor | None = None,  # [N] fp32: expected d loss / d logp (trainable head only)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [N] fp32, entropy [N] fp32 or None), autograd-connected to hidden, weight and bias.

    Inputs are assumed validated (see `logitless.ops.token_logprobs`).
    """
    targets = targets.to(torch.int32).contiguous()  # V < 2**31; kernels index targets with stride 1
    bias = None if bias is None else bias.contiguous()
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:  # old/ref logprobs: forward only, nothing saved
        with torch.no_grad(), _on_device(hidden):
            lse, logp, ent = _forward_tiles(hidden, weight, bias, targets, 1.0 / float(temperature), with_entropy)
        return logp, ent
    if grad_hint is not None:
        grad_hint = grad_hint.to(device=hidden.device, dtype=torch.float32).contiguous()
    return _TritonTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), with_entropy, grad_hint)


@contextlib.contextmanager
def _on_device(t: torch.Tensor):
    """Launch on t's GPU (Triton uses the current device) with autocast off (GEMMs run in the inputs' dtype)."""
    if t.is_cuda:
        with torch.cuda.device(t.device), torch.autocast("cuda", enabled=False):
            yield
    else:  # CPU tensors only under TRITON_INTERPRET=1 (tests)
        yield


class _TritonTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, grad_hint):
        ctx.set_materialize_grads(False)
        inv_t = 1.0 / temperature
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        ctx.inv_t, ctx.with_entropy = inv_t, with_entropy
        ctx.frozen = need_dx and not need_dw and not need_db and PRECOMPUTE_FROZEN_GRAD
        ctx.hint, ctx.pre = None, None  # hinted path: the hint and the grads it gives (dx, dw, db)
        hidden, weight = hidden.contiguous(), weight.contiguous()
        with _on_device(hidden):
            if grad_hint is not None and (need_dw or need_db) and hidden.shape[0] > 0:
                lse, logp, ent, *pre = _forward_rows_hinted(hidden, weight, bias, targets, inv_t, with_entropy,
                                                            grad_hint, need_dx, need_dw, need_db)
                ctx.hint, ctx.pre, grad_logp_h = grad_hint, pre, None
            elif ctx.frozen:
                lse, logp, ent, grad_logp_h = _forward_rows_frozen(hidden, weight, bias, targets, inv_t, with_entropy)
            else:
                lse, logp, ent = _forward_tiles(hidden, weight, bias, targets, inv_t, with_entropy)
                grad_logp_h = None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent, grad_logp_h)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ent, grad_logp_h = ctx.saved_tensors
        with _on_device(hidden):
            return _TritonTokenLogprobs._backward(ctx, hidden, weight, bias, targets, lse, ent, grad_logp_h, g_lp, g_ent)

    @staticmethod
    def _backward(ctx, hidden, weight, bias, targets, lse, ent, grad_logp_h, g_lp, g_ent):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        if not ctx.with_entropy:
            g_ent = None
        n = hidden.shape[0]
        if n == 0 or (g_lp is None and g_ent is None):
            zeros = [torch.zeros_like(t) if (t is not None and need) else None
                     for t, need in ((hidden, need_dx), (weight, need_dw), (bias, need_db))]
            return (*zeros, None, None, None, None)
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        if ctx.frozen and g_ent is None:
            # A becomes grad_h in place (no copy); a second backward trips autograd's version check
            return grad_logp_h.mul_(g_lp[:, None]), None, None, None, None, None, None
        pre, ctx.pre = ctx.pre, None  # handed over once; a second backward recomputes
        if pre is not None and g_ent is None and g_lp is not None and torch.equal(g_lp, ctx.hint):
            return (*pre, None, None, None, None)
        # trainable head, or a frozen head whose entropy output got a gradient: one column-tiled recompute
        # pass with both upstream terms (more accurate than adding a rounded A to the entropy part)
        acc, dw, db = _backward_tiles(hidden, weight, bias, targets, ctx.inv_t, lse, ent, g_lp, g_ent,
                                      need_dx=need_dx, need_dw=need_dw, need_db=need_db)
        dx = acc.to(hidden.dtype) if acc is not None else None
        return dx, dw, db, None, None, None, None


def _tile_cols(n: int, v: int, h: int, itemsize: int) -> int:
    """Vocabulary columns per [N, vb] tile, a multiple of 128 in [128, V].

    The tile holds TILE_BYTES, but (down to 64 MiB) no more than the weight itself nor 1/8 of the whole
    [N, V] logits, so that extra memory stays small next to the weight gradient and to dense logits.
    """
    budget = min(TILE_BYTES, max(64 << 20, min(v * h * itemsize, n * v * itemsize // 8)))
    cols = budget // (max(n, 1) * itemsize)
    cols = max(128, cols - cols % 128)
    return min(v, cols)


def _row_outputs(n: int, device: torch.device, with_entropy: bool):
    """Empty fp32 (lse [N], logp [N], entropy [N] or None)."""
    new = lambda: torch.empty(n, dtype=torch.float32, device=device)  # noqa: E731
    return new(), new(), (new() if with_entropy else None)


def _forward_tiles(hidden, weight, bias, targets, inv_t, with_entropy):
    """Column-tiled forward: returns (lse [N], logp [N], entropy [N] or None), all fp32."""
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    lse, logp, ent = _row_outputs(n, dev, with_entropy)
    if n == 0:
        return lse, logp, ent
    cols = _tile_cols(n, v, hidden.shape[1], hidden.element_size())
    tiles = [(v0, min(cols, v - v0)) for v0 in range(0, v, cols)]
    blocks = [triton.cdiv(vb, _BLOCK) for _, vb in tiles]  # partial columns per tile
    n_parts = sum(blocks)
    parts = torch.empty((3, n, n_parts), dtype=torch.float32, device=dev)  # per (row, block): m, Σe, Σe·z
    zt = torch.empty(n, dtype=torch.float32, device=dev)
    buf = torch.empty(n * cols, dtype=hidden.dtype, device=dev)
    col0 = 0
    for (v0, vb), nb in zip(tiles, blocks):
        tile = buf[: n * vb].view(n, vb)  # [N, vb]
        _logits(hidden, weight, bias, v0, vb, tile)
        _block_stats(tile, targets, v0, inv_t, parts, col0, zt, with_entropy)
        col0 += nb
    del buf
    _combine(parts, zt, lse, logp, ent)
    return lse, logp, ent


def _block_stats(tile, targets, v0, inv_t, parts, col0, zt, with_entropy):
    n, vb = tile.shape
    _k.block_stats_kernel[(n, triton.cdiv(vb, _BLOCK))](
        tile, vb, vb, inv_t, targets, v0, parts, n, parts.shape[2], col0, zt,
        WITH_ENT=with_entropy, BLOCK_V=_BLOCK, num_warps=4,
    )


def _combine(parts, zt, lse, logp, ent):
    n, n_parts = parts.shape[1], parts.shape[2]
    _k.combine_kernel[(n,)](
        parts, n, n_parts, zt, lse, logp, ent if ent is not None else lse,
        WITH_ENT=ent is not None, BLOCK_P=triton.next_power_of_2(n_parts), num_warps=4,
    )


def _grad_tile(tile, targets, v0, inv_t, lse, ent, g_lp, g_ent, *, unit_glp=False):
    """Overwrite `tile` with d = inv_t · (g_lp · (onehot − p) − g_ent · p · (z − lse + H)); unit_glp: g_lp ≡ 1."""
    n, vb = tile.shape
    _k.grad_tile_kernel[(n, triton.cdiv(vb, _BLOCK))](
        tile, vb, targets, lse, ent if ent is not None else lse,
        g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, v0, vb, inv_t,
        HAS_GLP=unit_glp or g_lp is not None, HAS_GENT=g_ent is not None, UNIT_GLP=unit_glp,
        BLOCK_V=_BLOCK, num_warps=4,
    )


def _chunk_rows(n: int, rows: int, at_least: int = 1) -> int:
    """Rows per [C, V] chunk: `rows` rounded down to a multiple of 64 (when >= 64), then at least `at_least`
    and at most n."""
    rows = max(1, rows)
    if rows >= 64:
        rows -= rows % 64
    return min(n, max(rows, at_least))


def _row_chunks(hidden, weight, bias, targets, inv_t, rows, lse, logp, ent):
    """Yield (rows slice r, chunk [C, V]): the logits of rows r, after writing their lse / logp / entropy.

    One [rows, V] buffer serves every chunk, so a chunk is valid (and may be overwritten in place) only until
    the next one is yielded.
    """
    n, v = hidden.shape[0], weight.shape[0]
    n_parts = triton.cdiv(v, _BLOCK)
    part_buf = torch.empty(3 * rows * n_parts, dtype=torch.float32, device=hidden.device)
    zt = torch.empty(n, dtype=torch.float32, device=hidden.device)
    buf = torch.empty(rows * v, dtype=hidden.dtype, device=hidden.device)
    for r0 in range(0, n, rows):
        c = min(rows, n - r0)
        r = slice(r0, r0 + c)
        chunk = buf[: c * v].view(c, v)  # [C, V]
        parts = part_buf[: 3 * c * n_parts].view(3, c, n_parts)
        _logits(hidden[r], weight, bias, 0, v, chunk)
        _block_stats(chunk, targets[r], 0, inv_t, parts, 0, zt[r], ent is not None)
        _combine(parts, zt[r], lse[r], logp[r], ent[r] if ent is not None else None)
        yield r, chunk


def _forward_rows_frozen(hidden, weight, bias, targets, inv_t, with_entropy):
    """Row-chunked forward that also forms A = d logp / d hidden = ((onehot - p) / T) · W, [N, H] in hidden's dtype."""
    n, v = hidden.shape[0], weight.shape[0]
    lse, logp, ent = _row_outputs(n, hidden.device, with_entropy)
    grad_h = torch.empty_like(hidden)  # [N, H]
    if n > 0:
        rows = _chunk_rows(n, ROW_CHUNK_BYTES // (v * hidden.element_size()))
        for r, chunk in _row_chunks(hidden, weight, bias, targets, inv_t, rows, lse, logp, ent):
            _grad_tile(chunk, targets[r], 0, inv_t, lse[r], None, None, None, unit_glp=True)  # (onehot - p) / T
            torch.mm(chunk, weight, out=grad_h[r])
    return lse, logp, ent, grad_h


def _forward_rows_hinted(hidden, weight, bias, targets, inv_t, with_entropy, hint, need_dx, need_dw, need_db):
    """Row-chunked forward that also forms the gradients of sum(hint · logp) (3 GEMMs in all).

    Returns (lse, logp, entropy or None, grad_h [N, H] or None, grad_W [V, H] or None, grad_b [V] or None).
    grad_W is accumulated in the weight's dtype by cuBLAS (fp32 inside each chunk's GEMM, one rounding per
    chunk; at most HINT_MAX_CHUNKS chunks), so it takes no memory beyond the gradient itself; or in fp32 with
    HINT_FP32_ACCUMULATE.
    """
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    lse, logp, ent = _row_outputs(n, dev, with_entropy)
    dx = torch.empty_like(hidden) if need_dx else None
    acc32 = need_dw and HINT_FP32_ACCUMULATE and weight.dtype != torch.float32
    dw = None
    if need_dw:
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if acc32 else torch.empty_like(weight)
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    rows = _chunk_rows(n, HINT_ROW_BYTES // (v * hidden.element_size()), at_least=triton.cdiv(n, HINT_MAX_CHUNKS))
    for r, chunk in _row_chunks(hidden, weight, bias, targets, inv_t, rows, lse, logp, ent):
        _grad_tile(chunk, targets[r], 0, inv_t, lse[r], None, hint[r], None)  # hint · (onehot - p) / T
        if need_dx:
            torch.mm(chunk, weight, out=dx[r])
        if acc32:
            _acc_mm(dw, chunk.t(), hidden[r])
        elif need_dw:
            if r.start == 0:
                torch.mm(chunk.t(), hidden[r], out=dw)
            else:
                dw.addmm_(chunk.t(), hidden[r])
        if need_db:
            db += chunk.sum(0, dtype=torch.float32)
    if acc32:
        dw = dw.to(weight.dtype)
    return lse, logp, ent, dx, dw, (db.to(bias.dtype) if db is not None else None)


def _backward_tiles(hidden, weight, bias, targets, inv_t, lse, ent, g_lp, g_ent, *, need_dx, need_dw, need_db):
    """Recompute each column tile, turn it into the logits gradient, and contract it.

    Returns (grad_h fp32 [N, H] or None, grad_W [V, H] or None, grad_b [V] or None).
    """
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    acc = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_dx else None
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty(v, dtype=torch.float32, device=dev) if need_db else None
    cols = _tile_cols(n, v, hidden.shape[1], hidden.element_size())
    buf = torch.empty(n * cols, dtype=hidden.dtype, device=dev)
    for v0 in range(0, v, cols):
        vb = min(cols, v - v0)
        tile = buf[: n * vb].view(n, vb)  # [N, vb]
        _logits(hidden, weight, bias, v0, vb, tile)
        _grad_tile(tile, targets, v0, inv_t, lse, ent, g_lp, g_ent)
        if need_dw:
            torch.mm(tile.t(), hidden, out=dw[v0 : v0 + vb])
        if need_db:
            torch.sum(tile, dim=0, dtype=torch.float32, out=db[v0 : v0 + vb])
        if need_dx:
            _acc_mm(acc, tile, weight[v0 : v0 + vb])
    del buf
    if db is not None:
        db = db.to(bias.dtype)
    return acc, dw, db


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v0: int, vb: int,
            out: torch.Tensor) -> None:
    """out = hidden @ weight[v0:v0+vb].T (+ bias[v0:v0+vb]) in one GEMM, rounded once like `F.linear`."""
    w = weight[v0 : v0 + vb].t()
    if bias is None:
        torch.mm(hidden, w, out=out)
    else:
        torch.addmm(bias[v0 : v0 + vb], hidden, w, out=out)


def _acc_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b with fp32 accumulation, for half-precision a, b (cuBLAS beta=1 when supported)."""
    global _addmm_out_dtype_ok
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda:
        if _addmm_out_dtype_ok is not False:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                _addmm_out_dtype_ok = True
                return
            except (RuntimeError, TypeError, NotImplementedError):
                _addmm_out_dtype_ok = False
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
        return
    acc.addmm_(a.float(), b.float())  # CPU (interpreter tests)
