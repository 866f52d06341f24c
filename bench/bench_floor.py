"""How far is the Triton op from the hardware floor? GEMM floors, pass bandwidth and a 3-GEMM fused head.

One process, one GPU, the same timing rule as `bench_op.py` (CUDA events, median of `--reps` after warm-up,
peak extra memory of one run). Sections, each a list of rows in the output JSON:

* "gemm": the cuBLAS GEMMs the LM head needs, alone, on preallocated buffers: the logits GEMM
  z = h·Wᵀ [N, V], grad_h = D·W and grad_W = Dᵀ·h. Their sums are the floors: forward 1 GEMM, frozen head
  2, dense trainable 3, and 4 for an exact trainable op that never stores [N, V] (it must recompute z).
* "passes": the Triton passes alone on one [N, 8192] logits tile for several (BLOCK_V, num_warps), in GB/s
  of logits read (+ written).
* "fused": the op's 3-GEMM hinted forward (`triton_op._forward_rows_hinted`), possible when the upstream
  gradient g = dL/dlogp is known before the forward (on-policy GRPO with one update per batch and no KL: the
  ratio is exactly 1, so g = -A/N): row chunks of `rows` rows, logits GEMM -> stats -> d = g·(onehot - p) in
  place -> grad_h = d·W, grad_W += dᵀ·h (fp32 or bf16 accumulator). Its accuracy vs fp64 is checked at N=4096.
* "ops": dense_bf16 (TRL's path) and the Triton op in the same process, per mode, plus both on the
  on-policy loss (old logp = logp.detach()), the fair baseline of "fused".

Usage: python bench/bench_floor.py --out DIR [--sections gemm,passes,fused,ops]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_op as B  # noqa: E402
from logitless.ops import triton_op as T  # noqa: E402
from logitless.ops.reference import token_logprobs_reference  # noqa: E402

MAIN = (32768, 2048, 151936, 8192)
ROWS = (1024, 2048, 4096)  # fused head row chunks
ACC = (4096, 2048, 151936, 256)  # accuracy check: N, H, V, rows per chunk
DEV = B.DEV  # "cpu" + TRITON_INTERPRET=1 + --tiny: smoke test of this script


def _rec(info, section, name, n, h, v, **kw):
    return dict(info, section=section, name=name, N=n, H=h, V=v, dtype="bfloat16", **kw)


def gemm_floor(info, n, h, v, args):
    g = torch.Generator(device=DEV).manual_seed(0)
    hid = torch.randn(n, h, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h, device=DEV, dtype=torch.bfloat16, generator=g) * (2.0 / h**0.5)
    z = torch.empty(n, v, device=DEV, dtype=torch.bfloat16)
    gh, gw = torch.empty_like(hid), torch.empty_like(w)
    inp = dict(hidden=hid, weight=w, bias=None)
    steps = {
        "logits z=h.Wt": lambda: torch.mm(hid, w.t(), out=z),
        "grad_h=D.W": lambda: torch.mm(z, w, out=gh),
        "grad_W=Dt.h": lambda: torch.mm(z.t(), hid, out=gw),
    }
    rows = []
    for name, fn in steps.items():
        r = B.measure(fn, inp, args.warmup, args.reps)
        r["tflops"] = 2.0 * n * h * v / (r["median_ms"] * 1e-3) / 1e12
        rows.append(_rec(info, "gemm", name, n, h, v, **r))
        print(json.dumps(rows[-1]), flush=True)
    t = [r["median_ms"] for r in rows]
    for name, ms in (("floor forward (1 GEMM)", t[0]), ("floor frozen (2 GEMMs)", t[0] + t[1]),
                     ("floor dense trainable (3 GEMMs)", sum(t)), ("floor exact no-[N,V] trainable (4 GEMMs)",
                                                                  2 * t[0] + t[1] + t[2])):
        rows.append(_rec(info, "gemm", name, n, h, v, median_ms=ms))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def passes(info, n, args):
    from logitless.ops import triton_kernels as K

    cols, v = min(8192, MAIN[2]), MAIN[2]
    g = torch.Generator(device=DEV).manual_seed(0)
    tile = (torch.randn(n, cols, device=DEV, generator=g) * 3).to(torch.bfloat16)
    tg = torch.randint(0, v, (n,), device=DEV, generator=g, dtype=torch.int32)
    lse = torch.full((n,), 12.0, device=DEV)
    zt = torch.empty(n, device=DEV)
    inp = dict(hidden=tile, weight=tile, bias=None)
    rows = []
    for block in (1024, 2048, 4096, 8192)[: 1 if DEV != "cuda" else 4]:
        parts = torch.empty(3, n, triton.cdiv(cols, block), device=DEV)
        for warps in (4, 8, 16)[: 1 if DEV != "cuda" else 3]:
            def stats():
                K.block_stats_kernel[(n, triton.cdiv(cols, block))](
                    tile, cols, cols, 1.0, tg, 0, parts, n, parts.shape[2], 0, zt,
                    WITH_ENT=True, BLOCK_V=block, num_warps=warps)

            def grad():  # in place: repeated runs see a gradient, not logits; the traffic is the same
                K.grad_tile_kernel[(n, triton.cdiv(cols, block))](
                    tile, cols, tg, lse, lse, lse, lse, 0, cols, 1.0,
                    HAS_GLP=True, HAS_GENT=False, UNIT_GLP=True, BLOCK_V=block, num_warps=warps)

            for name, fn, rw in (("block_stats", stats, 1), ("grad_tile", grad, 2)):
                r = B.measure(fn, inp, args.warmup, args.reps)
                r["gbps"] = rw * tile.numel() * 2 / (r["median_ms"] * 1e-3) / 1e9
                rows.append(_rec(info, "passes", name, n, 0, cols, block_v=block, num_warps=warps, **r))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def fused_head(hidden, weight, targets, g_lp, rows, acc_dtype=torch.float32):
    """(logp [N], grad_h [N, H], grad_W [V, H]) of sum(g_lp · logp): the op's hinted forward (3 GEMMs) with
    chunks of exactly `rows` rows and grad_W accumulated in `acc_dtype`."""
    saved = T.HINT_ROW_BYTES, T.HINT_MAX_CHUNKS, T.HINT_FP32_ACCUMULATE
    T.HINT_ROW_BYTES = rows * weight.shape[0] * weight.element_size()
    T.HINT_MAX_CHUNKS = max(1, hidden.shape[0])  # no chunk-count floor on `rows`
    T.HINT_FP32_ACCUMULATE = acc_dtype == torch.float32
    try:
        _, logp, _, grad_h, grad_w, _ = T._forward_rows_hinted(hidden, weight, None, targets, 1.0, False, g_lp,
                                                               True, True, False)
    finally:
        T.HINT_ROW_BYTES, T.HINT_MAX_CHUNKS, T.HINT_FP32_ACCUMULATE = saved
    return logp, grad_h, grad_w


def fused(info, args):
    rows_out = []
    # accuracy at N=4096 (16 chunks of 256 rows) vs fp64, next to the Triton op's
    n, h, v, acc_rows = ACC
    g = torch.Generator(device=DEV).manual_seed(1)
    hid = torch.randn(n, h, device=DEV, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(v, h, device=DEV, dtype=torch.bfloat16, generator=g) * (2.0 / h**0.5)).to(torch.bfloat16)
    tg = torch.randint(0, v, (n,), device=DEV, generator=g, dtype=torch.int32)
    g_lp = torch.randn(n, device=DEV, generator=g) / n
    h64, w64 = hid.double().requires_grad_(), w.double().requires_grad_()
    lp64, _ = token_logprobs_reference(h64, w64, tg, bias=None, temperature=1.0, with_entropy=False)
    (lp64 * g_lp.double()).sum().backward()
    err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    for acc in (torch.float32, torch.bfloat16):
        lp, gh, gw = fused_head(hid, w, tg, g_lp, acc_rows, acc)
        rows_out.append(_rec(info, "fused_accuracy", f"fused acc={acc}", n, h, v, rows=acc_rows,
                             logp=err(lp, lp64.detach()), dh=err(gh, h64.grad), dw=err(gw, w64.grad)))
        print(json.dumps(rows_out[-1]), flush=True)
    hl, wl = hid.clone().requires_grad_(), w.clone().requires_grad_()
    lp, _ = T.triton_token_logprobs(hl, wl, tg, None, 1.0, False)
    (lp * g_lp).sum().backward()
    rows_out.append(_rec(info, "fused_accuracy", "triton op", n, h, v, logp=err(lp.detach(), lp64.detach()),
                         dh=err(hl.grad, h64.grad), dw=err(wl.grad, w64.grad)))
    print(json.dumps(rows_out[-1]), flush=True)
    del h64, w64, lp64, hl, wl
    torch.cuda.empty_cache()

    n, h, v, seq = MAIN
    inp = B.make_inputs(n, h, v, seq, 1.0, False)
    hid, w, tg = inp["hidden"], inp["weight"], inp["targets"]
    hid.requires_grad_(True)
    w.requires_grad_(True)
    g_on = -inp["adv"] / n  # d loss / d logp of the DAPO clipped surrogate at ratio 1
    for rows in ROWS:
        for acc in (torch.float32, torch.bfloat16):
            def step():
                _, gh, gw = fused_head(hid.detach(), w.detach(), tg, g_on, rows, acc)
                hid.grad, w.grad = gh, gw
            r = B.measure(step, inp, args.warmup, args.reps)
            rows_out.append(_rec(info, "fused", f"fused rows={rows} acc={acc}", n, h, v, rows=rows, **r))
            print(json.dumps(rows_out[-1]), flush=True)
    B.clear_grads(inp)
    return rows_out


def ops(info, args):
    n, h, v, seq = MAIN
    inp = B.make_inputs(n, h, v, seq, 1.0, False)
    rows = []
    for mode in ("trainable", "frozen", "forward"):
        for variant in ("dense_bf16", "triton"):
            r = B.measure(B.make_step(variant, mode, inp), inp, args.warmup, args.reps)
            rows.append(_rec(info, "ops", f"{variant} {mode}", n, h, v, **r))
            print(json.dumps(rows[-1]), flush=True)
    for variant in ("dense_bf16", "triton"):  # on-policy loss (old logp = logp.detach()), trainable head
        B.make_step(variant, "trainable", inp)  # sets requires_grad
        hid, w, tg = inp["hidden"], inp["weight"], inp["targets"]

        def step():
            if variant == "dense_bf16":
                lp, _ = B.dense_bf16(hid, w, tg, None, 1.0, False, seq)
            else:
                lp, _ = B._token_logprobs(hid, w, tg, None, 1.0, False, "triton")
            B.grpo_loss(lp, lp.detach(), inp["adv"]).backward()
        r = B.measure(step, inp, args.warmup, args.reps)
        rows.append(_rec(info, "ops", f"{variant} trainable on-policy", n, h, v, **r))
        print(json.dumps(rows[-1]), flush=True)
    B.clear_grads(inp)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="gemm,passes,fused,ops")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--tag", default="bench_floor")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args()
    global MAIN, ACC, ROWS
    if args.tiny:
        MAIN, ACC, ROWS = (256, 32, 1003, 64), (64, 32, 1003, 16), (64, 128)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = B.env_info()
    result = dict(info=info, what=__doc__, rows=[])
    n, h, v, _ = MAIN
    for sec in args.sections.split(","):
        fn = {"gemm": lambda: gemm_floor(info, n, h, v, args), "passes": lambda: passes(info, n, args),
              "fused": lambda: fused(info, args), "ops": lambda: ops(info, args)}[sec]
        result["rows"] += fn()
        torch.cuda.empty_cache()  # the section's buffers died with its function
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    for r in result["rows"]:
        extra = f" {r['peak_extra_gib']:.2f} GiB" if "peak_extra_gib" in r else ""
        if "median_ms" in r:
            print(f"{r['section']:<7} {r['name']:<45} {r.get('block_v', ''):>5} {r.get('num_warps', ''):>3} "
                  f"{r['median_ms']:8.2f} ms{extra} {r.get('gbps', r.get('tflops', 0)) or 0:8.0f}")


if __name__ == "__main__":
    main()
