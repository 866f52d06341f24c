"""Correctness of the fused token-logprob op against an fp64 dense ground truth, plus its input checks."""

from __future__ import annotations

import warnings

import pytest
import torch

import logitless
import logitless.ops.chunked as chunked
from logitless.ops import token_logprobs, token_logprobs_reference
from logitless.ops.chunked import CHUNK_ELEMENTS, CHUNK_ELEMENTS_CUDA, default_chunk_size

N, H, V = 37, 23, 1009  # odd shapes: V is not a multiple of the chunk, N not a multiple of CHUNK
CHUNK = 8
TEMP = 0.7


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes


def _inputs(dtype, n=N, h=H, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(v, h, generator=g, dtype=torch.float64)).to(dtype)
    bias = (0.5 * torch.randn(v, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, bias, targets, g_lp, g_ent


def _run(fn, hidden, weight, bias, targets, g_lp, g_ent, *, dtype, train_weight, use_bias, with_entropy, **kw):
    """Forward + backward with upstream grads on both outputs; returns [logp, (entropy), grads...] in fp64."""
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_(train_weight)
    b = bias.to(dtype).requires_grad_(train_weight) if use_bias else None
    logp, ent = fn(h, w, targets, bias=b, temperature=TEMP, with_entropy=with_entropy, **kw)
    wrt = [h] + ([w] + ([b] if use_bias else []) if train_weight else [])
    loss = (logp * g_lp.to(logp.dtype)).sum()
    if with_entropy:
        loss = loss + (ent * g_ent.to(ent.dtype)).sum()
    grads = torch.autograd.grad(loss, wrt)
    return [x.detach().double() for x in (logp, *([ent] if with_entropy else []), *grads)]


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "logp_only"])
@pytest.mark.parametrize("train_weight", [True, False], ids=["trainable_head", "frozen_head"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_fp64_truth_no_worse_than_naive(dtype, use_bias, train_weight, with_entropy):
    hidden, weight, bias, targets, g_lp, g_ent = _inputs(dtype)
    common = dict(train_weight=train_weight, use_bias=use_bias, with_entropy=with_entropy)
    # Ground truth: the dense oracle in fp64 on the very same (already rounded) inputs.
    truth = _run(token_logprobs_reference, hidden, weight, bias, targets, g_lp, g_ent, dtype=torch.float64, **common)
    naive = _run(token_logprobs_reference, hidden, weight, bias, targets, g_lp, g_ent, dtype=dtype, **common)
    op = _run(token_logprobs, hidden, weight, bias, targets, g_lp, g_ent, dtype=dtype, chunk_size=CHUNK, **common)
    names = ["logp"] + (["entropy"] if with_entropy else []) + ["grad_hidden"]
    if train_weight:
        names += ["grad_weight"] + (["grad_bias"] if use_bias else [])
    assert len(names) == len(truth) == len(op)
    for name, o, nv, tr in zip(names, op, naive, truth):
        out_dtype = torch.float32 if name in ("logp", "entropy") else dtype
        scale = tr.abs().max().item()
        tol = 2 * torch.finfo(out_dtype).eps * scale
        err_op, err_naive = (o - tr).abs().max().item(), (nv - tr).abs().max().item()
        assert err_op <= err_naive + tol, f"{name}: op error {err_op:.3e} > naive {err_naive:.3e} + {tol:.1e}"
        if name in ("logp", "entropy"):  # fp32 accumulation whatever the input dtype
            assert err_op <= 1e-6 * max(scale, 1.0), f"{name}: op error {err_op:.3e} is not fp32-accurate"


def test_entropy_only_and_logp_only_upstream_grads():
    """Each output's gradient alone (the other output unused) on both the trainable and frozen paths."""
    hidden, weight, bias, targets, _, _ = _inputs(torch.float64)
    for train_weight in (True, False):
        for which in (0, 1):
            outs = []
            for fn in (token_logprobs_reference, lambda *a, **k: token_logprobs(*a, chunk_size=CHUNK, **k)):
                h = hidden.clone().requires_grad_()
                w = weight.clone().requires_grad_(train_weight)
                res = fn(h, w, targets, bias=bias, temperature=TEMP, with_entropy=True)
                wrt = [h, w] if train_weight else [h]
                outs.append(torch.autograd.grad(res[which].square().sum(), wrt))
            for a, b in zip(*outs):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_frozen_head_strategies_agree(monkeypatch):
    """Frozen head, logp only: grad_hidden formed in the forward equals the recompute-in-backward one."""
    hidden, weight, bias, targets, g_lp, _ = _inputs(torch.float64)
    grads = []
    for precompute in (True, False):
        monkeypatch.setattr(chunked, "PRECOMPUTE_FROZEN_GRAD", precompute)
        h = hidden.clone().requires_grad_()
        logp, _ = token_logprobs(h, weight, targets, bias=bias, temperature=TEMP, chunk_size=CHUNK)
        (logp * g_lp).sum().backward()
        grads.append(h.grad)
    dense = _run(token_logprobs_reference, hidden, weight, bias, targets, g_lp, None, dtype=torch.float64,
                 train_weight=False, use_bias=True, with_entropy=False)[1]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grads[0], dense, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "logp_only"])
