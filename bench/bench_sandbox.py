"""Throughput of the `code_tests` reward: completions scored per second by the sandbox pool.

Each completion is a fenced python block defining a function, scored against its tests (the program and its
tests run in a forked, confined child of a pre-warmed worker; see docs/rewards.md). Reports, per workload,
the completions/s over `--n` completions after a warm-up batch (median of `--reps` batches):

* trivial: `def f(x): return x + 1` with one test (the acceptance workload: >= 200/s on 2 cores);
* three_tests: the same program with three tests;
* mixed: a quarter each of a passing, a failing, a raising and a syntax-error completion.

Also reported: CPU seconds per completion (this process + the workers and their job processes, from
getrusage after the pool's workers exit), and the rate that CPU cost allows on `--cpus` idle cores
(cpus / cpu_per_completion): a figure that holds when other work shares the machine during the run.

Usage: python bench/bench_sandbox.py [--n 400] [--workers N] [--reps 3] [--cpus 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

from logitless.rewards.code import extract_program
from logitless.rewards.sandbox import SandboxOptions, SandboxPool

GOOD = "```python\ndef f(x):\n    return x + 1\n```"
WORKLOADS = {
    "trivial": ([GOOD], [["assert f(1) == 2"]]),
    "three_tests": ([GOOD], [["assert f(1) == 2", "assert f(-1) == 0", "assert f(10) == 11"]]),
    "mixed": ([GOOD, "```python\ndef f(x):\n    return x\n```", "raise ValueError()", "def f(:"],
              [["assert f(1) == 2"]] * 4),
}


def _cpu() -> float:
    """CPU seconds of this process and of its reaped children (the sandbox workers and their job processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--workers", type=int, default=None, help="default: CPU count")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pool = SandboxPool(SandboxOptions(), args.workers)
    pool.run([("pass", ["assert True"])])  # start the workers
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    info = dict(cpus=os.cpu_count(), workers=pool.num_workers, isolation=pool.features, n=args.n,
                python=platform.python_version(), kernel=platform.release(), commit=commit,
                load_before=os.getloadavg()[0])
    print(json.dumps(info), flush=True)
    pool.close()
    rows = []
    for name, (comps, tests) in WORKLOADS.items():
        jobs = [(extract_program(comps[i % len(comps)]), tests[i % len(tests)]) for i in range(args.n)]
        pool = SandboxPool(SandboxOptions(), args.workers)
        pool.run(jobs[:8])  # warm-up: workers started
        before = _cpu()
        rates = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            pool.run(jobs)
            rates.append(args.n / (time.perf_counter() - t0))
        pool.close()  # workers exit and are reaped: their CPU time (and their jobs') is now counted
        cpu = (_cpu() - before) / (args.n * args.reps)
        rows.append(dict(workload=name, median_per_s=statistics.median(rates), all_per_s=rates,
                         cpu_ms_per_completion=cpu * 1e3, cpu_bound_per_s=args.cpus / cpu))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sandbox_cpu.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))


if __name__ == "__main__":
    main()
