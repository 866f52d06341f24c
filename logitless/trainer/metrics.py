"""Logging sinks of the trainer: metrics JSONL, TensorBoard (when installed), a rich progress bar, sample tables.

Only the trainer (rank 0) writes; math modules return metrics as plain dicts of floats.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

METRICS_FILE = "metrics.jsonl"


def _clean(v: Any) -> Any:
    """JSON-safe scalar: tensors -> Python numbers, NaN/inf -> None (JSON has no NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of `<run_dir>/metrics.jsonl` (one dict per logged step)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: is it the output_dir of a `logitless train` run?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes one JSON record per logged step to `<run_dir>/metrics.jsonl` and mirrors scalars to TensorBoard.

    `resume_step`: drop records of steps after it (a resumed run rewrites them).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int = 0,
        resume_step: int = 0,
        console: Console | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        kept = []
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if line.strip()]
            kept = [line for line in kept if json.loads(line).get("step", 0) <= resume_step] if resume_step else []
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")
        self.console = console or Console(stderr=True)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:
                self.tb = None
        self.progress = None
        if progress and total_steps > 0 and sys.stderr.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self.console,
            )
            self._task = self.progress.add_task("", total=total_steps, completed=resume_step)
            self.progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def advance(self, step: int, metrics: dict[str, Any]) -> None:
        """Move the progress bar to `step` and show the live reward / accuracy."""
        reward, acc = metrics.get("reward/mean"), metrics.get("accuracy")
        text = " ".join(
            f"{name} {v:.3f}" for name, v in (("reward", reward), ("acc", acc)) if isinstance(v, (int, float))
        )
        if self.progress is not None:
            self.progress.update(self._task, completed=step, description=text)
        elif text:
            self.console.print(f"step {step}: {text}", highlight=False)

    def print(self, *args: Any) -> None:
        self.console.print(*args)

    def completions_table(
        self, step: int, prompts: Sequence[str], completions: Sequence[str], rewards: Sequence[float | None], n: int
    ) -> None:
        """Print up to `n` (prompt, completion, reward) rows."""
        table = Table(title=f"sample completions, step {step}", show_lines=True, expand=True)
        table.add_column("prompt", ratio=2, overflow="fold")
        table.add_column("completion", ratio=3, overflow="fold")
        table.add_column("reward", justify="right")
        for p, c, r in list(zip(prompts, completions, rewards))[:n]:
            table.add_row(p[-200:], c, "error" if r is None else f"{r:.3f}")
        self.console.print(table)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if not self._file.closed:
            self._file.close()
