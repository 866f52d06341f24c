"""Chunked PyTorch implementation of the fused token-logprob op (works on any device).

The rows of `hidden` are processed `chunk_size` at a time, so the only vocabulary-sized buffers are a few
[chunk_size, V] fp32 tiles; an [N, V] tensor is never allocated or saved for backward.

Forward, per chunk c (z = (h_c·Wᵀ + b) / T in fp32):
    lse_c = logsumexp(z), logp_c = z[target] - lse_c, entropy_c = lse_c - Σ_k p_k z_k.
Backward (upstream g_lp, g_ent per row), with p = softmax(z):
    dz = g_lp · (onehot - p) - g_ent · p · (log p + H)
    grad_h = (dz / T)·W,   grad_W = Σ_chunks (dz / T)ᵀ·h_c (fp32 accumulator),   grad_b = Σ_rows dz / T.

Two backward strategies:
  * default: the chunk's logits are recomputed in backward (1 GEMM forward; backward: logits, grad_h and,
    for a trainable head, grad_W). With a frozen head (LoRA: `weight.requires_grad=False`) grad_W is skipped.
  * frozen head and no entropy (the usual GRPO step): the logp part of grad_h, (onehot - p)/T · W, is formed
    per chunk in the forward while the softmax is at hand and saved as an [N, H] fp32 tensor; backward
    only scales it per row by g_lp. 2 GEMMs in all instead of 3 (CPU, N=2048 H=256 V=32000 fp32, 1 thread:
    ~1.7 s vs ~2.9 s forward+backward). With entropy its gradient would need a second [N, H] term (or a
    recompute), which is no cheaper than the recompute path, so entropy uses the default strategy.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# Rows per chunk default to CHUNK_ELEMENTS // V (CHUNK_ELEMENTS_CUDA on CUDA), clamped to [1, MAX_CHUNK_ROWS]:
# a [chunk, V] fp32 tile of 64 MiB on CPU, 512 MiB on CUDA (where GEMMs of ~100 rows are too thin: H200, bf16,
# N=8192 H=1536 V=151936 trainable fwd+bwd takes 140 ms with 96-row chunks, 50 ms with 1024, dense 42 ms).
# Peak extra memory is about 3 such tiles (logits, probabilities/grad, and a half-precision cast of the grad for
# bf16/fp16 GEMMs), whatever N is; plus an fp32 [V, H] grad_W accumulator for a trainable head and, for
# bf16/fp16 weights on non-CUDA devices, an fp32 copy of the weight.
CHUNK_ELEMENTS = 1 << 24
CHUNK_ELEMENTS_CUDA = 1 << 27
MAX_CHUNK_ROWS = 4096

# Frozen head without entropy: form grad_hidden in the forward (see module docstring). Toggle for benchmarks.
PRECOMPUTE_FROZEN_GRAD = True

_HALF = (torch.float16, torch.bfloat16)
_cuda_out_dtype_ok: bool | None = None


def default_chunk_size(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk used when `chunk_size=None`: CHUNK_ELEMENTS[_CUDA] // V, clamped to [1, MAX_CHUNK_ROWS]."""
    budget = CHUNK_ELEMENTS_CUDA if torch.device(device).type == "cuda" else CHUNK_ELEMENTS
    rows = budget // max(vocab_size, 1)
    if rows >= 16:
        rows -= rows % 16  # GEMM-friendly
    return max(1, min(MAX_CHUNK_ROWS, rows))


