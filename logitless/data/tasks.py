"""Built-in prompt tasks and the task registry: `load_task(name, split, **options) -> list[PromptRow]`.

`gsm8k_sample.jsonl` (shipped in this package) holds the first 50 rows of the GSM8K test split
(https://github.com/openai/grade-school-math), used under the MIT License:

    Copyright (c) 2021 OpenAI

    Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
    associated documentation files (the "Software"), to deal in the Software without restriction, including
    without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the
    following conditions: The above copyright notice and this permission notice shall be included in all
    copies or substantial portions of the Software.
    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT
    LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO
    EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN
    AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE
    OR OTHER DEALINGS IN THE SOFTWARE.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import random
from pathlib import Path
from typing import Any, Callable

from logitless.data.images import COUNT_QUESTION, COUNT_SYSTEM, count_shapes_rows, with_images
from logitless.data.prompts import PromptRow, format_prompt, load_hf_prompts, read_jsonl, records_to_rows

TASKS: dict[str, Callable[..., list[PromptRow]]] = {}
GSM8K_SAMPLE = Path(__file__).with_name("gsm8k_sample.jsonl")


def register_task(name: str) -> Callable[[Callable[..., list[PromptRow]]], Callable[..., list[PromptRow]]]:
    """Decorator registering `fn(split, **options) -> list[PromptRow]` under `name`."""

    def deco(fn: Callable[..., list[PromptRow]]) -> Callable[..., list[PromptRow]]:
        TASKS[name] = fn
        return fn

    return deco


def load_task(name: str, split: str = "train", **options: Any) -> list[PromptRow]:
    """Prompt rows of the registered task `name` (e.g. "gsm8k", "arithmetic") for `split`."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"unknown task {name!r}{hint} Registered tasks: {sorted(TASKS)}")
    fn = TASKS[name]
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        valid = [p for p in params if p != "split"]
        for opt in options:
            if opt not in params or opt == "split":
                close = difflib.get_close_matches(opt, valid, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"task {name!r} has no option {opt!r}{hint} Valid options: {valid}")
    return fn(split, **options)


# ----------------------------------------------------------------------------------------------------------
# GSM8K

