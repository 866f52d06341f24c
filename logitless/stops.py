"""A run's stop requests as the layers below the trainer see them: a wait on user code (a reward function, a tool,
an environment) that the first stop signal may abandon (`stoppable`), the exception that abandons it
(`StopRequested`), and a line to stderr that a signal handler or a watchdog thread may write (`say`).

The trainer's `signals.StopSignals` registers itself here (`active`) while a run is in progress; with none
registered a `stoppable` wait is a plain one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator


class StopRequested(KeyboardInterrupt):
    """The first stop signal abandoned a wait on user code of a step that had not begun its update: the loop drops
    the step and stops as the signal's message said."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


active: Any = None  # the run's signal handlers (`trainer.signals.StopSignals`) while a run is in progress


@contextmanager
def stoppable(what: str) -> Iterator[None]:
    """A wait of the main thread on user code (`what` names it in messages) that the first stop signal of a run on
    one process may abandon (`StopSignals.waiting`); nothing without a run in progress."""
    handlers = active
    if handlers is None:
        yield
        return
    with handlers.waiting(what):
        yield


def say(text: str) -> None:
    """One line to stderr, written to its file descriptor (a buffered stream is not re-entrant, and the main
    thread may be printing when a signal handler or a watchdog thread says it)."""
    data = (text.rstrip("\n") + "\n").encode(errors="replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass
