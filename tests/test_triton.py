"""CPU tests of the Triton backend (logitless.ops.triton_op) under TRITON_INTERPRET=1 on tiny shapes.

Triton decides at kernel-definition time whether to interpret, so the cases run in ONE subprocess with
TRITON_INTERPRET=1 set before triton is imported (this pytest process, and GPU tests in it, stay unaffected).
The subprocess returns relative errors vs a float64 dense oracle; each test below asserts on one case.

Tile sizes are shrunk so that the tiny shapes still cross several ragged column tiles / row chunks.
Note: the interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest), so exact-precision
claims are checked in fp32 here and bf16 only loosely; the GPU test checks bf16 against dense torch.
"""

from __future__ import annotations

import json

import pytest

from tests.interpret import patch_interpreter, run_cases

pytest.importorskip("triton")


def _run_cases() -> dict:
    """Executed inside the TRITON_INTERPRET=1 subprocess; returns {case: {metric: value}}."""
    import torch

    patch_interpreter()
    from logitless.ops import triton_op
    from logitless.ops.reference import token_logprobs_reference

    def rel(a, b):
        a, b = a.double(), b.double()
        return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

    def run(fn, h, w, b, tg, temp, ent, need, g_lp, g_ent):
        h = h.detach().clone().requires_grad_(need[0])
        w = w.detach().clone().requires_grad_(need[1])
        b = None if b is None else b.detach().clone().requires_grad_(need[2])
        lp, e = fn(h, w, tg, b, temp, ent)
        loss = 0
        if g_lp is not None:
            loss = loss + (lp.double() * g_lp).sum()
        if g_ent is not None:
            loss = loss + (e.double() * g_ent).sum()
        loss.backward()
        return dict(logp=lp, ent=e, dh=h.grad, dw=w.grad, db=None if b is None else b.grad)

    def ours(h, w, tg, b, temp, ent):
        return triton_op.triton_token_logprobs(h, w, tg, b, temp, ent)

    def dense(h, w, tg, b, temp, ent):
        return token_logprobs_reference(h, w, tg, bias=b, temperature=temp, with_entropy=ent)

    def case(n, h_, v, *, dtype=torch.float32, bias=True, temp=0.7, ent=True, need=(True, True, True),
             use_lp=True, use_ent=True, tile_cols=128, chunk_rows=8, seed=0, targets_dtype=torch.int64):
        triton_op.TILE_BYTES = tile_cols * max(n, 1) * torch.tensor([], dtype=dtype).element_size()
        triton_op.ROW_CHUNK_BYTES = chunk_rows * v * torch.tensor([], dtype=dtype).element_size()
        g = torch.Generator().manual_seed(seed)
        hid = torch.randn(n, h_, generator=g).to(dtype)
        w = (torch.randn(v, h_, generator=g) * 2 / h_**0.5).to(dtype)
        b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
        tg = torch.randint(0, v, (n,), generator=g)
        if n >= 3:  # targets on the first column, the last column and a tile edge
            tg[0], tg[1], tg[2] = 0, v - 1, min(tile_cols, v - 1)
        tg = tg.to(targets_dtype)
        g_lp = torch.randn(n, generator=g, dtype=torch.float64) if use_lp else None
        g_ent = torch.randn(n, generator=g, dtype=torch.float64) if (ent and use_ent) else None
        up = lambda t: None if t is None else t.double()  # noqa: E731
        ref = run(dense, up(hid), up(w), up(b), tg.long(), temp, ent, need, g_lp, g_ent)
        got = run(ours, hid, w, b, tg, temp, ent, need, g_lp, g_ent)
        out = {}
        if dtype != torch.float32:
            low = run(dense, hid, w, b, tg.long(), temp, ent, need, g_lp, g_ent)
        for k, r in ref.items():
            if r is None:
                out[k + "_is_none"] = got[k] is None
                continue
            if got[k] is None:
                out[k] = float("inf")
                continue
            out[k] = rel(got[k], r) if n else 0.0
            out[k + "_shape_ok"] = tuple(got[k].shape) == tuple(r.shape)
            out[k + "_finite"] = bool(torch.isfinite(got[k]).all())
            if dtype != torch.float32:
                out[k + "_dense"] = rel(low[k], r)
        out["logp_dtype_fp32"] = got["logp"].dtype == torch.float32
        return out

    res = {
        "fp32_trainable_entropy_bias_temp": case(37, 16, 301),
        "fp32_frozen_entropy_grad": case(37, 16, 301, need=(True, False, False)),
        "fp32_frozen_entropy_unused": case(37, 16, 301, need=(True, False, False), use_ent=False, bias=False),
        "fp32_frozen_entropy_only": case(21, 16, 301, need=(True, False, False), use_lp=False, temp=1.0),
        "fp32_bias_trainable_weight_frozen": case(29, 16, 257, need=(True, False, True), ent=False),
        "fp32_weight_only_int32_targets": case(29, 16, 300, need=(False, True, False), bias=False,
                                              targets_dtype=torch.int32, tile_cols=256),
        "fp32_one_tile": case(17, 8, 100, tile_cols=4096, chunk_rows=4096, need=(True, False, False)),
        "bf16_trainable_entropy": case(48, 32, 517, dtype=torch.bfloat16, seed=1),
        "bf16_frozen_entropy": case(48, 32, 517, dtype=torch.bfloat16, need=(True, False, False), seed=2),
        "empty_trainable": case(0, 16, 301),
        "empty_frozen": case(0, 16, 301, need=(True, False, False)),
    }

    # a -inf bias masks vocabulary columns (here a whole tile): same as dropping those columns
    g = torch.Generator().manual_seed(5)
    n, h_, v, cut = 31, 16, 301, 150
    hid = torch.randn(n, h_, generator=g)
    w = torch.randn(v, h_, generator=g) / 4
    b = torch.randn(v, generator=g)
    b[:cut] = float("-inf")
    tg = torch.randint(cut, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, dtype=torch.float64, generator=g), torch.randn(n, dtype=torch.float64, generator=g)
    masked = {}
    for frozen in (False, True):
        triton_op.TILE_BYTES, triton_op.ROW_CHUNK_BYTES = 128 * n * 4, 8 * v * 4
        need = (True, not frozen, False)
        got = run(ours, hid, w, b, tg, 0.9, True, need, g_lp, g_ent)
        ref = run(dense, hid.double(), w[cut:].double(), b[cut:].double(), tg - cut, 0.9, True, need, g_lp, g_ent)
        masked[f"frozen{int(frozen)}_logp"] = rel(got["logp"], ref["logp"])
        masked[f"frozen{int(frozen)}_ent"] = rel(got["ent"], ref["ent"])
        masked[f"frozen{int(frozen)}_dh"] = rel(got["dh"], ref["dh"])
        if not frozen:
            masked["dw_kept"] = rel(got["dw"][cut:], ref["dw"])
            masked["dw_masked_zero"] = float(got["dw"][:cut].abs().max())
    res["masked_vocab"] = masked

    # strided (non-contiguous) hidden, bias and int32 targets give the same result as contiguous ones
    g = torch.Generator().manual_seed(6)
    n, h_, v = 19, 16, 300
    hid_t = torch.randn(h_, n, generator=g).t()  # [N, H], non-contiguous
    w = torch.randn(v, h_, generator=g) / 4
    b2 = torch.randn(2 * v, generator=g)[::2]  # [V], stride 2
    tg2 = torch.randint(0, v, (2 * n,), generator=g).to(torch.int32)[::2]  # [N], stride 2
    g_lp, g_ent = torch.randn(n, dtype=torch.float64, generator=g), torch.randn(n, dtype=torch.float64, generator=g)
    triton_op.TILE_BYTES = 128 * n * 4
    got = run(ours, hid_t, w, b2, tg2, 1.1, True, (True, True, True), g_lp, g_ent)
    ref = run(dense, hid_t.double(), w.double(), b2.double(), tg2.long(), 1.1, True, (True, True, True), g_lp, g_ent)
    res["strided_inputs"] = {k: rel(got[k], ref[k]) for k in ref}

    # no grad: nothing saved, no graph, same values as with grad
    torch.manual_seed(3)
    h, w, tg = torch.randn(23, 16), torch.randn(260, 16) / 4, torch.randint(0, 260, (23,))
    triton_op.TILE_BYTES = 128 * 23 * 4
    with torch.no_grad():
        lp, e = triton_op.triton_token_logprobs(h.requires_grad_(), w, tg, None, 1.3, True)
    rl, re = token_logprobs_reference(h.detach().double(), w.double(), tg, temperature=1.3, with_entropy=True)
    res["no_grad"] = dict(logp=rel(lp, rl), ent=rel(e, re), no_graph=lp.grad_fn is None and e.grad_fn is None)
    lp2, e2 = triton_op.triton_token_logprobs(h.detach(), w, tg, None, 1.3, False)
    res["no_input_requires_grad"] = dict(logp=rel(lp2, rl), no_graph=lp2.grad_fn is None, ent_none=e2 is None)

    # gradient hint (trainable head): the forward forms the grads in row chunks (3 GEMMs); backward hands them
    # over only when its upstream equals the hint, else recomputes. Counters show which path ran.
    calls = {}

    def counted(name):
        fn = getattr(triton_op, name)

        def wrapper(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)
        setattr(triton_op, name, wrapper)

    for name in ("_forward_rows_hinted", "_backward_tiles", "_forward_rows_frozen", "_logits"):
        counted(name)

    def hint_case(n, h_, v, *, dtype=torch.float32, need=(True, True, True), hint="same", ent_grad=False,
                  rows=8, max_chunks=16, seed=7, temp=0.8, acc32=False):
        triton_op.TILE_BYTES = 128 * n * torch.tensor([], dtype=dtype).element_size()
        triton_op.HINT_ROW_BYTES = rows * v * torch.tensor([], dtype=dtype).element_size()
        triton_op.HINT_MAX_CHUNKS = max_chunks
        triton_op.HINT_FP32_ACCUMULATE = acc32
        g = torch.Generator().manual_seed(seed)
        hid = torch.randn(n, h_, generator=g).to(dtype)
        w = (torch.randn(v, h_, generator=g) * 2 / h_**0.5).to(dtype)
        b = (torch.randn(v, generator=g) * 0.5).to(dtype)
        tg = torch.randint(0, v, (n,), generator=g)
        g_lp = torch.randn(n, generator=g, dtype=torch.float64)
        g_ent = torch.randn(n, generator=g, dtype=torch.float64) if ent_grad else None
        hint_t = g_lp.float() if hint == "same" else g_lp.float() + 1e-3 * torch.randn(n, generator=g)
        up = lambda t: t.double()  # noqa: E731
        ref = run(dense, up(hid), up(w), up(b), tg, temp, True, need, g_lp, g_ent)
        calls.clear()
        hinted = lambda h, w, tg, b, temp, ent: triton_op.triton_token_logprobs(h, w, tg, b, temp, ent, hint_t)  # noqa: E731
        got = run(hinted, hid, w, b, tg, temp, True, need, g_lp, g_ent)
        out = {k: (rel(got[k], r) if got[k] is not None else float("inf")) for k, r in ref.items() if r is not None}
        out.update({f"none_{k}": got[k] is None for k, r in ref.items() if r is None})
        out["calls"] = dict(calls)
        if dtype != torch.float32:
            low = run(dense, hid, w, b, tg, temp, True, need, g_lp, g_ent)
            out.update({k + "_dense": rel(low[k], ref[k]) for k in ref if ref[k] is not None})
        return out

    res["hint_used"] = hint_case(37, 16, 301)
    res["hint_used_max_chunks"] = hint_case(37, 16, 301, max_chunks=2)
    res["hint_weight_and_bias_only"] = hint_case(29, 16, 257, need=(False, True, True))
    res["hint_mismatch_recomputes"] = hint_case(37, 16, 301, hint="other")
    res["hint_entropy_grad_recomputes"] = hint_case(37, 16, 301, ent_grad=True)
    res["hint_frozen_ignored"] = hint_case(37, 16, 301, need=(True, False, False))
    res["hint_bf16"] = hint_case(48, 32, 517, dtype=torch.bfloat16, rows=4)
    res["hint_bf16_acc32"] = hint_case(48, 32, 517, dtype=torch.bfloat16, rows=4, acc32=True)
    triton_op.HINT_FP32_ACCUMULATE = False
    # a second backward (retain_graph) recomputes: the hinted grads are handed over once
    h3 = torch.randn(9, 16).requires_grad_()
    w3 = (torch.randn(260, 16) / 4).requires_grad_()
    tg3, g3 = torch.randint(0, 260, (9,)), torch.randn(9)
    lp4, _ = triton_op.triton_token_logprobs(h3, w3, tg3, None, 1.0, False, g3)
    calls.clear()
    (lp4 * g3).sum().backward(retain_graph=True)
    dw1 = w3.grad.clone()
    (lp4 * g3).sum().backward()
    res["hint_second_backward"] = dict(rel=rel(w3.grad, 2 * dw1), calls=dict(calls))

    # frozen path scales its saved partial gradient in place: a second backward must fail loudly
    h2 = torch.randn(9, 16).requires_grad_()
    lp3, _ = triton_op.triton_token_logprobs(h2, w, tg[:9], None, 1.0, False)
    lp3.sum().backward(retain_graph=True)
    try:
        lp3.sum().backward()
        res["frozen_double_backward"] = dict(raised=False)
    except RuntimeError as exc:
        res["frozen_double_backward"] = dict(raised="modified by an inplace operation" in str(exc))
    return res