GSM8K_SYSTEM = "You are a helpful math assistant. Solve the problem step by step."
GSM8K_TEMPLATE = "{question}\nWrite the final answer as a number after '####'."


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K reference solution: the text after the last '####', commas removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '####' final answer: {solution[-200:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


@register_task("gsm8k")
def gsm8k(
    split: str = "train",
    path: str | None = None,
    system_prompt: str | None = GSM8K_SYSTEM,
    template: str = GSM8K_TEMPLATE,
    chat: bool = True,
    limit: int | None = None,
) -> list[PromptRow]:
    """GSM8K prompts with row fields `answer` (the number after '####') and `solution` (the reference text).

    Source: the JSON-lines file `path` (fields "question", "answer") if given; split "sample" is the 50-row
    test sample shipped in the package; otherwise the hub dataset `openai/gsm8k` (config "main") for `split`.
    """
    if path is not None or split == "sample":
        records = read_jsonl(path if path is not None else GSM8K_SAMPLE, limit)
        source = f"gsm8k file '{path}'" if path is not None else "gsm8k sample"
    else:
        records = [
            {"question": r.prompt, **r.fields}
            for r in load_hf_prompts("openai/gsm8k", split, prompt_field="question", chat=False, limit=limit,
                                     config_name="main")
        ]
        source = f"gsm8k split '{split}'"
    for i, rec in enumerate(records):
        if "answer" not in rec:
            raise ValueError(f"{source}: row {i} has no field 'answer'; available fields: {sorted(rec)}")
        rec["solution"] = rec["answer"]
        rec["answer"] = gsm8k_answer(rec["answer"])
    return records_to_rows(records, "question", system_prompt=system_prompt, template=template, chat=chat,
                           source=source)


# ----------------------------------------------------------------------------------------------------------
# Synthetic arithmetic

ARITH_SYSTEM = "You are a calculator."
ARITH_TEMPLATE = "What is {expression}? Answer with the number only."
ARITH_LEVELS = {
    1: "two 1-digit numbers, + or - (non-negative results)",
    2: "two 2-digit numbers, + or - (non-negative results)",
    3: "two 2-3 digit numbers, + - or * (2-digit * up to 3-digit)",
    4: "three 1-2 digit numbers, mixed + - * with the usual precedence",
    5: "three 1-2 digit numbers with parentheses, mixed + - *",
    6: "two 3-digit numbers multiplied (a task for a calculator tool)",
}


def _evaluate(tokens: list) -> int:
    """Value of [a, op, b, op, c, ...] with * before + and - (left to right)."""
    terms, ops = [tokens[0]], []
    for op, x in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] = terms[-1] * x
        else:
            ops.append(op)
            terms.append(x)
    value = terms[0]
    for op, x in zip(ops, terms[1:]):
        value = value + x if op == "+" else value - x
    return value


def _arith_problem(rng: random.Random, difficulty: int) -> tuple[str, int]:
    if difficulty in (1, 2):
        lo, hi = (0, 9) if difficulty == 1 else (10, 99)
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        return f"{a} {op} {b}", _evaluate([a, op, b])
    if difficulty == 3:
        op = rng.choice("+-*")
        a = rng.randint(10, 99) if op == "*" else rng.randint(10, 999)
        b = rng.randint(10, 999)
        return f"{a} {op} {b}", _evaluate([a, op, b])
    if difficulty in (4, 5):
        a, b, c = (rng.randint(1, 99) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        if difficulty == 4:
            return f"{a} {op1} {b} {op2} {c}", _evaluate([a, op1, b, op2, c])
        if rng.random() < 0.5:
            return f"({a} {op1} {b}) {op2} {c}", _evaluate([_evaluate([a, op1, b]), op2, c])
        return f"{a} {op1} ({b} {op2} {c})", _evaluate([a, op1, _evaluate([b, op2, c])])
    if difficulty == 6:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"{a} * {b}", a * b
    raise ValueError(f"arithmetic difficulty must be one of {sorted(ARITH_LEVELS)}, got {difficulty!r}")


def arithmetic_split_of(expression: str, test_fraction: float) -> str:
    """'test' or 'train': a fixed hash of the expression text decides, so the splits never share a problem."""
    h = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") / 2**64
    return "test" if h < test_fraction else "train"


@register_task("arithmetic")
def arithmetic(
    split: str = "train",
    n: int = 1000,
    difficulty: int = 1,
    seed: int = 0,
    test_fraction: float = 0.2,
    system_prompt: str | None = ARITH_SYSTEM,
    template: str = ARITH_TEMPLATE,
    chat: bool = True,
    unique: bool | None = None,
) -> list[PromptRow]:
    """`n` synthetic arithmetic prompts with row fields `answer` (str of the integer), `expression`, `difficulty`.

    Problems are drawn with `random.Random(seed)`; a problem belongs to the test split when a hash of its
    expression falls below `test_fraction`, so train and test never overlap whatever the seeds. `unique`
    (default: True for "test", False for "train") forbids repeated problems within the split.
    Difficulty levels: see ARITH_LEVELS.
    """
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic split must be 'train' or 'test', got {split!r}")
    if difficulty not in ARITH_LEVELS:
        raise ValueError(f"arithmetic difficulty must be one of {sorted(ARITH_LEVELS)}, got {difficulty!r}")
    if not (isinstance(n, int) and n > 0):
        raise ValueError(f"arithmetic n must be a positive int, got {n!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"arithmetic test_fraction must be in (0, 1), got {test_fraction!r}")
    if "{expression}" not in template:
        raise ValueError(f"arithmetic template must contain '{{expression}}', got {template!r}")
    unique = (split == "test") if unique is None else unique
    rng = random.Random(f"arithmetic:{difficulty}:{split}:{seed}")
    rows: list[PromptRow] = []
    seen: set[str] = set()
    misses = 0
    while len(rows) < n:
        expr, value = _arith_problem(rng, difficulty)
        if arithmetic_split_of(expr, test_fraction) != split or (unique and expr in seen):
            misses += 1
            if misses > 50 * n + 5_000:
                raise ValueError(
                    f"arithmetic difficulty {difficulty} has too few distinct {split} problems for n={n} "
                    f"(found {len(rows)}); lower n, raise the difficulty or set unique=False"
                )
            continue
        seen.add(expr)
        text = template.format(expression=expr)
        fields = {"answer": str(value), "expression": expr, "difficulty": difficulty}
        rows.append(PromptRow(prompt=format_prompt(text, system_prompt=system_prompt, chat=chat), fields=fields))
    return rows


# ----------------------------------------------------------------------------------------------------------
# Code: Python functions checked by tests (reward `code_tests`)

CODE_TASKS = Path(__file__).with_name("code_tasks.jsonl")
CODE_SYSTEM = "You are an expert Python programmer."
CODE_TEMPLATE = ("{prompt}\nAnswer with the complete function in one ```python code block; use only the standard "
                 "library.")


@register_task("code")
def code(
    split: str = "train",
    path: str | None = None,
    system_prompt: str | None = CODE_SYSTEM,
    template: str = CODE_TEMPLATE,
    chat: bool = True,
    limit: int | None = None,
) -> list[PromptRow]:
    """Code prompts with row fields `tests` (a list of test sources, each counted separately by `code_tests`)
    and every other field of the record.

    Source: the JSON-lines file `path` (fields "prompt" and "tests"; all rows, whatever `split`), else the
    40 small function-writing tasks shipped in the package (`code_tasks.jsonl`, 30 "train" / 10 "test" rows,
    written for this project and licensed like it, Apache-2.0; each row also has a reference `solution`).
    """
    records = read_jsonl(path if path is not None else CODE_TASKS)
    source = f"code file '{path}'" if path is not None else "code tasks"
    if path is None:
        if split not in ("train", "test"):
            raise ValueError(f"the shipped code tasks have splits 'train' and 'test', got {split!r}; "
                             "or pass data.options.path=<file.jsonl>")
        records = [r for r in records if r.get("split") == split]
    records = records[:limit] if limit is not None else records
    for i, rec in enumerate(records):
        if not isinstance(rec.get("tests"), (str, list)) or not rec["tests"]:
            raise ValueError(f"{source}: row {i} needs a non-empty 'tests' field (Python source or a list of "
                             f"sources); available fields: {sorted(rec)}")
    return records_to_rows(records, "prompt", system_prompt=system_prompt, template=template, chat=chat,
                           source=source)


# ----------------------------------------------------------------------------------------------------------
# MATH-500 (reward `math_verify`)

MATH500 = Path(__file__).with_name("math500_test.jsonl")  # MIT; see LICENSE-MATH500.txt beside it
MATH_SYSTEM = "You are a helpful math assistant. Solve the problem step by step."
MATH_TEMPLATE = "{problem}\nPut the final answer in \\boxed{{}}."


@register_task("math500")
def math500(
    split: str = "test",
    system_prompt: str | None = MATH_SYSTEM,
    template: str = MATH_TEMPLATE,
    chat: bool = True,
    limit: int | None = None,
) -> list[PromptRow]:
    """The 500 MATH-500 test problems (shipped in the package) with row fields `answer` (the reference
    answer, LaTeX), `solution`, `subject`, `level` and `unique_id`: an eval task for the `math_verify` reward."""
    if split != "test":
        raise ValueError(f"math500 has only the 'test' split (it is an eval set), got {split!r}")
    return records_to_rows(read_jsonl(MATH500, limit), "problem", system_prompt=system_prompt, template=template,
                           chat=chat, source="math500")


# ----------------------------------------------------------------------------------------------------------
# Visual counting (a vision-language model; reward `numeric_answer`)


@register_task("count_shapes")
def count_shapes(
    split: str = "train",
    n: int = 1000,
    seed: int = 0,
    size: int = 112,
    max_count: int = 5,
    max_other: int = 4,
    system_prompt: str | None = COUNT_SYSTEM,
    question: str = COUNT_QUESTION,
) -> list[PromptRow]:
    """`n` synthetic images of coloured shapes (squares, circles, triangles, drawn with PIL: no download) asking
    how many are red, with row fields `answer` (str of the count, 0..max_count; for `numeric_answer`) and
    `num_shapes`. Each image is `size` x `size` pixels; the prompt is a chat prompt whose user message holds the
    image, then `question`. Needs a vision-language model (model.name_or_path) and rollout.backend=hf."""
    rows = []
    for image, text, fields in count_shapes_rows(split, n, seed, size, max_count, max_other, question):
        prompt = with_images(format_prompt(text, system_prompt=system_prompt), [image], "count_shapes")
        rows.append(PromptRow(prompt=prompt, fields=fields))
    return rows
