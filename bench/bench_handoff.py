"""What it costs to hand a rollout batch between processes (the shared rollout's decode process,
trainer/placement/rollout_worker.py): the batch pickled with its tensors by value (what the decode process sends)
against `async_rollout.batch_to_json`'s lists (what it sent at 11b159c; what a checkpoint keeps of a pending
rollout). Host only; medians of --repeats.

    python bench/bench_handoff.py --out bench/results/handoff_cpu.json [--rows 512 --prompt 200 --tokens 512]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_e2e import commit, versions  # noqa: E402
from logitless.rollout.types import RolloutBatch, RolloutTiming  # noqa: E402
from logitless.trainer.placement.async_rollout import batch_from_json, batch_to_json  # noqa: E402


def batch(rows: int, prompt: int, tokens: int) -> RolloutBatch:
    """A batch of `rows` rows of `prompt` + `tokens` random token ids, every row at its limit, 4 characters a token."""
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(
        prompt_ids=torch.randint(0, 151_936, (rows, prompt), generator=g), prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        completion_ids=torch.randint(0, 151_936, (rows, tokens), generator=g),
        completion_mask=torch.ones(rows, tokens, dtype=torch.long), sampler_logp=-torch.rand(rows, tokens, generator=g),
        finished=torch.zeros(rows, dtype=torch.bool), truncated=torch.ones(rows, dtype=torch.bool),
        prompt_index=torch.arange(rows) // 8, completions=["abcd" * tokens] * rows,
        timing=RolloutTiming(1.0, rows * tokens, rows * tokens / 1.0))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    b = batch(args.rows, args.prompt, args.tokens)
    as_json = pickle.dumps(batch_to_json(b), protocol=5)
    by_value = pickle.dumps(b, protocol=5)
    assert torch.equal(batch_from_json(pickle.loads(as_json)).sampler_logp, pickle.loads(by_value).sampler_logp)
    result = {
        "info": {"device": "host CPU", "threads": torch.get_num_threads(), "versions": versions(), "commit": commit(),
                 "date": time.strftime("%Y-%m-%d")},
        "shape": {"rows": args.rows, "prompt_tokens": args.prompt, "completion_tokens": args.tokens,
                  "repeats": args.repeats},
        "json_send_s": timed(lambda: pickle.dumps(batch_to_json(b), protocol=5), args.repeats),
        "json_receive_s": timed(lambda: batch_from_json(pickle.loads(as_json)), args.repeats),
        "json_mb": len(as_json) / 1e6,
        "pickle_send_s": timed(lambda: pickle.dumps(b, protocol=5), args.repeats),
        "pickle_receive_s": timed(lambda: pickle.loads(by_value), args.repeats),
        "pickle_mb": len(by_value) / 1e6,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "info"}, indent=1))


if __name__ == "__main__":
    main()
