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
import itertools
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
    pool = TaskPool(max_parallel)
    results: list[Outcome | None] = [None] * n
    with stoppable("the agent's tool and environment calls"):  # (a task may signal the moment it starts)
        for i in range(n):
            pool.submit(tasks[i], timeouts[i], names[i], i)
        while pool.pending:
            for i, out in pool.poll(wait=True):
                results[i] = out
    return results  # type: ignore[return-value]


class TaskPool:
    """Tasks submitted one by one and collected as they end, for a caller that goes on with other work meanwhile
    (the rollout engine decoding other rows while a row's tool calls run).

    Each task runs in its own daemon thread, at most `max_parallel` at a time; the others queue, in order, and a
    task that ends starts the next one itself, so the pool keeps working between polls. A task's clock starts
    when its thread starts. `poll` returns the tasks that ended or reached their deadline since the last poll; a
    task past its deadline is abandoned as `run_tasks` abandons it (its slot is freed, its late result dropped,
    and a thread still running at twice its timeout raises TaskStuck at a later poll). Poll from one thread."""

    def __init__(self, max_parallel: int) -> None:
        if max_parallel < 1:
            raise ValueError(f"TaskPool: max_parallel must be >= 1, got {max_parallel}")
        self.max_parallel = max_parallel
        self._lock = threading.Lock()  # guards _queued and _running (worker threads start the next task)
        self._queued: collections.deque = collections.deque()  # (tag, fn, timeout, name), not started yet
        # id -> (tag, start, deadline, name, thread) of the tasks running now (neither ended nor abandoned)
        self._running: dict[int, tuple[Any, float, float, str, threading.Thread]] = {}
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # (tag, Outcome) of tasks that ended in time
        self._ids = itertools.count()
        self._outstanding = 0  # submitted, not yet returned by poll
        check_abandoned()

    @property
    def pending(self) -> int:
        """Tasks submitted and not yet returned by `poll`."""
        return self._outstanding

    def submit(self, fn: Callable[[], Any], timeout_s: float, name: str, tag: Any) -> None:
        """Queue `fn` (bounded by `timeout_s`, named `name` in a TaskStuck); `poll` returns its outcome with `tag`.
        Starts it at once when a slot is free."""
        self._outstanding += 1
        with self._lock:
            self._queued.append((tag, fn, float(timeout_s), name))
            self._start_locked()

    def _start_locked(self) -> None:
        while self._queued and len(self._running) < self.max_parallel:
            tag, fn, timeout_s, name = self._queued.popleft()
            i, start = next(self._ids), time.monotonic()
            thread = threading.Thread(target=self._target, args=(i, fn, start), name=f"logitless-tool-{i}",
                                      daemon=True)
            self._running[i] = (tag, start, start + timeout_s, name, thread)
            thread.start()

    def _target(self, i: int, fn: Callable[[], Any], start: float) -> None:
        try:
            out = Outcome(value=fn())
        except BaseException as e:  # noqa: BLE001 (a tool calling sys.exit must not end the rollout)
            out = Outcome(error=e)
        out.seconds = time.monotonic() - start
        with self._lock:
            entry = self._running.pop(i, None)
            if entry is not None:  # else it was abandoned already; its late result is dropped
                self._finished.put((entry[0], out))
            self._start_locked()

    def poll(self, wait: bool = False) -> list[tuple[Any, Outcome]]:
        """(tag, Outcome) of every task that ended or was abandoned at its deadline since the last poll. wait:
        block until at least one has (while any is pending). Raises TaskStuck as `check_abandoned` does."""
        done: list[tuple[Any, Outcome]] = []
        while True:
            while True:  # everything already finished, without blocking
                try:
                    done.append(self._finished.get_nowait())
                except queue.Empty:
                    break
            now = time.monotonic()
            with self._lock:
                for i, (tag, start, deadline, name, thread) in list(self._running.items()):
                    if deadline <= now:
                        del self._running[i]
                        done.append((tag, Outcome(timed_out=True, seconds=now - start)))
                        timeout_s = deadline - start
                        with _abandoned_lock:
                            _abandoned.append(_Abandoned(name, thread, timeout_s, deadline + timeout_s))
                self._start_locked()
                due = min((d for _, _, d, _, _ in self._running.values()), default=float("inf"))
            check_abandoned(now)
            if done or not wait or self._outstanding == 0:
                self._outstanding -= len(done)
                return done
            due = min(due, _next_stuck())
            try:
                done.append(self._finished.get(timeout=None if due == float("inf") else max(0.0, due - now)))
            except queue.Empty:
                continue
