"""CUDA correctness and memory of the fused token-logprob op (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from logitless.ops import token_logprobs, token_logprobs_reference

pytestmark = pytest.mark.gpu


def _run(fn, h0, w0, b0, targets, g_lp, g_ent, dtype, **kw):
    h = h0.to(dtype).requires_grad_()
    w = w0.to(dtype).requires_grad_()
    b = b0.to(dtype).requires_grad_()
    logp, ent = fn(h, w, targets, bias=b, temperature=0.7, with_entropy=True, **kw)
    loss = (logp * g_lp.to(logp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()
    grads = torch.autograd.grad(loss, [h, w, b])
    return [x.detach().double() for x in (logp, ent, *grads)]


@pytest.mark.parametrize("backend", ["chunked", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_fp64_truth_no_worse_than_naive(dtype, backend):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, hd, v = 301, 67, 5003
    h0 = torch.randn(n, hd, generator=g, device=dev, dtype=torch.float64).to(dtype)
    w0 = (0.3 * torch.randn(v, hd, generator=g, device=dev, dtype=torch.float64)).to(dtype)
    b0 = (0.3 * torch.randn(v, generator=g, device=dev, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device=dev)
    g_lp = torch.randn(n, generator=g, device=dev, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, device=dev, dtype=torch.float64)
    args = (h0, w0, b0, targets, g_lp, g_ent)
    truth = _run(token_logprobs_reference, *args, torch.float64)
    naive = _run(token_logprobs_reference, *args, dtype)
    op = _run(token_logprobs, *args, dtype, chunk_size=64 if backend == "chunked" else None, backend=backend)
    for name, o, nv, tr in zip(["logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"], op, naive, truth):
        out_dtype = torch.float32 if name in ("logp", "entropy") else dtype
        scale = tr.abs().max().item()
        tol = 2 * torch.finfo(out_dtype).eps * scale
        err_op, err_naive = (o - tr).abs().max().item(), (nv - tr).abs().max().item()
        assert err_op <= err_naive + tol, f"{name}: op error {err_op:.3e} > naive {err_naive:.3e} + {tol:.1e}"
        if name in ("logp", "entropy") and backend == "chunked":  # fp32 logits for any input dtype
            assert err_op <= 1e-5 * max(scale, 1.0), f"{name}: op error {err_op:.3e} is not fp32-accurate"


@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_cuda_peak_memory_far_below_dense_logits(backend):
    dev = torch.device("cuda")
    n, hd, v = 131072, 256, 32000  # dense fp32 logits would be 16 GiB
    hidden = torch.randn(n, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.05 * torch.randn(v, hd, device=dev)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, ent = token_logprobs(hidden, weight, targets, with_entropy=True, backend=backend)
    (logp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    dense = n * v * 4
    assert extra < dense / 4, f"peak extra {extra / 2**20:.0f} MiB vs dense logits {dense / 2**20:.0f} MiB"
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    print(f"[{backend}] peak extra {extra / 2**30:.2f} GiB vs dense logits {dense / 2**30:.0f} GiB")
