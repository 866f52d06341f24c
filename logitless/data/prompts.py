"""Prompt rows from JSONL files or Hugging Face datasets.

A `PromptRow` holds the prompt (raw text, or chat messages for a chat template) and the row's other fields,
which the trainer passes to reward functions as keyword lists (e.g. `answer=[...]`).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

Messages = list[dict[str, str]]


@dataclass
class PromptRow:
    prompt: str | Messages  # raw text, or chat messages [{"role": ..., "content": ...}, ...]
    fields: dict[str, Any] = field(default_factory=dict)  # e.g. {"answer": "42"}, passed to reward functions


def template_fields(template: str) -> list[str]:
    """Names of the `{placeholder}` fields of a str.format template."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as e:
        raise ValueError(
            f"template {template!r} is not a valid str.format template ({e}); write {{{{ for a literal '{{'"
        ) from e


def format_prompt(
    text: str, *, system_prompt: str | None = None, chat: bool = True
) -> str | Messages:
    """Chat messages `[system?, user]` (chat=True) or raw text `system_prompt + "\\n\\n" + text` (chat=False)."""
    if chat:
        messages: Messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return messages + [{"role": "user", "content": text}]
    return f"{system_prompt}\n\n{text}" if system_prompt else text


def _check_messages(value: Any, where: str) -> Messages:
    if not value or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise ValueError(
            f"{where}: chat prompt must be a non-empty list of {{'role', 'content'}} dicts, got {value!r:.200}"
        )
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]


def records_to_rows(
    records: Iterable[dict[str, Any]],
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    field_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    template: str | None = None,
    chat: bool = True,
    source: str = "dataset",
) -> list[PromptRow]:
    """Prompt rows from dict records.

    - the prompt text is `record[prompt_field]`, or `template.format(**record)` when a template is given
      (placeholders name record fields, e.g. "Question: {question}\\nAnswer:");
    - a record prompt that already is a list of chat messages is kept as is (a system prompt is prepended
      unless it already starts with one);
    - row fields are all record fields except the prompt field, plus `field_map` renames
      `{row_field: record_field}`; `answer_field="x"` is shorthand for `field_map={"answer": "x"}`.
    """
    field_map = dict(field_map or {})
    if answer_field is not None:
        field_map.setdefault("answer", answer_field)
    placeholders = template_fields(template) if template is not None else []
    rows: list[PromptRow] = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"{source}: row {i} is {type(rec).__name__}, expected a JSON object")
        needed = placeholders if template is not None else [prompt_field]
        needed = needed + [src for src in field_map.values() if src not in needed]
        for name in needed:
            if name not in rec:
                what = "template placeholder" if name in placeholders else (
                    "prompt_field" if name == prompt_field else "field_map/answer_field source")
                raise ValueError(
                    f"{source}: row {i} has no field '{name}' (needed as {what}); available fields: "
                    f"{sorted(rec)}. Set prompt_field/answer_field/field_map/template to existing fields."
                )
        raw = rec[prompt_field] if template is None else None
        if isinstance(raw, list):
            messages = _check_messages(raw, f"{source}: row {i} field '{prompt_field}'")
            if system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system_prompt}] + messages
            prompt: str | Messages = messages if chat else "\n\n".join(m["content"] for m in messages)
        else:
            text = template.format(**rec) if template is not None else raw
            if not isinstance(text, str):
                raise ValueError(f"{source}: row {i} field '{prompt_field}' is {type(text).__name__}, expected text")
            prompt = format_prompt(text, system_prompt=system_prompt, chat=chat)
        fields = {k: v for k, v in rec.items() if k != prompt_field or template is not None}
        for row_name, src in field_map.items():
            fields[row_name] = rec[src]
        rows.append(PromptRow(prompt=prompt, fields=fields))
    if not rows:
        raise ValueError(f"{source} has no rows; check the path/split and filters")
    return rows


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (blank lines skipped); errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file '{p}' does not exist")
    out = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt file '{p}' line {lineno} is not valid JSON: {e}") from e
    return out


def load_jsonl_prompts(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    field_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    template: str | None = None,
    chat: bool = True,
    limit: int | None = None,
) -> list[PromptRow]:
    """Prompt rows of a JSON-lines file (see `records_to_rows` for the field options)."""
    return records_to_rows(
        read_jsonl(path, limit), prompt_field, answer_field, field_map, system_prompt, template, chat,
        source=f"prompt file '{path}'",
    )


def load_hf_prompts(
    name: str,
    split: str = "train",
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    field_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    template: str | None = None,
    chat: bool = True,
    limit: int | None = None,
    config_name: str | None = None,
    **load_kwargs: Any,
) -> list[PromptRow]:
    """Prompt rows of a Hugging Face dataset: `datasets.load_dataset(name, config_name, split=split, **load_kwargs)`."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"loading the dataset '{name}' needs the `datasets` package: pip install datasets") from e
    ds = datasets.load_dataset(name, config_name, split=split, **load_kwargs)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return records_to_rows(
        iter(ds), prompt_field, answer_field, field_map, system_prompt, template, chat,
        source=f"dataset '{name}' split '{split}'",
    )
