"""Run tasks (tool calls, environment steps) concurrently with per-task timeouts, abandoning hung ones.

Each task runs in its own daemon thread, at most `max_parallel` at a time. A task's clock starts when its
thread starts; a task still running at its deadline is *abandoned*: its outcome is "timed out", its thread is
left to finish (or hang) in the background without holding a slot, and whatever it returns later is dropped.
Python cannot stop a thread, so a tool that never returns keeps its thread (and whatever it holds) until the
process ends; daemon threads never keep the process alive. Code that must be killable runs in a subprocess
(the python tool runs in the code sandbox, which kills the program at its own timeout).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass
class Outcome:
    """How one task ended."""

    value: Any = None
    error: BaseException | None = None  # what it raised
    timed_out: bool = False  # still running at its deadline (abandoned)
    seconds: float = 0.0  # wall time until it ended or was abandoned


def run_tasks(tasks: Sequence[Callable[[], Any]], timeouts: Sequence[float], max_parallel: int) -> list[Outcome]:
    """Run `tasks` (at most `max_parallel` at once), each with its own timeout in seconds; one `Outcome` per
    task, in order. Never raises for what a task does."""
    n = len(tasks)
    if len(timeouts) != n:
        raise ValueError(f"run_tasks: {n} tasks but {len(timeouts)} timeouts")
    if max_parallel < 1:
        raise ValueError(f"run_tasks: max_parallel must be >= 1, got {max_parallel}")
    results: list[Outcome | None] = [None] * n
    finished: queue.SimpleQueue = queue.SimpleQueue()  # (index, Outcome) from the threads of this call only
    pending = collections.deque(range(n))
    running: dict[int, tuple[float, float]] = {}  # index -> (start, deadline), monotonic seconds

    def target(i: int, fn: Callable[[], Any], start: float) -> None:
        try:
            out = Outcome(value=fn())
        except BaseException as e:  # noqa: BLE001 (a tool calling sys.exit must not end the rollout)
            out = Outcome(error=e)
        out.seconds = time.monotonic() - start
        finished.put((i, out))

    while pending or running:
        while pending and len(running) < max_parallel:
            i = pending.popleft()
            start = time.monotonic()
            running[i] = (start, start + float(timeouts[i]))
            threading.Thread(target=target, args=(i, tasks[i], start), name=f"logitless-tool-{i}",
                             daemon=True).start()
        wait = max(0.0, min(d for _, d in running.values()) - time.monotonic())
        try:
            i, out = finished.get(timeout=wait)
        except queue.Empty:
            now = time.monotonic()
            for i, (start, deadline) in list(running.items()):
                if deadline <= now:
                    del running[i]
                    results[i] = Outcome(timed_out=True, seconds=now - start)
            continue
        if i in running:  # else it was abandoned already; drop its late result
            del running[i]
            results[i] = out
    return results  # type: ignore[return-value]
