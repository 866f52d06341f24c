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

`--baseline REV` measures the sandbox of commit REV too (its `logitless/` package from `git archive`, run in a
child process), alternating baseline and current `--rounds` times, with the load average before each run: on a
shared machine only numbers from the same run compare.

Usage: python bench/bench_sandbox.py [--n 400] [--workers N] [--reps 3] [--cpus 2] [--baseline REV --rounds 2]
                                     [--out DIR] [--name sandbox_cpu]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
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


def measure(n: int, workers: int | None, reps: int, cpus: int) -> dict:
    """Every workload with the sandbox this process imports: {"features": [...], "rows": [...]}."""
    pool = SandboxPool(SandboxOptions(), workers)
    pool.run([("pass", ["assert True"])])  # start the workers
    features = pool.features
    pool.close()
    rows = []
    for name, (comps, tests) in WORKLOADS.items():
        jobs = [(extract_program(comps[i % len(comps)]), tests[i % len(tests)]) for i in range(n)]
        pool = SandboxPool(SandboxOptions(), workers)
        pool.run(jobs[:8])  # warm-up: workers started
        load, before = os.getloadavg()[0], _cpu()
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            pool.run(jobs)
            rates.append(n / (time.perf_counter() - t0))
        pool.close()  # workers exit and are reaped: their CPU time (and their jobs') is now counted
        cpu = (_cpu() - before) / (n * reps)
        rows.append(dict(workload=name, median_per_s=statistics.median(rates), all_per_s=rates, load_before=load,
                         cpu_ms_per_completion=cpu * 1e3, cpu_bound_per_s=cpus / cpu))
    return dict(features=features, rows=rows)


def _baseline(rev: str, args: argparse.Namespace, root: Path) -> dict:
    """`measure` in a child process importing commit `rev`'s package (extracted below `root`)."""
    if not (root / "logitless").exists():
        archive = subprocess.run(["git", "archive", rev, "logitless"], capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_sandbox as b; "
            f"print(json.dumps(b.measure({args.n}, {args.workers}, {args.reps}, {args.cpus})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--workers", type=int, default=None, help="default: CPU count")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="a commit whose sandbox to measure too, alternating")
    ap.add_argument("--rounds", type=int, default=2, help="with --baseline: alternations")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="sandbox_cpu", help="file name (without .json) in --out")
    args = ap.parse_args()
    git = ["git", "rev-parse", "--short"]
    info = dict(cpus=os.cpu_count(), workers=args.workers or os.cpu_count(), n=args.n, reps=args.reps,
                python=platform.python_version(), kernel=platform.release(),
                commit=subprocess.run(git + ["HEAD"], capture_output=True, text=True).stdout.strip())
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            info["baseline"] = subprocess.run(git + [args.baseline], capture_output=True, text=True).stdout.strip()
        for _ in range(args.rounds if args.baseline else 1):
            for code in (["baseline", "current"] if args.baseline else ["current"]):
                run = _baseline(args.baseline, args, Path(tmp)) if code == "baseline" else measure(
                    args.n, args.workers, args.reps, args.cpus)
                runs.append(dict(code=code, commit=info["baseline" if code == "baseline" else "commit"], **run))
                for row in run["rows"]:
                    print(json.dumps(dict(code=code, **row)), flush=True)
    print(json.dumps(info), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(dict(info=info, runs=runs), indent=1))


if __name__ == "__main__":
    main()
