"""Can a split-K Triton GEMM beat cuBLAS on the decode step's projections? y = x @ W^T at the decode's shapes.

The Qwen2.5-1.5B shape's projections (fused q/k/v, output, fused gate/up, down) at `--rows` rows, as the trainer's
decode runs them: each timed as 28 calls on 28 different weights (one per layer, so the weights stream from HBM
as in the decode, not from L2) in one CUDA graph, median of 10 replays. cuBLAS is `torch.nn.functional.linear`;
the Triton kernel below splits K over programs and adds the partial products with fp32 atomics into a zeroed
buffer (the zero fill and the cast back to bf16 are inside the timed graph). Every configuration is checked
against an fp32 product first. An experiment: the library keeps cuBLAS unless this shows a clear win.

    python bench/tune_decode_gemm.py --out DIR [--rows 128 512]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.graph_timing import time_graph  # noqa: E402

LAYERS = 28
SHAPES = {"qkv": (2048, 1536), "o_proj": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}  # (N, K)


@triton.jit
def _splitk_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile: W's rows are the dot's M (wgmma wants >= 64)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ok = k0 + tl.arange(0, BLOCK_K)
        kin = ok < k_hi
        w = tl.load(W + on[:, None] * stride_wn + ok[None, :], mask=(on[:, None] < N) & kin[None, :], other=0.0)
        x = tl.load(X + om[:, None] * stride_xm + ok[None, :], mask=(om[:, None] < M) & kin[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    ptr = Y + om[None, :] * stride_ym + on[:, None]
    msk = (om[None, :] < M) & (on[:, None] < N)
    if ATOMIC:
        tl.atomic_add(ptr, acc, mask=msk, sem="relaxed")
    else:
        tl.store(ptr, acc.to(Y.dtype.element_ty), mask=msk)


def splitk_linear(x, w, block_m, block_n, block_k, split, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, per)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    if split == 1:
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        _splitk_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), per, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=False, num_warps=warps, num_stages=stages)
        return y
    y = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    _splitk_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), per, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=True, num_warps=warps, num_stages=stages)
    return y.to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, summary = [], {}
    t_start = time.perf_counter()
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5 for _ in range(LAYERS)]
        for rows in a.rows:
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ ws[0].float().T
            bytes_ = N * K * 2
            cublas = time_graph(lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws], LAYERS)
            best = None
            for bm, bn, bk, split, warps, stages in itertools.product(
                    sorted({min(rows, 128), 64}), (64, 128), (64, 128), (1, 2, 4, 8), (4, 8), (3, 4)):
                cfg = dict(block_m=bm, block_n=bn, block_k=bk, split=split, warps=warps, stages=stages)
                try:
                    err = float((splitk_linear(x, ws[0], **cfg).float() - ref).abs().max())
                    us = time_graph(lambda x=x, ws=ws, cfg=cfg: [splitk_linear(x, w, **cfg) for w in ws], LAYERS)
                except Exception as e:  # shared memory or register limits
                    results.append({"shape": name, "rows": rows, **cfg, "error": str(e)[:160]})
                    continue
                row = {"shape": name, "rows": rows, **cfg, "us": us, "max_err": err, "tb_s": bytes_ / us / 1e6}
                results.append(row)
                if err < 0.05 and (best is None or us < best["us"]):
                    best = row
            summary[f"{name}_{rows}"] = {"N": N, "K": K, "cublas_us": cublas, "cublas_tb_s": bytes_ / cublas / 1e6,
                                         "triton_best": best, "speedup": cublas / best["us"] if best else None}
            print(json.dumps({f"{name}_{rows}": summary[f"{name}_{rows}"]}), flush=True)
        del ws
        torch.cuda.empty_cache()
    out = {"info": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "commit": a.commit, "date": time.strftime("%Y-%m-%d")},
           "workload": f"y = x @ W^T, bf16, {LAYERS} weights per shape in one CUDA graph, rows {a.rows}",
           "seconds": time.perf_counter() - t_start, "summary": summary, "all": results}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "tune_decode_gemm.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
