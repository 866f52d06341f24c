"""The run's config files, and a resumed run's config against them: what may change freely, and what changes
what is trained.

`config.yaml` holds the config a run started with. A resume with changed settings (`--allow-config-change`) keeps
it and writes the new config beside it as `config.from-step-000021.yaml` (the first step it trains);
`current_config(run)` is the newest of them, which a checkpoint copies and a later `--resume` continues with.

A resume may change how long and where the run goes and what it logs: `train.max_steps` (unless the learning-rate
schedule depends on it: cosine decay or `optim.warmup_ratio`), `train.max_minutes`, `train.output_dir`,
`train.num_threads`, `train.memory_budget_gib` (the memory plan of the new device), `rollout.num_threads`,
`rollout.profile`, `model.device` and every key of `logging`,
`checkpoint` and `eval` (and `train.fsdp_offload`, whose checkpoint layout is checked on its own). Any other
change would train the next steps unlike the earlier ones, so it is refused unless allowed
(`--allow-config-change`; `rundir.claim_run_dir` keeps the run's config and saves the new one beside it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from logitless.configlib import to_dict
from logitless.trainer.config.schema import OptimConfig, TrainerConfig

RUN_CONFIG = "config.yaml"
CHANGED_CONFIG_PREFIX, CHANGED_CONFIG_SUFFIX = "config.from-step-", ".yaml"  # config.from-step-000021.yaml


def changed_config_name(from_step: int) -> str:
    """File name of a config that applies from step `from_step` on (a resume with changed settings)."""
    return f"{CHANGED_CONFIG_PREFIX}{from_step:06d}{CHANGED_CONFIG_SUFFIX}"


def config_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(first step, file) of each config of run folder `run_dir`, oldest first: config.yaml (step 1), then each
    config.from-step-N.yaml."""
    run_dir = Path(run_dir)
    out = [(1, run_dir / RUN_CONFIG)] if (run_dir / RUN_CONFIG).is_file() else []
    for f in run_dir.glob(f"{CHANGED_CONFIG_PREFIX}*{CHANGED_CONFIG_SUFFIX}"):
        digits = f.name[len(CHANGED_CONFIG_PREFIX):-len(CHANGED_CONFIG_SUFFIX)]
        if digits.isdigit() and f.is_file():
            out.append((int(digits), f))
    return sorted(out)


def current_config(run_dir: str | Path) -> Path | None:
    """The config a run trains with now: its newest config file, None when it has none."""
    files = config_files(run_dir)
    return files[-1][1] if files else None


# train.fsdp_offload changes how a checkpoint is laid out, which `dcp.check_layout` refuses with its own fix
FREE_KEYS = ("train.max_minutes", "train.output_dir", "train.num_threads", "rollout.num_threads", "rollout.profile",
             "model.device", "train.fsdp_offload", "train.memory_budget_gib", "train.collective_timeout_s")
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