def _cuda_mm_out_dtype_supported(device: torch.device) -> bool:
    """Whether bf16/fp16 `mm`/`addmm(..., out_dtype=float32)` (fp32 output, in-place accumulate) work here."""
    global _cuda_out_dtype_ok
    if _cuda_out_dtype_ok is None:
        try:
            a = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
            acc = torch.ones(2, 2, device=device, dtype=torch.float32)
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _cuda_out_dtype_ok = ok and bool((acc == 3).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _cuda_out_dtype_ok = False
    return _cuda_out_dtype_ok


class _Gemm:
    """GEMMs in the weight's dtype with fp32 (fp64 for fp64 inputs) outputs and accumulation.

    bf16/fp16 on CUDA: `torch.mm(..., out_dtype=float32)` (fp32 accumulate, no rounding of the output).
    bf16/fp16 elsewhere (no such kernel): operands are upcast to fp32 (the weight once per call).
    """

    def __init__(self, weight: torch.Tensor):  # [V, H]
        self.compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
        half = weight.dtype in _HALF
        self.out_dtype = half and weight.is_cuda and _cuda_mm_out_dtype_supported(weight.device)
        self.operand = weight.dtype if self.out_dtype else self.compute
        self.weight = weight.to(self.operand)  # [V, H] (no copy unless upcast)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.to(self.operand), b.to(self.operand)
        if self.out_dtype:
            return torch.mm(a, b, out_dtype=self.compute)
        return torch.mm(a, b)

    def addmm_(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.out_dtype:  # cuBLAS accumulates into the fp32 C in place (beta=1)
            torch.addmm(acc, a.to(self.operand), b.to(self.operand), out_dtype=self.compute, out=acc)
        else:
            acc.addmm_(a.to(self.operand), b.to(self.operand))


def _logits(gemm: _Gemm, h: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = gemm.mm(h, gemm.weight.t())  # [C, V] fp32
    if bias is not None:
        z.add_(bias)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _without_autocast(fn: F) -> F:
    """Run `fn(hidden, ...)` with torch.autocast off on hidden's device: under a caller's autocast (the trainer's
    LoRA forwards, model.lora_compute) the fp32 GEMMs and the entropy's bmm would run in bf16 and round the logits
    (0.05 nats off measured on a bf16 model on CPU), where the op computes in the dtypes `_Gemm` chooses, as the
    Triton path does (`triton_op._on_device`)."""

    @functools.wraps(fn)
    def run(hidden: torch.Tensor, *args, **kwargs):
        with torch.autocast(hidden.device.type, enabled=False):
            return fn(hidden, *args, **kwargs)

    return run  # type: ignore[return-value]


@_without_autocast
def chunked_forward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] int64
    bias: torch.Tensor | None,  # [V]
    temperature: float,
    with_entropy: bool,
    chunk_size: int,
    grad_hidden_logp: torch.Tensor | None = None,  # [N, H] out: (onehot - p)/T · W, if given
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Returns (logp [N], entropy [N] or None, lse [N]) in fp32 (fp64 for fp64 inputs); lse = logsumexp(z)."""
    n = hidden.shape[0]
    gemm = _Gemm(weight)
    bias_c = None if bias is None else bias.to(gemm.compute)
    logp = torch.empty(n, dtype=gemm.compute, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    for s in range(0, n, chunk_size):
        e_ = min(s + chunk_size, n)
        t = targets[s:e_].unsqueeze(1)  # [C, 1]
        z = _logits(gemm, hidden[s:e_], bias_c, temperature)  # [C, V]
        m = z.amax(dim=1, keepdim=True)  # [C, 1]
        z.sub_(m)
        ez = torch.exp(z)  # [C, V]
        sumexp = ez.sum(dim=1, keepdim=True)  # [C, 1]
        lse_shift = sumexp.log()
        logp[s:e_] = (z.gather(1, t) - lse_shift).squeeze(1)
        lse[s:e_] = (m + lse_shift).squeeze(1)
        if with_entropy:
            ez_dot_z = torch.bmm(ez.unsqueeze(1), z.unsqueeze(2)).view(-1, 1)  # Σ_k e^z_k z_k, [C, 1]
            entropy[s:e_] = (lse_shift - ez_dot_z / sumexp).squeeze(1)
        if grad_hidden_logp is not None:
            g = ez.div_(sumexp).neg_()  # -p, [C, V]
            g.scatter_add_(1, t, torch.ones_like(t, dtype=g.dtype))  # onehot - p
            if temperature != 1.0:
                g.div_(temperature)
            grad_hidden_logp[s:e_] = gemm.mm(g, gemm.weight)  # [C, H]
        del z, ez
    return logp, entropy, lse


@_without_autocast
def chunked_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] int64
    bias: torch.Tensor | None,  # [V]
    temperature: float,
    chunk_size: int,
    lse: torch.Tensor,  # [N]
    entropy: torch.Tensor | None,  # [N] (needed when g_ent is given)
    g_lp: torch.Tensor | None,  # [N] upstream grad of logp (None: zero)
    g_ent: torch.Tensor | None,  # [N] upstream grad of entropy (None: zero)
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Recomputes each chunk's softmax and returns fp32 (grad_hidden, grad_weight, grad_bias) (None if unneeded)."""
    n = hidden.shape[0]
    gemm = _Gemm(weight)
    bias_c = None if bias is None else bias.to(gemm.compute)
    grad_h = torch.empty(hidden.shape, dtype=gemm.compute, device=hidden.device) if need_hidden else None
    grad_w = torch.zeros(weight.shape, dtype=gemm.compute, device=weight.device) if need_weight else None
    grad_b = torch.zeros(weight.shape[0], dtype=gemm.compute, device=weight.device) if need_bias else None
    if g_lp is not None:
        g_lp = g_lp.to(gemm.compute)
    if g_ent is not None:
        g_ent = g_ent.to(gemm.compute)
    for s in range(0, n, chunk_size):
        e_ = min(s + chunk_size, n)
        h = hidden[s:e_]
        z = _logits(gemm, h, bias_c, temperature)  # [C, V]
        z.sub_(lse[s:e_].unsqueeze(1))  # log p
        if g_ent is not None:
            # dz = -p · (g_lp + g_ent · (log p + H)) (+ g_lp at the target)
            dz = torch.exp(z)  # p
            coef = z.add_(entropy[s:e_].unsqueeze(1)).mul_(g_ent[s:e_].unsqueeze(1))
            if g_lp is not None:
                coef.add_(g_lp[s:e_].unsqueeze(1))
            dz.mul_(coef).neg_()
            del coef, z
        else:
            dz = z.exp_().mul_(-g_lp[s:e_].unsqueeze(1))  # -p · g_lp
        if g_lp is not None:
            dz.scatter_add_(1, targets[s:e_].unsqueeze(1), g_lp[s:e_].unsqueeze(1))
        if temperature != 1.0:
            dz.div_(temperature)  # d/dlogits, [C, V]
        if need_bias:
            grad_b.add_(dz.sum(0))
        dz_op = dz.to(gemm.operand)  # one cast for both GEMMs (no copy in fp32)
        del dz
        if need_hidden:
            grad_h[s:e_] = gemm.mm(dz_op, gemm.weight)
        if need_weight:
            gemm.addmm_(grad_w, dz_op.t(), h)
        del dz_op
    return grad_h, grad_w, grad_b


class ChunkedTokenLogprobs(torch.autograd.Function):
    """autograd Function over `chunked_forward`/`chunked_backward`; inputs are validated by the caller."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_size):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        precompute = PRECOMPUTE_FROZEN_GRAD and need_h and not need_w and not need_b and not with_entropy
        g_h_logp = None
        if precompute:
            compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
            g_h_logp = torch.empty(hidden.shape, dtype=compute, device=hidden.device)  # [N, H]
        logp, entropy, lse = chunked_forward(
            hidden, weight, targets, bias, temperature, with_entropy, chunk_size, g_h_logp
        )
        ctx.set_materialize_grads(False)
        if precompute:  # backward needs nothing else
            ctx.save_for_backward(g_h_logp)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.precompute = temperature, chunk_size, precompute
        ctx.needs, ctx.dtypes = (need_h, need_w, need_b), (hidden.dtype, weight.dtype)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        need_h, need_w, need_b = ctx.needs
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None
        grad_w = grad_b = None
        if ctx.precompute:  # frozen head, no entropy output: grad_h = g_lp · (onehot - p)/T · W
            (g_h_logp,) = ctx.saved_tensors
            grad_h = g_h_logp * g_lp.to(g_h_logp.dtype).unsqueeze(1)
        else:
            hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
            grad_h, grad_w, grad_b = chunked_backward(
                hidden, weight, targets, bias, ctx.temperature, ctx.chunk_size, lse, entropy,
                g_lp, g_ent, need_h, need_w, need_b,
            )
        h_dtype, w_dtype = ctx.dtypes
        grad_h = None if grad_h is None else grad_h.to(h_dtype)
        grad_w = None if grad_w is None else grad_w.to(w_dtype)
        grad_b = None if grad_b is None else grad_b.to(w_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None
