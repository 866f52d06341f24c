"""A bound on every phase of a step under torchrun (`train.collective_timeout_s`), and word of a failed rank.

Each rank runs a step as phases: `rollout` (the rollout and its scoring; within it `sync`, the rollout weights made
current: the replica's sync or the model's all-gather), `update` (the ranks' agreement to go on, the old and
reference logprobs, the optimizer steps, the step's metrics) and `checkpoint`. A rank's watchdog thread holds each
phase to the bound: when a phase runs past it (a collective that a peer never joins, a peer that died, a hang in
user code), the rank prints what it was doing, which ranks it waits on, and the stacks of its threads
(`faulthandler`), and ends (exit 1) within the bound, never hanging.

The ranks talk through the process group's store (torchrun's, which outlives the ranks): every BEAT_S seconds each
rank's watchdog writes its heartbeat and phase there and reads the others'. The first rank to fail writes why (a
phase past its bound, or an exception raised in a phase); every other rank reads it within BEAT_S and ends naming
that rank (NEWS_GRACE_S later, so that a rank that raised prints its own error first), instead of waiting in a
collective until its own bound. A rank past its bound that waits on a rank behind it (an earlier phase) gives that
rank up to 3 heartbeats to report itself first. A collective that fails because a peer died (gloo fails at once)
is reported naming the rank whose heartbeat stopped; one that stops answering without dying is named at the bound.
The process group's own timeout (twice the bound) is the backstop of a watchdog that cannot run.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from logitless.stops import say

KEY = "train.collective_timeout_s"
BEAT_S = 1.0  # how often a rank writes its heartbeat and reads the others' (and the news of a failure)
PREFIX = "logitless/watchdog/"
NEWS_GRACE_S = 5.0  # a rank told of another's failure ends this much later (torchrun usually ends it first)




class Watchdog:
    """One rank's watchdog over `size` ranks talking through `store` (a torch.distributed Store)."""

    def __init__(self, store: Any, rank: int, size: int, timeout_s: float, run_id: str = ""):
        self.store, self.rank, self.size, self.timeout_s = store, rank, size, float(timeout_s)
        self.prefix = f"{PREFIX}{run_id}/"
        self.phase_name: str | None = None
        self.step = 0
        self.deadline = float("inf")  # monotonic seconds
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failing = False  # an exception is unwinding a phase on this rank
        self._seen: dict[int, tuple[dict, float, float]] = {}  # rank -> (phase, beat, monotonic time it changed)
        self._beat()
        self._observe()  # every peer in _seen from here on (the thread only replaces their entries)
        self._thread = threading.Thread(target=self._watch, name="logitless-watchdog", daemon=True)
        self._thread.start()

    # -- the main thread's side ----------------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """The block is phase `name` of step `step` (default: the enclosing phase's), bounded by the timeout."""
        with self._lock:
            outer = (self.phase_name, self.step, self.deadline)
            self.phase_name, self.step = name, outer[1] if step is None else step
            self.deadline = time.monotonic() + self.timeout_s
        self._publish()
        try:
            yield
        except Exception as e:
            if getattr(e, "_watchdog_seen", False):  # from a phase within this one: said already
                raise
            self._failing = True  # this rank raises: the news of another's failure does not end it
            self._fail(f"rank {self.rank}: the {name} phase of step {self.step} raised {type(e).__name__}: "
                       f"{str(e)[:500]}")
            why = self._verdict(str(e)[:200], from_collective(e))
            out = RuntimeError(f"rank {self.rank}: the {name} phase of step {self.step} failed ({type(e).__name__}: "
                               f"{str(e)[:300]}); {why}") if why else e
            try:
                out._watchdog_seen = True  # type: ignore[attr-defined]
            except AttributeError:
                pass
            if out is e:
                raise
            raise out from e
        finally:
            with self._lock:
                self.phase_name, self.step, self.deadline = outer
            self._publish()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * BEAT_S)

    def _verdict(self, error: str, collective: bool) -> str:
        """After an exception (`error`, its text) in a phase: why, if another rank is the cause (it failed with
        another error, or its heartbeat stopped), looked for during up to 3 heartbeats after a failed `collective`
        (one fails at once when a peer dies, before its heartbeat is seen to stop). An error every rank raises (one
        handed to all) is no other rank's doing."""
        end = time.monotonic() + (3 * BEAT_S if collective else 0.0)
        while True:
            try:
                self._observe()
                news = self._others_failure()
                why = (news if news and error not in news else "") or self._stopped()
            except Exception:  # noqa: BLE001 (the store is gone too)
                return ""
            if why or time.monotonic() >= end:
                return why
            self._closed.wait(BEAT_S / 4)

    # -- the watchdog thread ---------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(BEAT_S):
            try:
                self._beat()
                self._observe()
                news = self._others_failure()
            except Exception:  # noqa: BLE001 (the store went away: torchrun is ending the ranks)
                return
            if news and not self._failing:
                self._end(f"rank {self.rank}: stopping, {news}", after=NEWS_GRACE_S)
            with self._lock:
                name, step, late = self.phase_name, self.step, time.monotonic() - self.deadline
            if name is not None and late >= 0:
                if late < 3 * BEAT_S and self._behind():  # the rank this one waits on is past its own bound
                    continue  # (or nearly): its watchdog names it and its stacks first
                waited = self._waited_on()
                message = (f"rank {self.rank}: the {name} phase of step {step} did not finish within {KEY}="
                           f"{self.timeout_s:g} s" + (f"; {waited}" if waited else
                                                      "; this rank itself is stuck (its stacks follow)"))
                self._fail(message)
                self._end(message)

    def _end(self, message: str, after: float = 0.0) -> None:
        """Print `message` and this process's stacks, then exit 1 (`after` seconds later: a rank that failed by
        raising gets to print its own error before torchrun, seeing this rank end, ends it)."""
        say(f"error: {message}. Stacks of rank {self.rank}'s threads:")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self._closed.wait(after)
        os._exit(1)

    # -- the store -------------------------------------------------------------------------------------------------

    def _key(self, what: str) -> str:
        return self.prefix + what

    def _beat(self) -> None:
        self.store.set(self._key(f"beat/{self.rank}"), repr(time.time()))

    def _publish(self) -> None:
        with self._lock:
            state = {"phase": self.phase_name, "step": self.step}
        try:
            self.store.set(self._key(f"phase/{self.rank}"), json.dumps(state))
        except Exception:  # noqa: BLE001 (the store is gone: the watchdog says so)
            pass

    def _fail(self, message: str) -> None:
        """Tell the other ranks (the first failure stands)."""
        try:
            self.store.compare_set(self._key("failed"), "", json.dumps({"rank": self.rank, "message": message}))
        except Exception:  # noqa: BLE001
            pass

    def _others_failure(self) -> str | None:
        key = self._key("failed")
        if not self.store.check([key]):
            return None
        news = json.loads(self.store.get(key))
        if news["rank"] == self.rank:
            return None
        return f"as rank {news['rank']} failed: {news['message']}"

    def _observe(self) -> None:
        """Read every other rank's phase and heartbeat; note when a heartbeat last changed."""
        now = time.monotonic()
        for r in range(self.size):
            if r == self.rank:
                continue
            phase_key, beat_key = self._key(f"phase/{r}"), self._key(f"beat/{r}")
            state = json.loads(self.store.get(phase_key)) if self.store.check([phase_key]) else {"phase": None,
                                                                                                  "step": 0}
            beat = float(self.store.get(beat_key)) if self.store.check([beat_key]) else 0.0
            seen = self._seen.get(r)
            self._seen[r] = (state, beat, now if seen is None or seen[1] != beat else seen[2])

    def _where(self, r: int) -> str:
        state = self._seen[r][0]
        return f"the {state['phase']} phase of step {state['step']}" if state["phase"] else "no phase of a step"

    def _stopped(self) -> str:
        """The ranks whose heartbeat has not changed for more than 2 heartbeats."""
        now = time.monotonic()
        out = [f"rank {r} stopped answering {now - t:.0f} s ago (it died, or is stuck in native code), last in "
               f"{self._where(r)}" for r, (_, _, t) in sorted(self._seen.items()) if now - t > 2 * BEAT_S]
        return "; ".join(out)

    def _behind(self) -> list[str]:
        """The ranks that still beat but are behind this one (an earlier step or phase): this rank waits on them."""
        with self._lock:
            mine = (self.step, _ORDER.get(self.phase_name or "", 0))
        now = time.monotonic()
        return [f"rank {r} is still in {self._where(r)}" for r, (state, _, t) in sorted(self._seen.items())
                if (state["step"], _ORDER.get(state["phase"] or "", 0)) < mine and now - t <= 2 * BEAT_S]

    def _waited_on(self) -> str:
        """Which ranks this one waits on: those with no heartbeat, or behind it."""
        out = ([self._stopped()] if self._stopped() else []) + self._behind()
        return "waiting on " + "; ".join(out) if out else ""


def from_collective(e: BaseException) -> bool:
    """Whether `e` was raised in torch.distributed (a collective, or its wait)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename


_ORDER = {"eval": 0, "rollout": 1, "sync": 1, "update": 2, "checkpoint": 3}  # a step's phases in order (sync: in the rollout)
_active: Watchdog | None = None
_runs = 0  # watchdogs made by this process: the same count on every rank names a run's keys in the store


@contextmanager
def watching(timeout_s: float) -> Iterator[Watchdog | None]:
    """A watchdog for this rank for the block, under torchrun (None on one process)."""
    global _active, _runs
    import torch.distributed as dist

    from logitless.trainer.distributed.collectives import is_distributed

    if not is_distributed():
        yield None
        return
    _runs += 1
    store = dist.distributed_c10d._get_default_store()
    dog = Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s, str(_runs))
    _active = dog
    try:
        yield dog
    finally:
        _active = None
        dog.close()


@contextmanager
def phase(name: str, step: int | None = None) -> Iterator[None]:
    """Phase `name` of the step (see `Watchdog.phase`); nothing without a watchdog (one process)."""
    dog = _active
    if dog is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with dog.phase(name, step):
        yield
