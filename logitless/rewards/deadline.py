"""A time limit on one call of a reward function (`reward.timeout_s`).

`call_with_timeout(fn, args, kwargs, timeout_s)` returns fn's result, or says that the call ran past its limit.

On the main thread the call runs where it is, and a watchdog thread interrupts it at the deadline: it sends
`TIMEOUT_SIGNAL` (a real-time signal nothing else uses) to the main thread, whose handler raises `RewardTimeout`
inside the function. The function is stopped: its `finally` blocks run, and a call it waits in (sleep, a socket,
a lock, a subprocess) is interrupted. `RewardTimeout` is a BaseException, so the function's own
`except Exception` does not swallow it; a function that swallows it anyway gets it again every RETRY_S seconds,
and one still running GIVE_UP_S seconds after its deadline (it catches BaseException) ends the process (exit 1)
with its stack printed: a thread cannot be stopped, and the run must not hang on it.
Running the function on the main thread keeps what works there without a limit: its own `signal.alarm` timeouts
(math_verify's `parse`/`verify` refuse to run on any other thread) and code that is not thread-safe.

Off the main thread (Python runs signal handlers only there), or on a platform without real-time signals, the
call runs on a daemon worker thread and the caller stops waiting at the deadline. That thread is abandoned:
Python cannot stop a thread, so it runs on until the function returns, and its result is dropped.

On the main thread of a run on one process, a stop signal abandons the call too (`logitless.stops.stoppable`).

Neither way stops native code that holds the GIL (a regular expression backtracking inside `re`, a long C call):
the limit takes effect when that code returns. The built-in rewards bound their own time per sample.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any, Callable

# SIGRTMAX - 3: a real-time signal (Linux) that no library of the trainer uses; None where there are none
TIMEOUT_SIGNAL: int | None = int(signal.SIGRTMAX) - 3 if hasattr(signal, "SIGRTMAX") else None
RETRY_S = 1.0  # how often a call that swallowed RewardTimeout gets it again
GIVE_UP_S = 5.0  # a call still running this long after its deadline (it swallows RewardTimeout) ends the process


class RewardTimeout(BaseException):
    """Raised inside a reward function call that ran past its deadline (caught by `call_with_timeout`)."""


class _Deadline:
    """One timed call on the main thread: the watchdog's side."""

    def __init__(self, timeout_s: float, thread_id: int, name: str):
        self.timeout_s, self.thread_id, self.name = timeout_s, thread_id, name
        self.expired = False  # the deadline passed (the handler may raise)
        self.finished = threading.Event()  # the call returned: the watchdog stops

    def watch(self) -> None:
        if self.finished.wait(self.timeout_s):
            return
        self.expired = True
        tries = max(1, round(GIVE_UP_S / RETRY_S))
        for _ in range(tries):
            signal.pthread_kill(self.thread_id, TIMEOUT_SIGNAL)
            if self.finished.wait(RETRY_S):
                return
        give_up(f"reward function '{self.name}' did not return within reward.timeout_s={self.timeout_s:g} s and "
                f"was still running {GIVE_UP_S:g} s after it was stopped: it catches the stop (an `except "
                "BaseException` or bare `except:` around its work). Python cannot stop a thread, so the run ends "
                "here; catch Exception, not BaseException, in the reward function", self.thread_id)


def give_up(message: str, thread_id: int) -> None:
    """End the process (exit 1) after writing `message` and the stack of thread `thread_id` to stderr."""
    from logitless.stops import say

    frame = sys._current_frames().get(thread_id)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
    say(f"error: {message}. Where it runs:\n{stack}")
    os._exit(1)


_active: _Deadline | None = None  # the call being timed on the main thread


def _raise_in_call(signum: int, frame: FrameType | None) -> None:
    """TIMEOUT_SIGNAL's handler: raise RewardTimeout when a timed call is past its deadline and the main thread is
    inside the reward function (not in `_call_on_main` itself, which is returning)."""
    d = _active
    if d is not None and d.expired and not d.finished.is_set() and frame is not None \
            and frame.f_code is not _call_on_main.__code__:
        raise RewardTimeout


def _can_interrupt() -> bool:
    """True when this thread is the main thread and TIMEOUT_SIGNAL's handler is (now) installed."""
    if TIMEOUT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(TIMEOUT_SIGNAL) is not _raise_in_call:
        try:  # kept for the life of the process: a signal that arrives late then finds it, not the default action
            signal.signal(TIMEOUT_SIGNAL, _raise_in_call)
        except (ValueError, OSError):
            return False
    return True


def _call_on_main(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float) -> tuple[Any, str | None]:
    global _active
    d = _Deadline(timeout_s, threading.get_ident(), getattr(fn, "__name__", type(fn).__name__))
    threading.Thread(target=d.watch, name="logitless-reward-deadline", daemon=True).start()
    outer, _active = _active, d
    try:
        return fn(*args, **kwargs), None
    except RewardTimeout:
        return None, "it was stopped"
    finally:
        d.finished.set()
        _active = outer


def _call_on_worker(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float) -> tuple[Any, str | None]:
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="logitless-reward-call", daemon=True).start()
    if not done.wait(timeout_s):
        return None, "its thread was left running (Python cannot stop a thread; its result will be dropped)"
    if "error" in box:
        raise box["error"]
    return box["result"], None


def call_with_timeout(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                      timeout_s: float | None) -> tuple[Any, str | None]:
    """(fn(*args, **kwargs), None), or (None, what became of the call) when it ran past `timeout_s` seconds
    (None: no limit). An exception of fn propagates as it is."""
    from logitless.stops import stoppable

    with stoppable(f"the reward function '{getattr(fn, '__name__', type(fn).__name__)}'"):
        if timeout_s is None:
            return fn(*args, **kwargs), None
        if _can_interrupt():
            return _call_on_main(fn, args, kwargs, timeout_s)
        return _call_on_worker(fn, args, kwargs, timeout_s)
