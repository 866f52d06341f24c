"""Graceful stop on Ctrl-C / SIGTERM: the first signal asks the loop to checkpoint and exit at the next safe
point; a second Ctrl-C interrupts at once."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopRequest:
    """Context manager that turns SIGINT/SIGTERM into a flag (`requested` holds the signal number)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, without a checkpoint
        self.requested = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal handlers only install there
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        """Shell convention 128 + signal number (130 for Ctrl-C, 143 for SIGTERM); 0 if none."""
        return 128 + self.requested if self.requested is not None else 0
