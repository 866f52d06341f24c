"""Prompt rows from JSONL files or Hugging Face datasets.

A `PromptRow` holds the prompt (raw text, or chat messages for a chat template) and the row's other fields,
which the trainer passes to reward functions as keyword lists (e.g. `answer=[...]`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

Messages = list[dict[str, Any]]  # {"role", "content"}: content is text, or content blocks (a row with images)
IMAGES_FIELD = "images"  # the record field holding a row's images (paths, PIL images or a datasets Image feature)


@dataclass(slots=True)
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
    return [{"role": str(m["role"]), "content": m["content"] if _blocks(m["content"]) else str(m["content"])}
            for m in value]


def _blocks(content: Any) -> bool:
    """Whether a message's content is a list of content blocks ({"type": "text" | "image", ...})."""
    return isinstance(content, list) and all(isinstance(b, dict) and "type" in b for b in content)


def records_to_rows(
    records: Iterable[dict[str, Any]],
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    field_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    template: str | None = None,
    chat: bool = True,
    source: str = "dataset",
    base: Path | None = None,
) -> list[PromptRow]:
    """Prompt rows from dict records (any iterable: records are turned into rows as they come, so a stream of
    them is never held twice).

    - the prompt text is `record[prompt_field]`, or `template.format(**record)` when a template is given
      (placeholders name record fields, e.g. "Question: {question}\nAnswer:");
    - a record prompt that already is a list of chat messages is kept as is (a system prompt is prepended
      unless it already starts with one);
    - row fields are all record fields except the prompt field, plus `field_map` renames
      `{row_field: record_field}`; `answer_field="x"` is shorthand for `field_map={"answer": "x"}`.
    - a record with an `images` field (one image or a list: file paths, relative to `base` when found there, PIL
      images, or a `datasets` Image feature) gets them as image blocks at the start of its user message
      (`images.with_images`, which checks every file now: a URL, a missing or unreadable file fails naming the row).
    Field names are interned, so a million rows share one string per name.
    """
    from logitless.data.images import with_images

    field_map = dict(field_map or {})
    if answer_field is not None:
        field_map.setdefault("answer", answer_field)
    placeholders = template_fields(template) if template is not None else []
    needed = placeholders if template is not None else [prompt_field]
    needed = needed + [src for src in field_map.values() if src not in needed]
    intern = sys.intern
    rows: list[PromptRow] = []
    with _gc_paused():  # rows hold no reference cycles: collecting while a million of them are made only costs time
        for i, rec in enumerate(records):
            if not isinstance(rec, dict):
                raise ValueError(f"{source}: row {i} is {type(rec).__name__}, expected a JSON object")
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
            if rec.get(IMAGES_FIELD) is not None:
                prompt = with_images(prompt, rec[IMAGES_FIELD], f"{source}: row {i}", base)
            fields = {intern(k) if type(k) is str else k: v for k, v in rec.items()
                      if k != prompt_field or template is not None}
            for row_name, src in field_map.items():
                fields[intern(row_name)] = rec[src]
            rows.append(PromptRow(prompt=prompt, fields=fields))
    if not rows:
        raise ValueError(f"{source} has no rows; check the path/split and filters")
    return rows


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (and back on after it, if it was on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


Progress = Callable[[int, int, int], None]  # progress(bytes read, bytes in the file, rows read so far)


def iter_jsonl(path: str | Path, limit: int | None = None, progress: Progress | None = None,
               every: int = 1 << 16) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file, one at a time (blank lines skipped; at most `limit`). Errors name the
    file, the line and, for a byte that is not UTF-8, its offset in the file. `progress` is called every `every`
    lines and at the end."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file '{p}' does not exist")
    total, offset, count = p.stat().st_size, 0, 0
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and count >= limit:
                break
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading byte-order mark is dropped
            except UnicodeDecodeError as e:
                bad = raw[e.start:e.start + 4]
                raise ValueError(
                    f"prompt file '{p}' line {lineno} is not UTF-8: byte {raw[e.start]:#04x} at byte offset "
                    f"{start + e.start} of the file (column {e.start + 1} of the line, near {bad!r}). Save the "
                    f"file as UTF-8, e.g. iconv -f latin1 -t utf-8 '{p}' > fixed.jsonl"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt file '{p}' line {lineno} is not valid JSON: {e}") from None
            count += 1
            if progress is not None and lineno % every == 0:
                progress(offset, total, count)
            yield record
    if progress is not None:
        progress(offset, total, count)


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of a JSON-lines file (blank lines skipped); errors name the file and line (see `iter_jsonl`)."""
    return list(iter_jsonl(path, limit))


def load_jsonl_prompts(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    field_map: dict[str, str] | None = None,
    system_prompt: str | None = None,
    template: str | None = None,
    chat: bool = True,
    limit: int | None = None,
    *,
    progress: Progress | None = None,
) -> list[PromptRow]:
    """Prompt rows of a JSON-lines file (see `records_to_rows` for the field options), read as a stream: only the
    rows are kept, never the file's text or its records beside them. `progress(bytes read, file bytes, rows)` is
    called while it reads."""
    return records_to_rows(
        iter_jsonl(path, limit, progress), prompt_field, answer_field, field_map, system_prompt, template, chat,
        source=f"prompt file '{path}'", base=Path(path).parent,
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
