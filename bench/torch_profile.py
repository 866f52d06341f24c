"""`bench_e2e.py --torch-profile STEP`: the kernels and host ranges of one training step, by phase.

A `train(hook=...)` hook that runs `torch.profiler` over the rollout of step STEP (from the "generate" event to
"after_rollout", scoring included) and over its update ("after_rollout" to "after_update"), and keeps each
window's `key_averages()` table, sorted by device time and by host time. The tables go into the result JSON
beside the step's timings, so a slow phase can be read kernel by kernel (and, with `rollout.profile=true`
or the episode engine's `record_function` ranges, part by part) without a trace file. Python's garbage
collections in each window are counted and timed too (a full collection in a process holding a model and
compiled graphs takes a good part of a second: `rollout/engine.py`'s `generation_mode`)."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

ROWS = 40  # rows of each table


class StepProfiler:
    """hook(event, step): profile step `step`'s rollout and update windows; `tables` holds the results."""

    def __init__(self, step: int, windows: tuple[str, ...] | list[str] = ("rollout", "update")) -> None:
        unknown = set(windows) - {"rollout", "update"}
        if unknown:
            raise ValueError(f"--torch-profile-windows: unknown window(s) {sorted(unknown)}: use rollout, update")
        self.step, self.windows, self.tables, self._prof, self._window = step, set(windows), {}, None, None
        self._gc: list[tuple[int, float]] = []  # (generation, seconds) of each collection in the window
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc.append((info["generation"], time.perf_counter() - self._gc_start))

    def _start(self, window: str) -> None:
        if window not in self.windows:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof, self._window = torch.profiler.profile(activities=acts), window
        self._gc = []
        gc.callbacks.append(self._on_gc)
        self._prof.__enter__()

    def _stop(self) -> None:
        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        gc.callbacks.remove(self._on_gc)
        avg = self._prof.key_averages()
        device = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = lambda key: avg.table(sort_by=key, row_limit=ROWS, max_name_column_width=70)  # noqa: E731
        self.tables[self._window] = {"by_device_time": table(device), "by_host_time": table("cpu_time_total"),
                                     "gc_collections": [{"generation": g, "seconds": round(t, 4)} for g, t in self._gc]}
        self._prof = self._window = None

    def __call__(self, event: str, step: int) -> None:
        if step != self.step:
            return
        if event == "generate":
            self._start("rollout")
        elif event == "after_rollout":
            self._stop()
            self._start("update")
        elif event == "after_update":
            self._stop()

    def summary(self) -> dict[str, Any]:
        return {"step": self.step, **self.tables}
