"""Episode traces: a sample of each step's episodes, written whole to `episodes.jsonl` in the run folder.

One JSON line per traced episode (`agent.trace_episodes` per step; 0 = none), with the step, the prompt, the
conversation after it (`EpisodeRecord.messages`: assistant turns with their parsed tool calls, tool results,
environment messages), the episode's counts, its own reward and per-turn rewards, each reward function's score,
the weighted total and the advantage. The episodes are spread evenly over the step's rows (on rank 0: its own rows
under torchrun), a function of the row count alone, so a resumed run traces the rows of the uninterrupted one.

A step's lines are appended with one write and flushed; a resumed run drops the lines of steps after its
checkpoint, as metrics.jsonl does. `logitless eval --output F.json` writes its sample to `F.episodes.jsonl`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

TRACES_FILE = "episodes.jsonl"


def traced_rows(num_rows: int, n: int) -> list[int]:
    """`n` row indices spread evenly over `num_rows` rows (all of them when n >= num_rows), ascending."""
    if n <= 0 or num_rows <= 0:
        return []
    if n >= num_rows:
        return list(range(num_rows))
    return [(i * num_rows) // n for i in range(n)]


def episode_trace(row: Any, record: Any, rewards: dict[str, float | None], total: float | None,
                  advantage: float | None = None, turn_advantages: list[float] | None = None) -> dict[str, Any]:
    """One episode as a trace line (without its step): the row's prompt (and answer, if any), the record's
    conversation and counts, its own reward and per-turn rewards, the reward functions' scores and total (None
    where NaN), and the advantage (training only; with advantage.credit=turn also each model turn's)."""
    line: dict[str, Any] = {"prompt": row.prompt}
    if "answer" in row.fields:
        line["answer"] = row.fields["answer"]
    line.update(messages=list(record.messages), turns=record.turns, tool_calls=record.tool_calls,
                tool_errors=record.tool_errors, truncated=bool(record.truncated),
                episode_reward=record.reward, turn_rewards=list(record.turn_rewards), rewards=rewards,
                reward=total, metrics=dict(record.metrics))
    if advantage is not None:
        line["advantage"] = advantage
    if turn_advantages is not None:
        line["turn_advantages"] = turn_advantages
    return line


def batch_traces(picked: Sequence[int], sample_rows: Sequence[Any], episodes: Sequence[Any], names: Sequence[str],
                 rewards: Any, totals: Any, advantages: Any = None, first: int = 0,
                 turn_advantages: Any = None, num_turns: Any = None) -> list[dict[str, Any]]:
    """The trace lines of rows `picked` (e.g. `traced_rows`) of one rollout: `rewards` [B, R] and `totals` [B]
    (tensors or lists), `advantages` [B] or None, `turn_advantages` [B, K] with `num_turns` [B] (advantage.credit=
    turn) or None; each line's `sample` is its row + `first`."""
    rewards = rewards.tolist() if hasattr(rewards, "tolist") else rewards
    totals = totals.tolist() if hasattr(totals, "tolist") else totals
    advantages = advantages.tolist() if hasattr(advantages, "tolist") else advantages
    lines = []
    for b in picked:
        scores = {name: _finite(v) for name, v in zip(names, rewards[b])}
        turns = None if turn_advantages is None else [float(a) for a in turn_advantages[b][: int(num_turns[b])]]
        line = episode_trace(sample_rows[b], episodes[b], scores, _finite(totals[b]),
                             None if advantages is None else float(advantages[b]), turns)
        lines.append({"sample": first + b, **line})
    return lines


def _finite(v: float) -> float | None:
    return None if v is None or math.isnan(v) else float(v)


def trace_text(step: int | None, lines: Sequence[dict[str, Any]]) -> str:
    """The JSON lines of `lines`, each led by its step (values JSON cannot hold, e.g. a tool's set, as text)."""
    return "".join(json.dumps({"step": step, **line}, default=str) + "\n" for line in lines)


class EpisodeTraces:
    """Appends each step's trace lines to `<run_dir>/episodes.jsonl`. `resume_step`: lines of later steps are
    dropped (a resumed run writes them again); 0: a new run, any earlier file is replaced, by `write_atomic(path,
    text)` (the run folder's atomic write, `trainer/rundir.py`)."""

    def __init__(self, run_dir: str | Path, n: int, resume_step: int,
                 write_atomic: Callable[[Path, str], None]) -> None:
        self.path, self.n = Path(run_dir) / TRACES_FILE, n
        if self.path.is_file():
            kept = [line for line in self.path.read_text(errors="replace").splitlines()
                    if resume_step and _step_of(line) <= resume_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, lines: Sequence[dict[str, Any]]) -> None:
        """Append the step's lines with one write, flushed."""
        if not lines:
            return
        text = trace_text(step, lines)
        try:
            with open(self.path, "a") as f:
                f.write(text)
                f.flush()
        except OSError as e:
            raise RuntimeError(f"could not write step {step}'s episode traces to {self.path} ({e}); free space or "
                               "make the run folder writable, or set agent.trace_episodes=0") from None


def _step_of(line: str) -> int:
    """The step of a trace line (a damaged line counts as after every step: it is dropped on resume)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62