@pytest.fixture(scope="module")
def cases() -> dict:
    return run_cases(__file__)


FP32 = [
    "fp32_trainable_entropy_bias_temp",
    "fp32_frozen_entropy_grad",
    "fp32_frozen_entropy_unused",
    "fp32_frozen_entropy_only",
    "fp32_bias_trainable_weight_frozen",
    "fp32_weight_only_int32_targets",
    "fp32_one_tile",
]


@pytest.mark.parametrize("name", FP32)
def test_fp32_matches_fp64_oracle(cases, name):
    c = cases[name]
    errs = {k: v for k, v in c.items() if k in ("logp", "ent", "dh", "dw", "db")}
    assert errs, c
    for k, v in errs.items():
        assert v < 2e-5, f"{name}: {k} relative error {v:.3g}"
        assert c[k + "_shape_ok"] and c[k + "_finite"], (name, k, c)
    for k, v in c.items():
        if k.endswith("_is_none"):
            assert v, f"{name}: {k[:-8]} should get no gradient"
    assert c["logp_dtype_fp32"]


@pytest.mark.parametrize("name", ["bf16_trainable_entropy", "bf16_frozen_entropy"])
def test_bf16_close_to_dense_bf16(cases, name):
    # loose: the interpreter truncates fp32 -> bf16 where a GPU rounds (see module docstring)
    c = cases[name]
    for k in ("logp", "ent", "dh", "dw", "db"):
        if k in c:
            assert c[k + "_finite"], (name, k)
            assert c[k] < 3 * c[k + "_dense"] + 2e-3, f"{name}: {k} err {c[k]:.3g} vs dense bf16 {c[k + '_dense']:.3g}"


