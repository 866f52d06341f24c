"""Warnings that a run trains on nothing, read from each step's metrics record (`records.step_record`).

Each warning names the likely cause and the setting to change, goes to the console and into the step's record in
metrics.jsonl as `warning/<kind>` (its text), and is rate-limited: shown when its condition first holds, then at
most once every `REPEAT_STEPS` steps while it still holds.

    truncated       most completions of a step were cut at rollout.max_completion_length
    zero_variance   every prompt group had equal rewards (all advantages 0) for `STREAK_STEPS` steps in a row
    constant_reward a reward function gave every sample the same value for `STREAK_STEPS` steps in a row
    no_gradient     rows with non-zero advantages were trained, but no parameter received a gradient
    nonfinite       the loss or the gradient norm was nan/inf, so the optimizer step was skipped
                    (`NONFINITE_STEPS` such steps in a row end the run: `NonFiniteTraining`)

A reward function that returns only None is reported by `metrics.RewardNoneReport` (`RunHealth.reward_none`), filed
under `warning/reward_none/<name>` in the same way. What the warnings remember is saved in each checkpoint, so a
resumed run warns as the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from rich.markup import escape

from logitless.trainer.report.metrics import RewardNoneReport

TRUNCATED_FRACTION = 0.5  # "most" completions truncated
STREAK_STEPS = 3  # steps in a row a zero-variance or constant-reward condition holds before it is reported
REPEAT_STEPS = 20  # a warning that still holds is shown again at most this often
NONFINITE_STEPS = 3  # steps in a row whose every optimizer step was skipped (non-finite) before the run fails


class NonFiniteTraining(RuntimeError):
    """The loss or the gradients were nan/inf in `NONFINITE_STEPS` steps in a row (no weight was changed)."""


class RunHealth:
    """The train-on-nothing warnings of one run; call it with each step's record (all ranks' values, rank 0 prints).
    `emit` prints a console line."""

    def __init__(self, cfg: Any, emit: Callable[[str], None], state: dict[str, Any] | None = None):
        self.cfg, self.emit = cfg, emit
        self.shown: dict[str, int] = {}  # kind -> step it was last shown
        self.zero_var_streak = 0
        self.constant: dict[str, tuple[float, int]] = {}  # reward name -> (its value, steps in a row)
        self.nonfinite_streak = 0
        self.reward_none = RewardNoneReport(emit)  # called by the loop with each step's scores
        if state:
            self.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        """What the warnings remember across steps (JSON), saved in each checkpoint so that a resumed run warns
        exactly as the uninterrupted one."""
        return {"shown": dict(self.shown), "zero_var_streak": self.zero_var_streak,
                "constant": {k: [None if math.isnan(v) else v, n] for k, (v, n) in self.constant.items()},
                "nonfinite_streak": self.nonfinite_streak, "reward_none": sorted(self.reward_none.warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shown = {k: int(v) for k, v in state["shown"].items()}
        self.zero_var_streak, self.nonfinite_streak = int(state["zero_var_streak"]), int(state["nonfinite_streak"])
        self.constant = {k: (math.nan if v is None else float(v), int(n)) for k, (v, n) in state["constant"].items()}
        self.reward_none.warned = set(state["reward_none"])

    def warn(self, step: int, kind: str, text: str) -> dict[str, str]:
        """Emit `text` unless `kind` was shown within REPEAT_STEPS steps; the record entry when shown."""
        last = self.shown.get(kind)
        if last is not None and step - last < REPEAT_STEPS:
            return {}
        self.shown[kind] = step
        again = f" Shown again at most every {REPEAT_STEPS} steps while it holds."
        self.emit(f"[yellow]warning:[/] step {step}: {escape(text)}.{again}")
        return {f"warning/{kind}": text}

    def __call__(self, step: int, record: dict[str, Any]) -> dict[str, str]:
        """The warnings due at `step` (also emitted) as `warning/<kind>` entries for its record. Raises
        `NonFiniteTraining` after NONFINITE_STEPS steps in a row trained nothing because of nan/inf."""
        out: dict[str, str] = {}
        for check in (self.truncated, self.zero_variance, self.constant_rewards, self.no_gradient, self.nonfinite):
            for kind, text in check(step, record):
                out.update(self.warn(step, kind, text))
        return out

    def truncated(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        share = record.get("completion/truncated")
        if not isinstance(share, float) or share <= TRUNCATED_FRACTION:
            return []
        r, o = self.cfg.rollout, self.cfg.objective
        effect = ("objective.mask_truncated_completions=true leaves them out of the loss, so little is trained"
                  if o.mask_truncated_completions else "a cut completion usually has no final answer and scores 0")
        agent = " (or agent.max_turns / agent.max_turn_tokens for episodes)" if self.cfg.agent.enabled else ""
        return [("truncated",
                 f"{share:.0%} of the completions were cut at rollout.max_completion_length={r.max_completion_length} "
                 f"tokens before they ended; {effect}. Raise rollout.max_completion_length{agent}, or ask for shorter "
                 "answers (the prompt, or rollout.stop strings that end an answer)")]

    def zero_variance(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        frac = record.get("zero_variance_groups")
        self.zero_var_streak = self.zero_var_streak + 1 if frac == 1.0 else 0
        if self.zero_var_streak < STREAK_STEPS:
            return []
        mean = record.get("reward/mean")
        level = f" (mean reward {mean:.3g})" if isinstance(mean, float) and math.isfinite(mean) else ""
        return [("zero_variance",
                 f"every prompt group got {self.cfg.rollout.num_generations} equal rewards{level} in each of the last "
                 f"{self.zero_var_streak} steps, so every advantage was 0 and nothing was trained. Likely: the task is "
                 "too hard (every reward 0) or too easy (every reward 1) for the model, or the reward ignores the "
                 "completion. Change the data (data.task / data.options), sample more or more diverse completions "
                 "(rollout.num_generations, rollout.temperature), or set train.dynamic_sampling=true")]

    def constant_rewards(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        out = []
        names = [k[len("reward/"):-len("/std")] for k in record
                 if k.startswith("reward/") and k.endswith("/std") and k != "reward/std"]
        for name in names:
            mean, std = record.get(f"reward/{name}/mean"), record.get(f"reward/{name}/std")
            same = isinstance(std, float) and std == 0.0 and isinstance(mean, float) and math.isfinite(mean)
            value, streak = self.constant.get(name, (math.nan, 0))
            streak = streak + 1 if same and mean == value else (1 if same else 0)
            self.constant[name] = (mean if same else math.nan, streak)
            if streak >= STREAK_STEPS:
                out.append((f"constant_reward/{name}",
                            f"reward function '{name}' gave every sample the same value {mean:.4g} in each of the last "
                            f"{streak} steps, so it adds nothing to any advantage. Check that it scores the completion "
                            "(its second argument) and reads the row fields it needs; a correctness reward stuck at 0 "
                            "means the model never solves the task (easier data, a longer "
                            "rollout.max_completion_length). Remove it from reward.reward_funcs if it is meant to be "
                            "constant"))
        return out

    def no_gradient(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        norm, rows = record.get("grad_norm"), record.get("trained_rows")
        informative = record.get("zero_variance_groups", 1.0) < 1.0
        if norm != 0.0 or not rows or not informative or record.get("train/nonfinite_skipped"):
            return []
        which = (f"the LoRA adapters of model.lora_target_modules={self.cfg.model.lora_target_modules!r}"
                 if self.cfg.model.lora else "the trainable parameters")
        return [("no_gradient",
                 f"{int(rows)} rows with non-zero advantages were trained, but no parameter received a gradient "
                 f"(grad_norm 0): {which} do not reach the loss. Adapt modules the model's forward uses "
                 "(model.lora_target_modules=all-linear), and check that a model passed in is not frozen or detached")]

    def nonfinite(self, step: int, record: dict[str, Any]) -> list[tuple[str, str]]:
        skipped = int(record.get("train/nonfinite_skipped") or 0)
        steps = self.cfg.train.num_iterations * self.cfg.train.steps_per_rollout
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped >= steps else 0
        if not skipped:
            return []
        o, m = self.cfg.optim, self.cfg.model
        cause = (f"the loss or the gradient norm was nan or infinite in {skipped} of this step's {steps} optimizer "
                 "step(s), which were skipped (the weights and optimizer state are unchanged, no checkpoint holds "
                 f"nan). Likely: optim.learning_rate={o.learning_rate} too high"
                 + ("" if o.max_grad_norm is not None else ", optim.max_grad_norm=null (no clipping)")
                 + (f", model.dtype={m.dtype} overflowing (use bfloat16 or float32)" if m.dtype == "float16" else "")
                 + ", or a reward with extreme values; lower optim.learning_rate or set optim.max_grad_norm")
        if self.nonfinite_streak >= NONFINITE_STEPS:
            raise NonFiniteTraining(f"step {step}: {self.nonfinite_streak} steps in a row trained nothing: {cause}. "
                                    "The run stops; the latest checkpoint holds the last finite weights")
        return [("nonfinite", cause)]


REFERENCE_FIELDS = ("solution", "completion", "response", "reference")  # row fields holding a reference answer
BYTES_PER_TOKEN = 3.0  # bytes per token of a BPE tokenizer on English with numbers, low side (without a tokenizer)


def estimate_truncation(rows: Sequence[Any], max_completion_length: int, tokenizer: Any = None) -> tuple[str, float] | None:
    """(a line for --dry-run, the share of rows) estimating how many completions `rollout.max_completion_length`
    would cut: the share of `rows` whose reference answer (the first row field of REFERENCE_FIELDS they hold as
    text, e.g. GSM8K's worked `solution`) is longer than that many tokens (counted with `tokenizer`, else estimated
    from its bytes). None when the rows hold no reference answer."""
    field = next((f for f in REFERENCE_FIELDS if rows and all(isinstance(r.fields.get(f), str) for r in rows)), None)
    if field is None:
        return None
    texts = [r.fields[field] for r in rows]
    if tokenizer is not None:
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        how = "tokens"
    else:
        lengths = [math.ceil(len(t.encode("utf-8")) / BYTES_PER_TOKEN) for t in texts]
        how = f"tokens, estimated at {BYTES_PER_TOKEN:g} bytes per token"
    share = sum(n > max_completion_length for n in lengths) / len(lengths)
    lengths.sort()
    line = (f"truncation estimate: {share:.0%} of the first {len(rows)} rows' reference answers (row field "
            f"'{field}': median {lengths[len(lengths) // 2]}, longest {lengths[-1]} {how}) are longer than "
            f"rollout.max_completion_length={max_completion_length}")
    return line, share
