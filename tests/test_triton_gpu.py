"""GPU tests of the Triton backend: accuracy vs a float64 oracle (bf16 no worse than dense bf16 torch),
dispatch, and bounded memory. Skipped without CUDA (see conftest)."""

from __future__ import annotations

import pytest
import torch

from logitless.ops.reference import token_logprobs_reference

pytestmark = pytest.mark.gpu


def _run(fn, h, w, b, tg, temp, ent, need, g_lp, g_ent):
    h = h.detach().clone().requires_grad_(need[0])
    w = w.detach().clone().requires_grad_(need[1])
    b = None if b is None else b.detach().clone().requires_grad_(need[2])
    lp, e = fn(h, w, tg, b, temp, ent)
    loss = (lp.double() * g_lp).sum()
    if ent:
        loss = loss + (e.double() * g_ent).sum()
    loss.backward()
    return dict(logp=lp, ent=e, dh=h.grad, dw=w.grad, db=None if b is None else b.grad)


def _ours(h, w, tg, b, temp, ent):
    from logitless.ops.triton_op import triton_token_logprobs

    return triton_token_logprobs(h, w, tg, b, temp, ent)


def _dense(h, w, tg, b, temp, ent):
    return token_logprobs_reference(h, w, tg, bias=b, temperature=temp, with_entropy=ent)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (True, False, True)])
@pytest.mark.parametrize("shape", [(1000, 512, 32003, 0.7, True), (2048, 1024, 50257, 1.0, False)])
def test_accuracy_vs_fp64(dtype, need, shape):
    from logitless.ops import triton_op

    n, h_, v, temp, bias = shape
    g = torch.Generator(device="cuda").manual_seed(n + v)
    hid = torch.randn(n, h_, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h_, device="cuda", generator=g) * 2 / h_**0.5).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * 0.5).to(dtype) if bias else None
    need = need if bias else need[:2] + (False,)
    tg = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", dtype=torch.float64, generator=g)
    g_ent = torch.randn(n, device="cuda", dtype=torch.float64, generator=g)
    old = triton_op.TILE_BYTES, triton_op.ROW_CHUNK_BYTES
    triton_op.TILE_BYTES, triton_op.ROW_CHUNK_BYTES = 8 << 20, 8 << 20  # several ragged tiles / chunks
    try:
        up = lambda t: None if t is None else t.double()  # noqa: E731
        ref = _run(_dense, up(hid), up(w), up(b), tg, temp, True, need, g_lp, g_ent)
        got = _run(_ours, hid, w, b, tg, temp, True, need, g_lp, g_ent)
        low = _run(_dense, hid, w, b, tg, temp, True, need, g_lp, g_ent)
    finally:
        triton_op.TILE_BYTES, triton_op.ROW_CHUNK_BYTES = old
    for k, r in ref.items():
        if r is None:
            assert got[k] is None, k
            continue
        assert torch.isfinite(got[k]).all(), k
        err = _rel(got[k], r)
        if dtype == torch.float32:
            assert err < 2e-3, f"{k}: {err:.3g}"  # tf32-free fp32 GEMMs land far below; tf32 near 3e-4
        else:
            dense_err = _rel(low[k], r)
            assert err <= 1.25 * dense_err + 1e-5, f"{k}: triton {err:.3g} vs dense bf16 {dense_err:.3g}"


