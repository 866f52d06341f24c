"""Run tasks (tool calls, environment resets and steps) concurrently with per-task timeouts, abandoning hung ones.

Each task runs in its own daemon thread, at most `max_parallel` at a time. A task's clock starts when its
thread starts; a task still running at its deadline is *abandoned*: its outcome is "timed out", its thread is
left to finish in the background without holding a slot, and whatever it returns later is dropped.

Python cannot stop a thread, so an abandoned task gets as long again as its timeout to end; one still running
after that is stuck (a busy loop, a wait that never ends) and fails the run (`TaskStuck`, naming the task and
where it runs), at the next check: while any `run_tasks` call waits, and when one starts. Stuck threads
therefore never pile up from step to step. Code that must be killable runs in a subprocess (the python tool runs
in the code sandbox, which kills the program at its own timeout).

A wait on the main thread is a `logitless.stops.stoppable` one: the first stop signal of a run on one process
abandons it.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence


class TaskStuck(RuntimeError):
    """An abandoned task was still running at twice its timeout."""


@dataclass
class _Abandoned:
    name: str
    thread: threading.Thread
    timeout_s: float
    stuck_at: float  # monotonic seconds: still alive then, it is stuck


_abandoned: list[_Abandoned] = []  # every run_tasks call's abandoned tasks whose thread may still run
_abandoned_lock = threading.Lock()


def check_abandoned(now: float | None = None) -> None:
    """Forget the abandoned tasks that ended; raise TaskStuck for one still running past its grace."""
    now = time.monotonic() if now is None else now
    with _abandoned_lock:
        _abandoned[:] = [a for a in _abandoned if a.thread.is_alive()]
        stuck = next((a for a in _abandoned if a.stuck_at <= now), None)
    if stuck is None:
        return
    frame = sys._current_frames().get(stuck.thread.ident or -1)
    where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(no stack)\n"
    raise TaskStuck(
        f"{stuck.name} did not return within {stuck.timeout_s:g} s (agent.tool_timeout_s) and was still running "
        f"{stuck.timeout_s:g} s after it was abandoned; Python cannot stop a thread, so the run ends rather than "
        f"let stuck calls pile up. Make it return (bound its loops and waits), or raise agent.tool_timeout_s. "
        f"Where it runs:\n{where}"
    )


def _next_stuck() -> float:
    with _abandoned_lock:
        return min((a.stuck_at for a in _abandoned), default=float("inf"))


@dataclass
class Outcome:
    """How one task ended."""

    value: Any = None
    error: BaseException | None = None  # what it raised
    timed_out: bool = False  # still running at its deadline (abandoned)
    seconds: float = 0.0  # wall time until it ended or was abandoned


def run_tasks(tasks: Sequence[Callable[[], Any]], timeouts: Sequence[float], max_parallel: int,
              names: Sequence[str] | None = None) -> list[Outcome]:
    """Run `tasks` (at most `max_parallel` at once), each with its own timeout in seconds; one `Outcome` per
    task, in order. Never raises for what a task does in time; raises TaskStuck for an abandoned task (of this
    call or an earlier one, named by `names`) still running at twice its timeout."""
    from logitless.stops import stoppable

    n = len(tasks)
    names = list(names) if names is not None else [f"task {i}" for i in range(n)]
    if len(timeouts) != n or len(names) != n:
        raise ValueError(f"run_tasks: {n} tasks but {len(timeouts)} timeouts and {len(names)} names")
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

    threads: dict[int, threading.Thread] = {}
    check_abandoned()
    with stoppable("the agent's tool and environment calls"):
        while pending or running:
            while pending and len(running) < max_parallel:
                i = pending.popleft()
                start = time.monotonic()
                running[i] = (start, start + float(timeouts[i]))
                threads[i] = threading.Thread(target=target, args=(i, tasks[i], start), name=f"logitless-tool-{i}",
                                              daemon=True)
                threads[i].start()
            due = min(min(d for _, d in running.values()), _next_stuck())
            wait = max(0.0, due - time.monotonic())
            try:
                i, out = finished.get(timeout=wait)
            except queue.Empty:
                now = time.monotonic()
                for i, (start, deadline) in list(running.items()):
                    if deadline <= now:
                        del running[i]
                        results[i] = Outcome(timed_out=True, seconds=now - start)
                        with _abandoned_lock:
                            _abandoned.append(_Abandoned(names[i], threads[i], float(timeouts[i]),
                                                         deadline + float(timeouts[i])))
                check_abandoned(now)
                continue
            if i in running:  # else it was abandoned already; drop its late result
                del running[i]
                results[i] = out
    return results  # type: ignore[return-value]