@pytest.mark.parametrize("name", ["empty_trainable", "empty_frozen"])
def test_empty_batch(cases, name):
    c = cases[name]
    assert c["logp_shape_ok"] and c["ent_shape_ok"] and c["dh_shape_ok"]
    assert c.get("dw_shape_ok", c.get("dw_is_none"))


def test_no_grad_paths(cases):
    a, b = cases["no_grad"], cases["no_input_requires_grad"]
    assert a["logp"] < 2e-5 and a["ent"] < 2e-5 and a["no_graph"]
    assert b["logp"] < 2e-5 and b["no_graph"] and b["ent_none"]


def test_masked_vocabulary_bias(cases):
    c = cases["masked_vocab"]
    assert c.pop("dw_masked_zero") == 0.0
    for k, v in c.items():
        assert v < 2e-5, f"masked vocabulary: {k} relative error {v:.3g}"


def test_strided_inputs(cases):
    for k, v in cases["strided_inputs"].items():
        assert v < 2e-5, f"strided inputs: {k} relative error {v:.3g}"


@pytest.mark.parametrize("name", ["hint_used", "hint_used_max_chunks", "hint_weight_and_bias_only"])
def test_grad_hint_forms_exact_grads_in_the_forward(cases, name):
    c = cases[name]
    for k in ("logp", "ent", "dh", "dw", "db"):
        if k in c:
            assert c[k] < 2e-5, f"{name}: {k} relative error {c[k]:.3g}"
    assert c["calls"].get("_forward_rows_hinted") == 1 and "_backward_tiles" not in c["calls"], c["calls"]
    n_chunks = {"hint_used": 5, "hint_used_max_chunks": 2, "hint_weight_and_bias_only": 4}[name]  # ceil(N / rows)
    assert c["calls"]["_logits"] == n_chunks, c["calls"]
    if name == "hint_weight_and_bias_only":
        assert c["none_dh"]


