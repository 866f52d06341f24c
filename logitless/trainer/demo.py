"""The embedded CPU demo: `logitless train` / `logitless eval` without a config file."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from logitless.configlib import apply_overrides, from_dict
from logitless.trainer.config.schema import TrainerConfig

# The embedded CPU demo (`logitless train` without a config file): LoRA-GRPO on SmolLM2-135M-Instruct learning
# two-digit addition/subtraction. Raw-text prompt with one worked example; the completion stops at the end of
# the line. Measured in a fresh clone on 2 CPU cores: held-out greedy accuracy 14.5% -> 41.5% (200 test
# prompts), 38 steps in 9 minutes of training (bench/results/demo_cpu.json).
DEMO: dict[str, Any] = {
    "model": {"name_or_path": "", "lora": True, "lora_r": 16, "lora_alpha": 32, "lora_target_modules": "all-linear"},
    "data": {
        "task": "arithmetic",
        "options": {
            "difficulty": 2,  # two 2-digit numbers, + or -
            "n": 2000,
            "chat": False,
            "system_prompt": None,
            "template": "12 + 30 = 42\n{expression} =",
        },
    },
    "reward": {"reward_funcs": ["numeric_answer"]},
    "rollout": {"num_generations": 8, "max_completion_length": 8, "temperature": 1.0, "stop": ["\n"], "num_threads": 1},
    "objective": {"loss_type": "dapo", "beta": 0.0},
    "optim": {"learning_rate": 3e-4, "lr_scheduler_type": "constant", "warmup_steps": 0},
    # One CPU thread: LoRA forward/backward and decoding are many small ops, which stall badly when a busy
    # machine deschedules one of several OpenMP threads.
    "train": {
        "max_steps": 40, "prompts_per_step": 16, "micro_batch_size": 32, "max_minutes": 9.0, "num_threads": 1,
        "output_dir": "runs/demo",
    },
    "checkpoint": {"save_steps": 10},
    "eval": {"num_prompts": 200},
}


def _yaml_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # apply_overrides reports it


def demo_config(overrides: list[str] | tuple[str, ...] = ()) -> TrainerConfig:
    """The embedded CPU demo's config (`DEMO` over the defaults), then `section.key=value` overrides.

    An override of `data.task` to another task starts from that task's own defaults: the demo's arithmetic
    options (difficulty, template, ...) are dropped, and only `data.options.*` given as overrides apply.
    """
    base = copy.deepcopy(DEMO)
    for item in overrides:
        key, _, raw = item.partition("=")
        if key.strip() == "data.task" and _yaml_value(raw) != DEMO["data"]["task"]:
            base["data"].pop("options", None)
            base["data"].pop("eval_options", None)
    return from_dict(TrainerConfig, apply_overrides(TrainerConfig, base, list(overrides)))
