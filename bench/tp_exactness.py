"""How close the tensor-parallel rollout (rollout.tensor_parallel) samples the trainer's policy in bf16, with the
row-parallel layers' partial products summed in fp32 (the replica's `tp_styles.RowwiseFp32Sum`) and summed in bf16
(torch's own RowwiseParallel, "plain"), on CPU gloo ranks.

    python bench/tp_exactness.py --out DIR [--ranks 4] [--tp 2,4] [--shapes tiny,wide]

For each group size and shape (`tests/tp_worker.py`'s `BF16_SHAPES`: "tiny" hidden 32, 2 layers; "wide" hidden
1,024, intermediate 2,816, 4 layers, 16 query and 4 KV heads; both a bf16 Qwen2 with the 258-token byte
vocabulary, full weights) every rank decodes its share of 7 prompts x 3 samples x 16 tokens (EOS ignored) through
its group's split replica and alone with the whole model. Columns, over every rank's tokens: each sampler's mean
and max |sampler logp - trainer logp| on its own tokens (the trainer: `completion_logprobs` of the whole bf16
model), their ratio (split / one rank), and where both drew the same tokens (each row's tokens before the first
that differs) the mean |split logp - one-rank logp|, with the rows whose tokens are all equal. Each run is
`tests/tp_worker.py bf16` under torchrun; the table is printed and saved as DIR/tp_bf16_cpu_<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_e2e import commit, versions  # noqa: E402

SIDES = ("one", "split", "vs_one")


def run(ranks: int, tp: str, shapes: str, plain: bool) -> dict[str, list[dict]]:
    """{"tp{T}-{shape}": [every rank's result]} of one torchrun of the worker."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(REPO / "tests" / "tp_worker.py"), "bf16", out, tp, shapes, *(["plain"] if plain else [])]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        results = [json.loads(Path(out, f"bf16_rank{r}.json").read_text()) for r in range(ranks)]
    return {k: [r[k] for r in results] for k in results[0]}


def summary(per_rank: list[dict]) -> dict:
    """Every rank's gaps pooled: token-weighted means, the largest max, the token and row counts."""
    out: dict = {}
    for side in SIDES:
        xs = [r[side] for r in per_rank]
        tokens = sum(x["tokens"] for x in xs)
        out[side] = {"mean": sum(x["mean"] * x["tokens"] for x in xs) / max(1, tokens),
                     "max": max(x["max"] for x in xs), "tokens": tokens}
    out["ratio"] = out["split"]["mean"] / out["one"]["mean"]
    out["rows_equal"] = sum(r["vs_one"]["rows_equal"] for r in per_rank)
    out["rows"] = sum(r["vs_one"]["rows"] for r in per_rank)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--shapes", default="tiny,wide")
    a = ap.parse_args()
    table = {}
    for sums, plain in (("bf16", True), ("fp32", False)):
        for case, per_rank in run(a.ranks, a.tp, a.shapes, plain).items():
            table[f"{case}-{sums}"] = {"summary": summary(per_rank), "ranks": per_rank}
    print(f"{'case':18s} {'one->trainer':>18s} {'split->trainer':>18s} {'ratio':>6s} {'split vs one':>14s} rows equal")
    for case, x in table.items():
        s = x["summary"]
        print(f"{case:18s} {s['one']['mean']:.5f} ({s['one']['max']:.4f}) {s['split']['mean']:.5f} "
              f"({s['split']['max']:.4f}) {s['ratio']:6.2f} {s['vs_one']['mean']:14.5f} {s['rows_equal']}/{s['rows']}")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"tp_bf16_cpu_{commit()}.json"
    path.write_text(json.dumps({"device": "cpu (gloo)", "ranks": a.ranks, "commit": commit(), "versions": versions(),
                                "command": " ".join(sys.argv), "cases": table}, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
