"""Prompt datasets: rows, loaders (JSONL / Hugging Face datasets), built-in tasks and a resumable sampler."""

from logitless.data.prompts import (
    PromptRow,
    format_prompt,
    load_hf_prompts,
    load_jsonl_prompts,
    read_jsonl,
    records_to_rows,
)
from logitless.data.sampler import PromptSampler
from logitless.data.tasks import (
    ARITH_LEVELS,
    GSM8K_SAMPLE,
    TASKS,
    arithmetic,
    gsm8k,
    gsm8k_answer,
    load_task,
    register_task,
)

__all__ = [
    "ARITH_LEVELS",
    "GSM8K_SAMPLE",
    "PromptRow",
    "PromptSampler",
    "TASKS",
    "arithmetic",
    "format_prompt",
    "gsm8k",
    "gsm8k_answer",
    "load_hf_prompts",
    "load_jsonl_prompts",
    "load_task",
    "read_jsonl",
    "records_to_rows",
    "register_task",
]
