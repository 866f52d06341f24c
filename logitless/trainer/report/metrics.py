"""Logging sinks of the trainer: metrics JSONL, experiment trackers (`tracking.py`: TensorBoard, W&B, Trackio), a rich
progress bar, sample tables.

Only the trainer (rank 0) writes; math modules return metrics as plain dicts of floats.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

if TYPE_CHECKING:
    from logitless.trainer.config.schema import TrainerConfig

METRICS_FILE = "metrics.jsonl"


def _clean(v: Any) -> Any:
    """JSON-safe scalar: tensors -> Python numbers, NaN/inf -> None (JSON has no NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of each record of a metrics file. A half-written last line (a run killed mid-write) is
    dropped with a warning naming the file; a bad line elsewhere is an error naming the file and line."""
    lines = [(i, line) for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    out = []
    for k, (i, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not a record")
        except ValueError as e:
            if k == len(lines) - 1:
                warnings.warn(f"{path}: dropping its last line {i}, which is incomplete (a run stopped while "
                              f"writing it): {line[:80]!r}", stacklevel=3)
                break
            raise ValueError(f"{path} line {i} is not a JSON record ({e}); fix or delete that line (a record is "
                             "one JSON object per line), then run again") from None
        out.append((line, record))
    return out


def check_metrics_file(path: Path) -> None:
    """Raise ValueError naming the file and line of a damaged record of a metrics file other than its last (which
    a resume drops): checked when a run is claimed for --resume, before the model loads."""
    if path.is_file():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the last line's warning comes when the logger drops it
            _parse_lines(path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of `<run_dir>/metrics.jsonl` (one dict per logged step)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: is it the output_dir of a `logitless train` run?")
    return [record for _, record in _parse_lines(path)]



class RewardErrorReport:
    """Console warnings, with the exception text, for reward functions that raise (or run past reward.timeout_s)
    under reward.on_error=penalty.

    The first error of each function is shown at once; later ones at most once per `interval_s` seconds, with
    the count of failed samples since the last warning (so a function that always raises cannot flood the log).
    """

    def __init__(self, emit: Callable[[str], None], penalty: float, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.emit, self.penalty, self.interval_s, self.clock = emit, penalty, interval_s, clock
        self._last: dict[str, float] = {}  # function name -> time of its last warning
        self._pending: dict[str, tuple[int, int]] = {}  # name -> (failed, scored) samples not yet reported

    def __call__(self, step: int, names: Sequence[str], num_errors: Sequence[int], error_texts: Sequence[str | None],
                 num_samples: int) -> None:
        for name, n, text in zip(names, num_errors, error_texts):
            if not n:
                continue
            failed, scored = self._pending.get(name, (0, 0))
            failed, scored = failed + n, scored + num_samples
            now = self.clock()
            if name in self._last and now - self._last[name] < self.interval_s:
                self._pending[name] = (failed, scored)
                continue
            self._last[name], self._pending[name] = now, (0, 0)
            self.emit(
                f"[yellow]warning:[/] step {step}: reward function '{escape(name)}' failed on {failed} of {scored} "
                f"samples (scored reward.error_penalty={self.penalty}): {escape(str(text))[:500]}. Set "
                f"reward.on_error=raise to stop at the first error; repeats are shown at most every "
                f"{self.interval_s:.0f} s."
            )


def mismatch_causes(cfg: TrainerConfig) -> str:
    """What in this run's settings can make the sampler's logprobs differ from the trainer's, each with its fix
    (for `MismatchReport`), most likely first."""
    r, causes = cfg.rollout, []
    if r.fp8:
        causes.append("rollout.fp8=true samples from FP8 weights and activations (rollout/fp8.py), whose rounding "
                      "moves every logprob: expected (the IS weights correct for it), or set rollout.fp8=false to "
                      "sample in the model's dtype")
    if cfg.train.async_rollout:
        causes.append("train.async_rollout=true samples each step from the policy one optimizer step before, so "
                      "the gap includes the last update (it grows with optim.learning_rate); expected, correct for it "
                      "with objective.sampler_is_mode, or set train.async_rollout=false")
    if r.backend == "static":
        causes.append("rollout.backend=static decodes with its own compiled forward, which can round bf16 "
                      "differently: run a step with rollout.backend=hf (transformers' eager forward); if the mismatch "
                      "drops there, the compiled decode is the cause and rollout.backend=hf avoids it")
        if cfg.model.lora and r.merge_lora is not False:
            causes.append("the static engine decodes LoRA from merged weights W + BA rounded to the model's dtype "
                          "(QLoRA: dequantized first) while the trainer computes W x + B A x; rollout.merge_lora=false "
                          "decodes the adapters unmerged")
    else:
        causes.append(f"rollout.backend={r.backend} runs the model's forward with its own attention and caching; "
                      "check model.attn_implementation and model.dtype")
    fix = ("objective.sampler_is_mode (e.g. token_truncate) corrects the update for it by importance weights" if
           cfg.objective.sampler_is is None else
           f"objective.sampler_is_mode={cfg.objective.sampler_is_mode} already corrects the update for it")
    return "; ".join(causes) + f". Whatever the cause, {fix} (is/ratio shows the weights)"


class MismatchReport:
    """A console warning when the sampler drifts from the policy: `rollout/mismatch_mean` of a step above
    `threshold` (logging.mismatch_warning), the first time, then again whenever it reaches twice the value last
    warned about. `causes`: `mismatch_causes` of the run."""

    def __init__(self, emit: Callable[[str], None], threshold: float | None, causes: str):
        self.emit, self.threshold, self.causes = emit, threshold, causes
        self.warned: float | None = None  # the mean of the last warning

    def __call__(self, step: int, record: dict[str, Any]) -> bool:
        """Warn if due for this step's record; True when it warned."""
        mean = record.get("rollout/mismatch_mean")
        if self.threshold is None or mean is None or not math.isfinite(mean) or mean <= self.threshold:
            return False
        if self.warned is not None and mean < 2 * self.warned:
            return False
        again = "" if self.warned is None else f" (up from {self.warned:.3g} when last reported)"
        self.warned = mean
        self.emit(
            f"[yellow]warning:[/] step {step}: the sampler's logprobs differ from the trainer's by {mean:.3g} nats "
            f"per token on average{again} (max {record.get('rollout/mismatch_max', math.nan):.3g}, KL "
            f"{record.get('rollout/mismatch_kl', math.nan):.3g}), above logging.mismatch_warning={self.threshold} "
            f"(bf16 rounding alone gives about 0.005-0.02). The samples are then not quite the policy's, which can "
            f"make a run drift or collapse. Likely: {escape(self.causes)}. Shown again if it doubles."
        )
        return True


class MetricsLogger:
    """Writes one JSON record per logged step to `<run_dir>/metrics.jsonl` and mirrors its scalars, under the same
    names, to each tracker (`tracking.Tracker`; `tensorboard=True` without `trackers` opens TensorBoard when installed).

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
        trackers: list[Any] | None = None,
        write_error: Callable[[OSError], str] = str,  # what a failed write of a record says (and what to do)
    ):
        self.run_dir = Path(run_dir)
        self.write_error = write_error
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        kept = []
        if self.path.is_file() and resume_step:
            kept = [line for line, record in _parse_lines(self.path) if record.get("step", 0) <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")
        self.console = console or Console(stderr=True)
        if trackers is None:
            from logitless.trainer.report.tracking import open_trackers

            trackers = open_trackers(["tensorboard"] if tensorboard else [], self.run_dir, config={}, project="",
                                     run_name=None, options={}, resume_step=resume_step, required=False)
        self.trackers = list(trackers)
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
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk, a folder made read-only: one line naming the file and what to do
            raise RuntimeError(f"could not write step {step}'s record to {self.path}: {self.write_error(e)}") from None
        if self.trackers:
            from logitless.trainer.report.tracking import scalars

            values = scalars(record)
            for tracker in self.trackers:
                tracker.log(step, values)

    def advance(self, step: int, metrics: dict[str, Any]) -> None:
        """Move the progress bar to `step` and show the live reward / accuracy / sampler-trainer mismatch (and
        turns per episode and tool calls, for multi-turn episodes)."""
        shown = (("reward", "reward/mean", 3), ("acc", "accuracy", 3), ("turns", "episode/turns_mean", 2),
                 ("tools", "episode/tool_calls_mean", 2),
                 ("mismatch", "rollout/mismatch_mean", 3))  # nats per token, sampler vs trainer
        text = " ".join(f"{name} {metrics[key]:.{digits}f}" for name, key, digits in shown
                        if isinstance(metrics.get(key), (int, float)))
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
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()
        if not self._file.closed:
            self._file.close()


class RewardNoneReport:
    """A console warning, once per reward function and run, the first time a function returns None for every
    sample of a step. None means "not applicable to this sample": the sample gets nothing from that function, and a
    step where every function does so has all advantages 0 and trains nothing. The warning names the row fields
    the samples had, the usual cause being a field the function reads that is missing or None in the data."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit = emit
        self.warned: set[str] = set()  # the functions warned about

    def __call__(self, step: int, names: Sequence[str], num_none: Sequence[int], num_samples: int,
                 row_fields: Sequence[str]) -> dict[str, str]:
        """Emit the warnings due; returns them as `warning/reward_none/<name>` entries of the step's record."""
        every = num_samples > 0 and all(n == num_samples for n in num_none)
        out = {}
        for name, n in zip(names, num_none):
            if num_samples == 0 or n < num_samples or name in self.warned:
                continue
            self.warned.add(name)
            effect = ("every reward function did, so every advantage is 0 and this step trained nothing" if every else
                      "the other reward functions alone decide these samples' advantages")
            text = (
                f"reward function '{name}' returned None for all {num_samples} samples. None means 'not applicable "
                f"to this sample' and adds nothing; {effect}. Check the row fields it reads (these rows have: "
                f"{', '.join(row_fields) or 'none'}; numeric_answer and math_verify give None where the row's answer "
                "is None or unparseable) and that it returns a number for the samples it can judge"
            )
            self.emit(f"[yellow]warning:[/] step {step}: {escape(text)}. Shown once per reward function.")
            out[f"warning/reward_none/{name}"] = text
        return out


def reward_metrics(rewards: torch.Tensor, total: torch.Tensor, names: list[str], acc_col: int | None) -> dict[str, float]:
    """Mean/std of each reward function [B, R] and of the weighted total [B]; accuracy = share of samples whose
    accuracy reward is 1 (samples it could not score count as wrong), left out without an accuracy reward
    (`acc_col` None: builders.training_accuracy_index)."""
    out: dict[str, float] = {"reward/mean": float(total.mean()), "reward/std": float(total.std(unbiased=False))}
    for k, name in enumerate(names):
        col = rewards[:, k]
        ok = col[~torch.isnan(col)]
        out[f"reward/{name}/mean"] = float(ok.mean()) if ok.numel() else math.nan
        out[f"reward/{name}/std"] = float(ok.std(unbiased=False)) if ok.numel() else math.nan
    if acc_col is not None:
        out["accuracy"] = float((rewards[:, acc_col] == 1.0).float().mean())
    return out