@pytest.mark.parametrize("name", ["hint_mismatch_recomputes", "hint_entropy_grad_recomputes"])
def test_grad_hint_never_changes_the_result(cases, name):
    c = cases[name]
    for k in ("logp", "ent", "dh", "dw", "db"):
        assert c[k] < 2e-5, f"{name}: {k} relative error {c[k]:.3g}"
    assert c["calls"].get("_forward_rows_hinted") == 1 and c["calls"].get("_backward_tiles") == 1, c["calls"]


def test_grad_hint_ignored_for_frozen_head(cases):
    c = cases["hint_frozen_ignored"]
    assert c["logp"] < 2e-5 and c["dh"] < 2e-5 and c["none_dw"] and c["none_db"]
    assert "_forward_rows_hinted" not in c["calls"] and c["calls"].get("_forward_rows_frozen") == 1, c["calls"]


def test_grad_hint_bf16_close_to_dense_bf16(cases):
    c = cases["hint_bf16"]  # loose, as test_bf16_close_to_dense_bf16
    for k in ("logp", "ent", "dh", "dw", "db"):
        assert c[k] < 3 * c[k + "_dense"] + 2e-3, f"{k} err {c[k]:.3g} vs dense bf16 {c[k + '_dense']:.3g}"


def test_grad_hint_fp32_accumulation_is_more_accurate(cases):
    bf16_acc, fp32_acc = cases["hint_bf16"], cases["hint_bf16_acc32"]  # 12 row chunks
    assert fp32_acc["calls"].get("_forward_rows_hinted") == 1 and "_backward_tiles" not in fp32_acc["calls"]
    assert fp32_acc["dw"] < bf16_acc["dw"], (fp32_acc["dw"], bf16_acc["dw"])
    assert fp32_acc["dw"] < 3 * fp32_acc["dw_dense"] + 2e-3
    for k in ("logp", "dh", "db"):
        assert fp32_acc[k] == bf16_acc[k], k  # only the weight gradient's accumulation differs


def test_grad_hint_second_backward_recomputes(cases):
    c = cases["hint_second_backward"]
    assert c["rel"] < 2e-5 and c["calls"].get("_backward_tiles") == 1, c


def test_frozen_double_backward_fails_loudly(cases):
    assert cases["frozen_double_backward"]["raised"]


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
