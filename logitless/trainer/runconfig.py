"""A resumed run's config against the run's own: what may change freely, and what changes what is trained.

A resume may change how long and where the run goes and what it logs: `train.max_steps` (unless the learning-rate
schedule depends on it: cosine decay or `optim.warmup_ratio`), `train.max_minutes`, `train.output_dir`,
`train.num_threads`, `rollout.num_threads`, `rollout.profile`, `model.device` and every key of `logging`,
`checkpoint` and `eval` (and `train.fsdp_offload`, whose checkpoint layout is checked on its own). Any other change would train the next steps unlike the earlier ones, so it is refused
unless allowed (`--allow-config-change`; `rundir.claim_run_dir` keeps the run's config and saves the new one
beside it).
"""

from __future__ import annotations

from typing import Any

from logitless.configlib import to_dict
from logitless.trainer.config import OptimConfig, TrainerConfig

# train.fsdp_offload changes how a checkpoint is laid out, which `dcp.check_layout` refuses with its own fix
FREE_KEYS = ("train.max_minutes", "train.output_dir", "train.num_threads", "rollout.num_threads", "rollout.profile",
             "model.device", "train.fsdp_offload")
FREE_SECTIONS = ("logging.", "checkpoint.", "eval.")
_ABSENT = "(not set)"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested config dict (dict-valued keys such as data.options flattened too)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: TrainerConfig, now: TrainerConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) of every key that differs, in the schema's order."""
    a, b = _flat(to_dict(saved)), _flat(to_dict(now))
    keys = list(b) + [k for k in a if k not in b]
    return [(k, a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in keys if a.get(k, _ABSENT) != b.get(k, _ABSENT)]


def schedule_uses_max_steps(optim: OptimConfig) -> bool:
    """True when the learning rate of a step depends on train.max_steps (cosine decay, or warmup by ratio)."""
    return optim.lr_scheduler_type != "constant" or (optim.warmup_steps == 0 and optim.warmup_ratio > 0)


def changes_training(key: str, cfg: TrainerConfig) -> bool:
    """True when a change of `key` would train the next steps unlike the earlier ones (see the module doc)."""
    if key == "train.max_steps":
        return schedule_uses_max_steps(cfg.optim)
    return not (key in FREE_KEYS or key.startswith(FREE_SECTIONS))


def describe(diffs: list[tuple[str, Any, Any]]) -> str:
    """One indented line per difference: `key: saved -> new`."""
    return "".join(f"\n  {k}: {old!r} -> {new!r}" for k, old, new in diffs)