@pytest.mark.parametrize("train_weight", [True, False], ids=["trainable_head", "frozen_head"])
def test_gradcheck_fp64(train_weight, with_entropy):
    hidden, weight, bias, targets, _, _ = _inputs(torch.float64, n=5, h=4, v=13, seed=1)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(train_weight)
    b = bias.clone().requires_grad_(train_weight)

    def f(h, w, b):
        logp, ent = token_logprobs(h, w, targets, bias=b, temperature=0.8, with_entropy=with_entropy, chunk_size=2)
        return (logp, ent) if with_entropy else logp

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_default_chunk_size_is_bounded_and_independent_of_n():
    for v in (1009, 32_000, 151_665, 50_000_000):
        for device, budget in (("cpu", CHUNK_ELEMENTS), ("cuda", CHUNK_ELEMENTS_CUDA)):
            c = default_chunk_size(v, device)
            assert 1 <= c <= 4096 and (c * v <= budget or c == 1)
    assert default_chunk_size(151_665) == 96 and default_chunk_size(151_665, "cuda") == 880


def test_empty_batch():
    weight = torch.randn(V, H, requires_grad=True)
    bias = torch.randn(V, requires_grad=True)
    hidden = torch.randn(0, H, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.long)
    logp, ent = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,) and logp.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, H)
    assert torch.count_nonzero(weight.grad) == 0 and torch.count_nonzero(bias.grad) == 0
    with torch.no_grad():
        logp, ent = token_logprobs(hidden, weight, targets)
    assert logp.shape == (0,) and ent is None


def test_no_grad_path_saves_nothing_and_matches():
    hidden, weight, bias, targets, _, _ = _inputs(torch.float32)
    hidden.requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch.no_grad():
            lp1, e1 = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, chunk_size=CHUNK)
        lp2, e2 = token_logprobs(hidden.detach(), weight, targets, bias=bias, with_entropy=True, chunk_size=CHUNK)
    assert packed == []
    assert lp1.grad_fn is None and e1.grad_fn is None and not lp2.requires_grad
    lp3, e3 = token_logprobs_reference(hidden.detach().double(), weight.double(), targets, bias=bias.double(),
                                       with_entropy=True)
    torch.testing.assert_close(lp1.double(), lp3, rtol=0, atol=1e-5)
    torch.testing.assert_close(e1.double(), e3, rtol=0, atol=1e-5)
    assert torch.equal(lp1, lp2) and torch.equal(e1, e2)


def test_non_contiguous_inputs():
    hidden, weight, bias, targets, g_lp, _ = _inputs(torch.float32)
    h_big = torch.zeros(N, 2 * H)
    h_big[:, ::2] = hidden
    h_nc = h_big[:, ::2]  # strided columns
    w_nc = weight.t().contiguous().t()  # [V, H] with transposed strides
    b_big = torch.zeros(2 * V)
    b_big[::2] = bias
    b_nc = b_big[::2]
    t_big = torch.zeros(2 * N, dtype=torch.long)
    t_big[::2] = targets
    t_nc = t_big[::2]
    assert not (h_nc.is_contiguous() or w_nc.is_contiguous() or b_nc.is_contiguous() or t_nc.is_contiguous())

    def grads(h, w, b, t):
        h, w, b = (x.detach().requires_grad_() for x in (h, w, b))
        logp, ent = token_logprobs(h, w, t, bias=b, temperature=TEMP, with_entropy=True, chunk_size=CHUNK)
        torch.autograd.backward([logp, ent], [g_lp.float(), g_lp.flip(0).float()])
        return logp, ent, h.grad, w.grad, b.grad

    for a, b in zip(grads(h_nc, w_nc, b_nc, t_nc), grads(hidden, weight, bias, targets)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backends_and_dispatch():
    hidden, weight, bias, targets, _, _ = _inputs(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" on CPU falls back to chunked silently
        auto = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True)
    dense = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, backend="reference")
    chunk = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, backend="chunked", chunk_size=5)
    for a, b, c in zip(auto, dense, chunk):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"backend='triton'.*cpu"):
        token_logprobs(hidden, weight, targets, backend="triton")
    assert logitless.token_logprobs is token_logprobs


