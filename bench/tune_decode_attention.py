"""Launch configurations of the flash-decoding kernel (`logitless/ops/triton_decode.py`) at the decode's shapes.

The Qwen2.5-1.5B shape's attention (2 KV heads of 6 query heads, head dim 128) over a static cache of 1,152 slots
(prompts up to 128 tokens, left-padded, plus 1,024 new tokens), at `--rows` rows, at three points of the decode
(t = 128, 512 and 896 tokens written). Each measurement replays one CUDA graph of 28 calls, one per layer, each
on its own layer's cache (so the caches stream from HBM as in the decode, not from L2), and reports microseconds
per call and the visible keys' and values' bytes per second. Every configuration is checked against the fp32
oracle first. Splits > 1 include their combine as eager torch ops (in the compiled decode step inductor fuses
them into one kernel); `combine_us` is that eager combine alone, to subtract.

    python bench/tune_decode_attention.py --out DIR [--rows 128 512] [--scan]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.graph_timing import time_graph  # noqa: E402
from logitless.ops import triton_decode as td  # noqa: E402

LAYERS, KV, G, D, P, NEW = 28, 2, 6, 128, 128, 1024
POINTS = (128, 512, 896)


def setup(rows: int, gen: torch.Generator):
    L = P + NEW
    caches = [(torch.randn(rows, KV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen),
               torch.randn(rows, KV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)) for _ in range(LAYERS)]
    q = torch.randn(rows, KV, G, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    plen = torch.randint(40, P + 1, (rows,), device="cuda", generator=gen)
    return caches, q, plen


def mask_at(plen: torch.Tensor, t: int, L: int) -> torch.Tensor:
    """[rows, L] bool: the left-padded prompt and the t + 1 slots written so far."""
    j = torch.arange(L, device=plen.device)
    return ((j[None] >= P - plen[:, None]) & (j[None] < P)) | ((j[None] >= P) & (j[None] <= P + t))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--scan", action="store_true",
                    help="sweep the mask scan's block (BLOCK_SCAN) over a few launch configurations instead")
    a = ap.parse_args()
    td.set_sm_count(torch.device("cuda"))
    hbm = 4.8e12
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in a.rows:
        caches, q, plen = setup(rows, gen)
        L = P + NEW
        masks = {t: mask_at(plen, t, L) for t in POINTS}
        ref = td.decode_attention_reference(q, *caches[0], masks[512], D**-0.5).float()
        default_splits = td.num_splits(rows * KV, L)
        if a.scan:
            configs = list(itertools.product((32, 64), (4,), (2, 3), (1,), (256, 512, 1024, 2048)))
        else:
            configs = list(itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), sorted({1, 2, 4, default_splits}),
                                             (512,)))
        for block_l, warps, stages, splits, scan in configs:
            cfg = dict(splits=splits, block_l=block_l, num_warps=warps, num_stages=stages, block_scan=scan)
            try:
                out = td.decode_attention(q, *caches[0], masks[512], D**-0.5, **cfg).float()
            except Exception as e:  # a configuration the compiler refuses (shared memory)
                results.append({"rows": rows, **cfg, "error": str(e)[:200]})
                continue
            err = float((out - ref).abs().max())
            row = {"rows": rows, **cfg, "max_err": err, "us": {}, "tb_s": {}}
            for t in POINTS:
                m = masks[t]
                span_bytes = float(m.sum()) * KV * D * 2 * 2  # keys and values of the visible slots

                def fn(m=m, cfg=cfg, q=q, caches=caches):
                    for kc, vc in caches:
                        td.decode_attention(q, kc, vc, m, D**-0.5, **cfg)

                us = time_graph(fn, LAYERS)
                row["us"][t] = us
                row["tb_s"][t] = span_bytes / (us * 1e-6) / 1e12
            row["mean_us"] = statistics.mean(row["us"].values())
            row["mean_share_of_hbm"] = statistics.mean(row["tb_s"].values()) * 1e12 / hbm
            results.append(row)
            print(json.dumps(row), flush=True)
        # the eager combine of a split launch, alone (inductor fuses it in the decode step)
        for splits in sorted({2, 4, default_splits} - {1}) if not a.scan else []:
            part = torch.randn(rows, KV, splits, G, D, device="cuda")
            mx = torch.randn(rows, KV, splits, G, device="cuda")
            sm = torch.rand(rows, KV, splits, G, device="cuda")

            def comb(part=part, mx=mx, sm=sm):
                for _ in range(LAYERS):
                    top = mx.amax(2, keepdim=True)
                    w = torch.exp(mx - top)
                    ((part * w[..., None]).sum(2) / (sm * w).sum(2)[..., None]).to(torch.bfloat16)

            results.append({"rows": rows, "splits": splits, "combine_us": time_graph(comb, LAYERS)})
        del caches
        torch.cuda.empty_cache()
    ok = [r for r in results if "mean_us" in r and r["max_err"] < 2e-2]
    best = {rows: min((r for r in ok if r["rows"] == rows), key=lambda r: r["mean_us"]) for rows in a.rows}
    # the configuration before the stages and scan rules (3 stages, scan blocks of 512), as the full sweep ran it
    default = {rows: next((r for r in ok if r["rows"] == rows and r["block_l"] == td.block_keys(128) and r["num_warps"] == 4
                           and r["num_stages"] == 3 and r["splits"] == td.num_splits(rows * KV, P + NEW)
                           and r["block_scan"] == 512), None)
               for rows in a.rows}
    out = {"info": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": __import__("triton").__version__, "commit": a.commit, "date": time.strftime("%Y-%m-%d")},
           "workload": f"decode attention, {LAYERS} layer caches, KV={KV} G={G} D={D}, L={P + NEW}, prompts 40-{P} "
                       f"tokens left-padded, t in {POINTS}", "best": best, "default_like": default, "all": results}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"tune_decode_attention{'_scan' if a.scan else ''}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({"best": best, "default_like": default}, indent=1))


if __name__ == "__main__":
    main()
