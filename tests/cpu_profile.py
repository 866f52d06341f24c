"""An opt-in pytest plugin: the CPU seconds of each test phase (this process's user + system time, plus that of
the child processes it waited for: torchrun ranks, CLI runs, bench scripts), one JSON line per phase, appended to
the file named by LOGITLESS_CPU_PROFILE. On a machine the suite shares with other work, CPU time is what the tests
cost; wall time is also what the others took.

    LOGITLESS_CPU_PROFILE=/tmp/cpu.jsonl python -m pytest -q -p tests.cpu_profile
    python -m tests.cpu_profile /tmp/cpu.jsonl     # CPU seconds per file, the costliest first
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys

import pytest


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(phase: str):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args):
        path = os.environ.get("LOGITLESS_CPU_PROFILE")
        start = _cpu()
        yield
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": item.nodeid, "phase": phase, "cpu_s": round(_cpu() - start, 3)}) + "\n")
    return hook


pytest_runtest_setup = _timed("setup")
pytest_runtest_call = _timed("call")
pytest_runtest_teardown = _timed("teardown")


def per_file(path: str) -> list[tuple[str, float]]:
    """CPU seconds per test file of a LOGITLESS_CPU_PROFILE file, the costliest first."""
    total: collections.Counter = collections.Counter()
    for line in open(path):
        row = json.loads(line)
        total[row["test"].split("::")[0]] += row["cpu_s"]
    return total.most_common()


if __name__ == "__main__":
    rows = per_file(sys.argv[1])
    print(f"{sum(s for _, s in rows):8.1f}  all {len(rows)} files")
    for name, seconds in rows[:40]:
        print(f"{seconds:8.1f}  {name}")