def _bad_cases():
    h, w, b = torch.randn(4, 3), torch.randn(7, 3), torch.randn(7)
    t = torch.tensor([0, 1, 2, 6])
    cases = [
        ("hidden must be 2-D.*\\(4, 1, 3\\)", ValueError, dict(hidden=h[:, None])),
        ("weight must be 2-D.*\\(21,\\)", ValueError, dict(weight=w.flatten())),
        ("targets must be 1-D.*\\(4, 1\\)", ValueError, dict(targets=t[:, None])),
        ("weight shape \\(3, 7\\).*expected weight \\[V, 3\\]", ValueError, dict(weight=w.t())),
        ("targets shape \\(3,\\) must be \\[N\\] = \\[4\\]", ValueError, dict(targets=t[:3])),
        ("weight dtype torch.float64 must match hidden dtype torch.float32", TypeError, dict(weight=w.double())),
        ("hidden must have a floating dtype.*torch.int64", TypeError,
         dict(hidden=h.long(), weight=w.long())),
        ("targets must be an integer.*torch.float32", TypeError, dict(targets=t.float())),
        ("targets must be an integer.*torch.bool", TypeError, dict(targets=t > 0)),
        ("targets must be token ids in \\[0, V\\) = \\[0, 7\\), got a value 7", ValueError,
         dict(targets=torch.tensor([0, 7, 1, 2]))),
        ("targets must be token ids.*got a value -100", ValueError, dict(targets=torch.tensor([0, -100, 1, 2]))),
        ("bias shape \\(6,\\) must be \\[V\\] = \\[7\\]", ValueError, dict(bias=b[:6])),
        ("bias dtype torch.float16 must match", TypeError, dict(bias=b.half())),
        ("temperature must be a finite number > 0, got 0", ValueError, dict(temperature=0.0)),
        ("temperature must be a finite number > 0, got -1", ValueError, dict(temperature=-1.0)),
        ("temperature must be a finite number > 0, got nan", ValueError, dict(temperature=float("nan"))),
        ("temperature must be a finite number > 0, got inf", ValueError, dict(temperature=float("inf"))),
        ("temperature must be a positive float, got '1'", TypeError, dict(temperature="1")),
        ("chunk_size must be a positive int.*got 0", ValueError, dict(chunk_size=0)),
        ("backend must be one of.*got 'cuda'", ValueError, dict(backend="cuda")),
        ("with_entropy must be a bool, got 1", TypeError, dict(with_entropy=1)),
        ("hidden must be a torch.Tensor, got list", TypeError, dict(hidden=[[0.0] * 3] * 4)),
        ("grad_hint shape \\(3,\\) must be \\[N\\] = \\[4\\]", ValueError, dict(grad_hint=torch.zeros(3))),
        ("grad_hint must be a floating tensor", TypeError, dict(grad_hint=torch.zeros(4, dtype=torch.long))),
        ("grad_hint must not require grad", ValueError, dict(grad_hint=torch.zeros(4, requires_grad=True))),
        ("grad_hint must be a torch.Tensor", TypeError, dict(grad_hint=[0.0] * 4)),
    ]
    meta = torch.device("meta")
    cases.append(("weight is on meta but hidden is on cpu", ValueError, dict(weight=w.to(meta))))
    cases.append(("bias is on meta but hidden is on cpu", ValueError, dict(bias=b.to(meta))))
    cases.append(("grad_hint is on meta but hidden is on cpu", ValueError, dict(grad_hint=torch.zeros(4, device=meta))))
    return [(m, e, dict(dict(hidden=h, weight=w, targets=t, bias=b), **kw)) for m, e, kw in cases]


@pytest.mark.parametrize("match,exc,kwargs", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_clear_errors(match, exc, kwargs):
    kwargs = dict(kwargs)
    args = (kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"))
    with pytest.raises(exc, match=match):
        token_logprobs(*args, **kwargs)


def test_bad_input_cases_are_otherwise_valid():
    """Control: the unmodified base case of _bad_cases runs, so each error is due to its one change."""
    _, _, kw = _bad_cases()[0]
    kw = dict(kw, hidden=torch.randn(4, 3))
    logp, _ = token_logprobs(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), **kw)
    assert logp.shape == (4,) and bool((logp < 0).all())
    assert chunked.PRECOMPUTE_FROZEN_GRAD  # the frozen-head strategy the tests above exercise by default


def test_grad_hint_is_ignored_by_the_chunked_backend():
    """A speed hint for the Triton backend only: on CPU the values and grads are those without it."""
    g = torch.Generator().manual_seed(0)
    h, w, t = torch.randn(9, 5, generator=g), torch.randn(40, 5, generator=g), torch.randint(0, 40, (9,), generator=g)
    up = torch.randn(9, generator=g)
    grads = []
    for hint in (None, up, -up):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, _ = token_logprobs(hh, ww, t, grad_hint=hint)
        (lp * up).sum().backward()
        grads.append((lp.detach(), hh.grad, ww.grad))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            assert torch.equal(a, b)