def test_auto_dispatch_uses_triton_and_no_nv_buffer():
    from logitless.ops import token_logprobs
    from logitless.ops import triton_op

    n, h_, v = 8192, 1024, 65536
    hid = torch.randn(n, h_, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h_, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    tg = torch.randint(0, v, (n,), device="cuda")
    called = []
    orig = triton_op.triton_token_logprobs
    triton_op.triton_token_logprobs = lambda *a: called.append(1) or orig(*a)
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp, ent = token_logprobs(hid, w, tg, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    finally:
        triton_op.triton_token_logprobs = orig
    assert called, "backend='auto' on CUDA should use the Triton kernel"
    nv_bytes = n * v * 2
    grads = hid.numel() * 2 + w.numel() * 2
    assert peak - grads < 0.75 * nv_bytes, f"extra peak {peak / 2**20:.0f} MiB vs [N,V] bf16 {nv_bytes / 2**20:.0f} MiB"


def test_empty_and_no_grad():
    from logitless.ops.triton_op import triton_token_logprobs

    w = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lp, ent = triton_token_logprobs(h, w, torch.zeros(0, dtype=torch.long, device="cuda"), None, 1.0, True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 64) and torch.count_nonzero(w.grad) == 0
    with torch.no_grad():
        h2 = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
        lp2, _ = triton_token_logprobs(h2, w, torch.arange(5, device="cuda"), None, 1.0, False)
    ref, _ = token_logprobs_reference(h2.double(), w.detach().double(), torch.arange(5, device="cuda"))
    assert lp2.grad_fn is None and torch.allclose(lp2.double(), ref, atol=0.1)


def test_under_autocast_and_create_graph_refused():
    from logitless.ops.triton_op import triton_token_logprobs

    g = torch.Generator(device="cuda").manual_seed(7)
    h = torch.randn(300, 256, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(5000, 256, device="cuda", generator=g) / 16).to(torch.bfloat16).requires_grad_()
    tg = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    lp_plain, _ = triton_token_logprobs(h, w, tg, None, 1.0, False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp_auto, _ = triton_token_logprobs(h, w, tg, None, 1.0, False)
    assert torch.equal(lp_plain, lp_auto)
    gh, = torch.autograd.grad(lp_auto.sum(), h, create_graph=True)
    with pytest.raises(RuntimeError):
        gh.sum().backward()  # the op is once-differentiable


@pytest.mark.parametrize("dtype,acc32", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("need", [(True, True, True), (False, True, False)])
def test_grad_hint_accuracy_vs_fp64(dtype, acc32, need, monkeypatch):
    """With a matching hint the forward forms the grads (no backward recompute), as accurate as dense."""
    from logitless.ops import triton_op

    n, h_, v, temp = 1000, 512, 32003, 0.7
    g = torch.Generator(device="cuda").manual_seed(11)
    hid = torch.randn(n, h_, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h_, device="cuda", generator=g) * 2 / h_**0.5).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * 0.5).to(dtype)
    tg = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", dtype=torch.float64, generator=g)
    calls = []
    monkeypatch.setattr(triton_op, "HINT_ROW_BYTES", 8 << 20)  # 8 row chunks
    monkeypatch.setattr(triton_op, "HINT_FP32_ACCUMULATE", acc32)
    orig = triton_op._backward_tiles
    monkeypatch.setattr(triton_op, "_backward_tiles", lambda *a, **k: calls.append(1) or orig(*a, **k))

    def hinted(h, w, tg, b, temp, ent):
        return triton_op.triton_token_logprobs(h, w, tg, b, temp, ent, g_lp.float())

    up = lambda t: t.double()  # noqa: E731
    ref = _run(_dense, up(hid), up(w), up(b), tg, temp, False, need, g_lp, None)
    got = _run(hinted, hid, w, b, tg, temp, False, need, g_lp, None)
    low = _run(_dense, hid, w, b, tg, temp, False, need, g_lp, None)
    assert not calls, "a matching hint must not recompute in backward"
    for k, r in ref.items():
        if r is None:
            assert got[k] is None, k
            continue
        err = _rel(got[k], r)
        if dtype == torch.float32:
            assert err < 2e-3, f"{k}: {err:.3g}"
        else:
            assert err <= 1.25 * _rel(low[k], r) + 1e-5, f"{k}: hinted {err:.3g} vs dense bf16 {_rel(low[k], r):.3g}"


def test_on_policy_hint_is_taken_end_to_end(monkeypatch):
    """Trainer path: on_policy_logp_grad -> completion_logprobs(grad_hint) -> policy_loss: the loss's real upstream
    equals the hint bit for bit on CUDA (no recompute), and the grads match the unhinted run."""
    from logitless.models import completion_logprobs
    from logitless.objectives import ObjectiveOptions, loss_normalizer, on_policy_logp_grad, policy_loss
    from logitless.ops import triton_op
    from tests.conftest import tiny_qwen2

    model = tiny_qwen2(tie=False, seed=3).cuda().train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    B, P, T = 6, 5, 40
    p_ids, c_ids = torch.randint(0, vocab, (B, P), generator=g), torch.randint(0, vocab, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    c_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    batch = [t.cuda() for t in (p_ids, torch.ones(B, P, dtype=torch.long), c_ids, c_mask)]
    adv = torch.randn(B, generator=g).cuda()
    opts = ObjectiveOptions(loss_type="dapo", epsilon_high=0.28)
    norm = loss_normalizer(opts, [batch[3]])
    calls = []
    orig = triton_op._backward_tiles
    monkeypatch.setattr(triton_op, "_backward_tiles", lambda *a, **k: calls.append(1) or orig(*a, **k))
    grads = []
    for hint in (on_policy_logp_grad(batch[3], adv, opts, norm), None):
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, *batch, temperature=0.9, with_entropy=True, grad_hint=hint)
        policy_loss(logp, batch[3], adv, opts, norm, entropy=ent.detach()).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert len(calls) == (0 if hint is not None else 1), calls
    for n, gr in grads[1].items():
        torch.testing.assert_close(grads[0][n], gr, rtol=1e-3, atol=1e-4 * gr.abs().max().item(), msg=n)
