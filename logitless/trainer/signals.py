"""Ctrl-C (SIGINT) and SIGTERM while `train` runs: every signal says at once what it does.

    before the first step (loading, checks): the first signal stops at once (StopNow): nothing was trained yet.
    during the steps: the first signal asks the loop to stop at its next safe point: the step in progress is
        finished (its update has begun) or dropped (it has not: a resumed run redoes it), a checkpoint is saved,
        and the line says how to resume. A second signal stops at once, without saving (StopNow).
    after a StopNow, one more signal exits at once (os._exit); so does the process itself when it is still
        unwinding GRACE_S seconds after the StopNow (a thread busy in native code).
    while the main thread waits on user code (a reward function, tools, environments: `stoppable(what)`) in a
        step that has not begun its update, on one process: the first signal also abandons that wait at once
        (StopRequested), so the step is dropped without waiting for the hung code's own timeout; code that
        swallows the interrupt (`except BaseException`) ends the process GRACE_S seconds later (exit 128 + signal).
        Between rounds of train.dynamic_sampling the loop stops the same way (`check_stop`). Under torchrun the
        ranks decide together at the step's safe points instead, as their collectives must match.
    inside a finalizer (`__del__`, run by a garbage collection at any point), where a raised StopNow would be
        printed and dropped, the signal is sent again REPEAT_S later, after the finalizer has returned.

Each message goes straight to stderr's file descriptor from the handler, so it appears even while the main thread
is inside a reward function or a model load. A StopNow is a KeyboardInterrupt whose message was already printed:
the command line prints nothing more. What is written stays whole: checkpoints are atomic (an interrupted save
removes its temp folder), the config is replaced atomically and a metrics record is one write.

A process started with SIGINT ignored (a background job of a non-interactive shell, `cmd &` in a script, and some
schedulers) keeps ignoring it: the shell asked that the terminal's Ctrl-C not reach that job, and CPython itself
raises no KeyboardInterrupt there. One line says so when the run starts; SIGTERM (`kill PID`) stops such a run in
the same way.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

from logitless import stops
from logitless.stops import StopRequested, say, stoppable  # noqa: F401  (the trainer's names for them)

GRACE_S = 10.0  # after a StopNow, the longest the process may take to unwind before it exits by force
REPEAT_S = 0.01  # a stop signal handled inside a finalizer is sent again this much later


class StopNow(KeyboardInterrupt):
    """A stop signal that stops the run at once, without a checkpoint; what it means was printed already."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def in_finalizer(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside a `__del__` (a garbage collection can run one between any two bytecodes), where
    an exception raised by a signal handler would be printed as "Exception ignored" and lost."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def label(signum: int) -> str:
    """How a user names the signal: Ctrl-C for SIGINT, else its name."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """Context manager installing the handlers (main thread only; the previous ones come back on exit).

    The loop keeps `step` (the step in progress, 0 before the first) and `updating` (its update has begun) up to
    date, and reads `requested` (the first signal's number) at its safe points; `commit_step` moves a step from
    "dropped on a stop" to "finished on a stop" atomically with respect to signals. `advice()` says what to run
    after a stop (`rundir.restart_advice` of the run folder).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, advice: Callable[[], str] = lambda: "", *, quiet: bool = False):
        self.advice, self.quiet = advice, quiet
        self.requested: int | None = None
        self.step = 0
        self.updating = False
        self.run_dir: Path | None = None
        self.sigint_ignored = False
        self._previous: dict[int, object] = {}
        self._stopping_now = False
        self._unwound = threading.Event()
        self.abandons_waits = False  # the first signal abandons a wait on user code (one process: set by the loop)
        self._waiting: str | None = None  # what the main thread waits on (`stoppable`), or None
        self._left_wait = threading.Event()  # set when the abandoned wait has been left

    def _say(self, text: str) -> None:
        if not self.quiet:
            say(text)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = label(signum)
        if self._stopping_now:
            self._say(f"{name} again: exiting at once")
            os._exit(128 + signum)
        if self.requested is None and self.step > 0:
            self.requested = signum
            self._say(self.first_message(name))
            if self._waiting is not None and self.may_drop_at_once and not in_finalizer(frame):
                self._abandon()
            return
        if in_finalizer(frame):  # raised there, Python would print the exception and drop it: the signal comes
            again = threading.Timer(REPEAT_S, os.kill, (os.getpid(), signum))  # back once the finalizer is done
            again.daemon = True
            again.start()
            return
        again = self.requested is not None
        self._stopping_now = True
        threading.Thread(target=self._force_exit, args=(signum,), name="logitless-stop", daemon=True).start()
        self._say(f"{name}{' again' if again else ''}: stopping now, without saving"
                  f"{'' if self.step else ' (training had not started)'}; {self.advice()}")
        raise StopNow(signum)

    def first_message(self, name: str) -> str:
        """What the first signal during the steps does, with how to resume."""
        run, step = self.run_dir, self.step
        resume = f"Continue later with: logitless train --resume {run}."
        if self.updating:
            what = (f"stopping after step {step}: its update finishes, then a checkpoint of step {step} is saved. "
                    f"{resume}")
        elif step > 1:
            what = (f"stopping. Step {step} has not begun its update, so it is dropped (a resumed run redoes it) and "
                    f"a checkpoint of step {step - 1} is saved. {resume}")
        else:
            what = ("stopping. Step 1 has not begun its update, so it is dropped: nothing was trained, no checkpoint "
                    "is saved and there is nothing to resume; start again with the same command.")
        return f"{name}: {what} {name} again stops at once, without saving."

    @property
    def may_drop_at_once(self) -> bool:
        """A stop may drop the step in progress at once: one process, a step whose update has not begun."""
        return self.abandons_waits and not self.updating and self.step > 0

    def _abandon(self) -> None:
        """Raise StopRequested into the wait on user code; the process exits if that code swallows it."""
        signum, what = self.requested, self._waiting
        assert signum is not None
        self._left_wait.clear()

        def force() -> None:
            if not self._left_wait.wait(GRACE_S):
                say(f"{label(signum)}: {what} still running {GRACE_S:.0f} s after it was interrupted (it catches "
                    f"the interrupt); exiting")
                os._exit(128 + signum)

        threading.Thread(target=force, name="logitless-stop-wait", daemon=True).start()
        raise StopRequested(signum)

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The main thread waits on user code (`what`, e.g. "reward function 'f'"): a stop may abandon it."""
        if threading.current_thread() is not threading.main_thread() or self._waiting is not None:
            yield
            return
        self._waiting = what
        try:
            if self.requested is not None and self.may_drop_at_once:
                self._abandon()
            yield
        finally:
            self._waiting = None
            self._left_wait.set()

    def check_stop(self) -> None:
        """Raise StopRequested when a signal asked to stop and this step may still be dropped (one process)."""
        if self.requested is not None and self.may_drop_at_once:
            raise StopRequested(self.requested)

    def _force_exit(self, signum: int) -> None:
        if not self._unwound.wait(GRACE_S):
            say(f"{label(signum)}: still stopping after {GRACE_S:.0f} s (a thread is busy in native code); exiting")
            os._exit(128 + signum)

    def commit_step(self) -> int | None:
        """From now on a stop finishes the step in progress; returns the signal that came before (the step is
        then dropped). Signals are held back for the switch, so the message and the decision agree."""
        held = threading.current_thread() is threading.main_thread() and bool(self._previous)
        if held:
            signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        try:
            before, self.updating = self.requested, True
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        return before

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():  # signal handlers only install there
            return self
        stops.active = self
        for s in self.SIGNALS:
            if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                self.sigint_ignored = True
                self._say(f"note: this process ignores Ctrl-C (SIGINT was ignored when it started, as for a "
                          f"background job); stop it with SIGTERM: kill {os.getpid()}")
                continue
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if stops.active is self:
            stops.active = None
        self._unwound.set()
        self._left_wait.set()
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        """Shell convention 128 + signal number (130 for Ctrl-C, 143 for SIGTERM); 0 if none."""
        return 128 + self.requested if self.requested is not None else 0


def check_stop(together: Callable[[int | None], int | None] | None = None) -> None:
    """Raise StopRequested when a stop signal asked the run in progress to stop and its step may still be dropped;
    nothing without a run in progress. One process: `StopSignals.check_stop`. Several (`together`: the ranks'
    agreement, `parallel.agree`): every rank calls it at the same point and all stop when any was signalled."""
    active = stops.active
    if active is None or active.updating or active.step <= 0:
        return
    if together is not None:
        signum = together(active.requested)
        if signum:
            raise StopRequested(int(signum))
        return
    active.check_stop()
