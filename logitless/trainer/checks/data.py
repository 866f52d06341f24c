"""Checks of the data against the run's rewards, on the split's first rows, before the model loads.

Each reward function names the row fields it reads (`logitless.rewards.reward_row_fields`: `answer` for
numeric_answer and math_verify, `tests` for code_tests, the parameters without a default of your own function);
every one of the first `FIRST_ROWS` rows must have them, or the run is refused naming the reward, the field, the
row's fields and the data option that maps a column onto it. With agent.tools_field, every row's tool set is
checked against the agent's tools (`check_row_tools`).
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Callable

from logitless.data import PromptRow
from logitless.rewards import reward_row_fields
from logitless.trainer.config.schema import TrainerConfig

FIRST_ROWS = 64  # rows read from the start of the split for the check (a file stops reading there)


def _fix(task: str, field: str) -> str:
    """The data option that puts a column into the row field `field`."""
    if task in ("jsonl", "hub"):
        mapping = ("data.options.answer_field=<column>" if field == "answer"
                   else f"data.options.field_map={{{field}: <column>}}")
        return f"Name the column that holds it: {mapping}, or choose rewards that read fields the data has"
    return f"data.task={task!r} gives its rows no '{field}': choose rewards that read the fields it has"


def check_reward_fields(cfg: TrainerConfig, specs: list[str], fns: list[Callable[..., Any]], rows: list[PromptRow],
                        split: str) -> str:
    """Refuse a reward whose row fields are missing from any of `rows` (the split's first rows); warn when every one
    of them holds None there (the reward would be None, "not applicable", for all of them). Returns what was
    checked."""
    where = f"data.task={cfg.data.task!r} split {split!r}"
    read = []
    for spec, fn in zip(specs, fns):
        fields = reward_row_fields(fn)
        read += [f"{spec}: {', '.join(fields)}"] if fields else []
        for field in fields:
            missing = next((i for i, r in enumerate(rows) if field not in r.fields), None)
            if missing is not None:
                have = sorted(rows[missing].fields)
                close = difflib.get_close_matches(field, have, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(
                    f"reward.reward_funcs: '{spec}' reads the row field '{field}', which row {missing} of {where} does "
                    f"not have (its fields: {', '.join(have) or 'none'}){hint}. {_fix(cfg.data.task, field)}"
                )
            if all(r.fields[field] is None for r in rows):
                warnings.warn(
                    f"reward '{spec}' reads the row field '{field}', which is None in all of the first {len(rows)} "
                    f"rows of {where}: the reward is None ('not applicable') for them, and a sample no reward "
                    "scores adds nothing to training", stacklevel=2,
                )
    if not read:
        return f"{where}: no reward reads a row field by name ({len(rows)} rows read)"
    return f"{where}: the first {len(rows)} rows have the fields the rewards read ({'; '.join(read)})"


def check_row_tools(cfg: TrainerConfig, agent: Any, training: bool, load_rows: Callable[..., list[PromptRow]]) -> str:
    """Refuse a row whose agent.tools_field is missing, not a list of tool names, or names a tool `agent` does not
    have, naming the row, the field and the fix; reads (`load_rows(data_cfg, split, eval=...)`, the trainer's) every
    row of the split the run uses (and the eval rows a training run evaluates on), before the weights load. Returns
    what was checked."""
    sources = []
    if training:
        sources.append((cfg.data.split, False, None))
    if not training or cfg.eval.every_steps or cfg.eval.on_start:
        sources.append((cfg.eval.split or cfg.data.eval_split, True, cfg.eval.num_prompts))
    said = []
    for split, is_eval, limit in sources:
        rows = load_rows(cfg.data, split, eval=is_eval)[:limit]
        sets = agent.row_tools.check_rows(rows, f"data.task={cfg.data.task!r} split {split!r}")
        said.append(f"{len(rows)} rows of split {split!r} ({sets} distinct tool sets)")
    return f"agent.tools_field={cfg.agent.tools_field!r}: every row names configured tools: {'; '.join(said)}"
