"""Built-in reward functions and the reward registry.

A reward function computes one score per completion:

    fn(prompts: list[str], completions: list[str], **row_fields: list[Any]) -> list[float | None]

`row_fields` are the dataset row fields as lists aligned with `completions` (e.g. `answer=[...]`); `None`
means "not applicable to this sample" (as in TRL). After multi-turn episodes with chat prompts a completion is
the list of messages after the prompt (TRL's convention); the built-ins then score the content of its last
assistant message (`completion_text`). Options of a built-in are keyword-only parameters with
defaults (`get_reward_fn("format_tags", tags=["reason", "answer"])` binds them).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import re
import sys
import threading
import traceback
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Literal, Sequence

RewardFn = Callable[..., list]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, fields: Sequence[str] = ()) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under `name`; `fields`: the row fields it reads through
    `**row_fields` (checked against the data before training, see `reward_row_fields`)."""

    def deco(fn: RewardFn) -> RewardFn:
        fn.row_fields = tuple(fields)
        REWARDS[name] = fn
        return fn

    return deco


def reward_row_fields(fn: Any) -> list[str]:
    """The row fields reward function `fn` needs: the ones a built-in declares (`register_reward(fields=...)`), or
    for your own function its parameters after (prompts, completions) that have no default value, e.g. `answer` of
    `def reward(prompts, completions, answer, **fields)`. Fields read only through `**fields` cannot be known."""
    declared = getattr(fn, "row_fields", None)
    if declared is not None:
        return list(declared)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params[2:] if p.kind in named and p.default is inspect.Parameter.empty]


def completion_text(completion: Any) -> str:
    """The text a built-in reward scores: the completion itself, or for a conversation (a list of messages, as
    multi-turn episodes give them) the content of its last assistant message ("" when it has none or only tool
    calls). Content given as a list of parts keeps its text parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and all(isinstance(m, dict) for m in completion):
        for message in reversed(completion):
            if message.get("role") == "assistant":
                content = message.get("content")
                if isinstance(content, list):
                    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
                return "" if content is None else str(content)
        return ""
    raise TypeError(f"a completion must be a string or a list of chat messages (dicts), got "
                    f"{type(completion).__name__} {completion!r:.80}")


def _answers(fn_name: str, n: int, row_fields: dict[str, list[Any]]) -> list[Any]:
    if "answer" not in row_fields:
        raise ValueError(
            f"reward '{fn_name}' needs an 'answer' row field; got row fields {sorted(row_fields)}. "
            "Map your dataset's answer column with answer_field=... / field_map={'answer': ...}"
        )
    answers = row_fields["answer"]
    if len(answers) != n:
        raise ValueError(f"reward '{fn_name}': {len(answers)} answers for {n} completions")
    return answers


# ----------------------------------------------------------------------------------------------------------
# numeric_answer

_NUM = r"(?<![\w.])-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*(" + _NUM + ")")
_BOXED_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")


def parse_number(text: Any) -> Decimal | None:
    """The number written in `text` ("1,234", "$18", "\\$18", "18.", "-3.50", "50%", "1\\,000"), or None if it is
    not a single number."""
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", str(text).strip())
    for junk in ("\\,", "\\!", "\\%", "\\", "%", ",", "$", " "):  # LaTeX spacing/escapes, units, separators
        s = s.replace(junk, "")
    s = s.rstrip(".") if s.count(".") == 1 and s.endswith(".") else s
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def extract_numeric_answer(completion: str) -> Decimal | None:
    """The final numeric answer of a completion: after the last '####', else the last \\boxed{...}, else the
    last number in the text; None when there is none."""
    hashes = _HASH_RE.findall(completion)
    if hashes:
        return parse_number(hashes[-1])
    boxed = _BOXED_RE.findall(completion)
    if boxed:
        return parse_number(boxed[-1])
    numbers = _NUM_RE.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


@register_reward("numeric_answer", fields=("answer",))
def numeric_answer(prompts: list[str], completions: list[str], **row_fields: list[Any]) -> list[float | None]:
    """1.0 when the completion's final number (see `extract_numeric_answer`) equals the row's `answer`
    numerically ("18.00" == "18"), else 0.0; None for rows whose answer is None."""
    answers = _answers("numeric_answer", len(completions), row_fields)
    out: list[float | None] = []
    for completion, answer in zip(completions, answers):
        if answer is None:
            out.append(None)
            continue
        gold = parse_number(answer)
        if gold is None:
            raise ValueError(f"reward 'numeric_answer': the row answer {answer!r} is not a number; use math_verify")
        pred = extract_numeric_answer(completion_text(completion))
        out.append(1.0 if pred is not None and pred == gold else 0.0)
    return out


# ----------------------------------------------------------------------------------------------------------
# math_verify


@register_reward("math_verify", fields=("answer",))
def math_verify(
    prompts: list[str], completions: list[str], *, timeout_seconds: int | None = 5, **row_fields: list[Any]
) -> list[float | None]:
    """1.0 when the math-verify library judges the completion's answer equivalent to the row's `answer`
    (parsed as LaTeX or an expression; "\\frac{1}{2}" == "0.5"), else 0.0; None when the gold answer is None
    or cannot be parsed. As in `numeric_answer` the last answer wins: with several \\boxed{...}, only the text
    from the last one on is parsed (math-verify alone would return the set of all boxes, equal to no answer).
    Timeouts use signals, so they are disabled outside the main thread."""
    from math_verify import parse, verify

    answers = _answers("math_verify", len(completions), row_fields)
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for completion, answer in zip(completions, answers):
        if answer is None:
            out.append(None)
            continue
        text = str(answer).strip()
        gold = None  # a bare gold answer is read as LaTeX first ("3\\sqrt{13}", "6 - 5i", "1,-2" whole)
        if not text.startswith("$") and "\\boxed" not in text:
            gold = parse(f"${text}$", parsing_timeout=timeout)
        if not gold:
            gold = parse(text, parsing_timeout=timeout)
        if not gold:
            out.append(None)
            continue
        completion = completion_text(completion)
        last_box = completion.rfind("\\boxed")
        pred = parse(completion[max(last_box, 0) :], parsing_timeout=timeout)
        out.append(1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0)
    return out


# ----------------------------------------------------------------------------------------------------------
# format_tags


@functools.lru_cache(maxsize=64)
def _tags_pattern(tags: tuple[str, ...], strict: bool) -> re.Pattern:
    body = r"\s*".join(rf"<{re.escape(t)}>(?:(?!<{re.escape(t)}>).)*?</{re.escape(t)}>" for t in tags)
    return re.compile(rf"^\s*{body}\s*$" if strict else body, re.DOTALL)


@register_reward("format_tags")
def format_tags(
    prompts: list[str],
    completions: list[str],
    *,
    tags: Sequence[str] = ("think", "answer"),
    strict: bool = True,
    **row_fields: list[Any],
) -> list[float | None]:
    """1.0 when the completion has the blocks `<tag>...</tag>` of `tags` in order, else 0.0.

    strict=True: the completion is exactly those blocks (whitespace between them allowed);
    strict=False: the blocks appear in order somewhere in the completion.
    """
    if isinstance(tags, str) or not tags or not all(isinstance(t, str) and t for t in tags):
        raise ValueError(f"format_tags: tags must be a non-empty list of tag names, got {tags!r}")
    pattern = _tags_pattern(tuple(tags), strict)
    match = pattern.match if strict else pattern.search
    return [1.0 if match(completion_text(c)) else 0.0 for c in completions]


# ----------------------------------------------------------------------------------------------------------
# length_target


@register_reward("length_target")
def length_target(
    prompts: list[str],
    completions: list[str],
    *,
    target: int = 256,
    unit: Literal["chars", "words"] = "chars",
    only_longer: bool = False,
    **row_fields: list[Any],
) -> list[float | None]:
    """Penalty `-min(1, |L - target| / target)` for completion length L (in `unit`); with only_longer=True
    only lengths above the target are penalized: `-min(1, max(L - target, 0) / target)`. 0 is best."""
    if not isinstance(target, int) or target <= 0:
        raise ValueError(f"length_target: target must be a positive int, got {target!r}")
    if unit not in ("chars", "words"):
        raise ValueError(f"length_target: unit must be 'chars' or 'words', got {unit!r}")
    out: list[float | None] = []
    for c in map(completion_text, completions):
        length = len(c) if unit == "chars" else len(c.split())
        excess = max(length - target, 0) if only_longer else abs(length - target)
        out.append(-min(1.0, excess / target))
    return out


# ----------------------------------------------------------------------------------------------------------
# Lookup


def reward_name(fn: Any) -> str:
    """A readable name of a reward function (its registered name, __name__ or repr)."""
    for name, registered in REWARDS.items():
        if fn is registered:
            return name
    return getattr(fn, "__name__", None) or repr(fn)


def missing_attribute(module: Any, module_name: str, attr: str, what: str) -> ValueError:
    """The error for a "module:name" whose module has no `attr`, with the module's closest public callable as a
    suggestion (`what` prefixes the message, e.g. "reward 'my_rewards:score'")."""
    public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
    close = difflib.get_close_matches(attr, public, n=1)
    hint = f"; did you mean '{module_name}:{close[0]}'?" if close else ""
    return ValueError(f"{what}: module '{module_name}' has no attribute '{attr}'{hint}")


def import_user_module(module_name: str, what: str) -> Any:
    """Import a user's module (of a reward's or a tool's "module:function", an environment's "module:Class"; `what`
    names it in errors, e.g. "reward 'my_rewards:score'"). The current folder is searched first, as `python -m` and
    `python script.py` do (a console script such as `logitless` would otherwise search only its own folder):
    `my_rewards:score` finds `./my_rewards.py` in the folder `logitless` runs from, then PYTHONPATH and the installed
    packages."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"{what}: no module '{module_name}' in the current folder ({cwd}), on PYTHONPATH or among "
                f"the installed packages; put {module_name.replace('.', '/')}.py in the folder you run logitless "
                "from, or add its folder to PYTHONPATH"
            ) from None
        raise ValueError(f"{what}: importing module '{module_name}' failed: {_where(e)}") from e
    except Exception as e:  # the module itself raised: a syntax error, a missing dependency, ...
        raise ValueError(f"{what}: importing module '{module_name}' failed: {_where(e)}") from e


def _where(e: BaseException) -> str:
    """`Type: message (file, line N)` of an exception, at its innermost frame (or the file of a SyntaxError)."""
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    at = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


def get_reward_fn(spec: str | RewardFn, **options: Any) -> RewardFn:
    """A reward function from a built-in name ("numeric_answer"), a "module:function" path (sync or async), a
    "model:NAME_OR_PATH" reward model or "judge:NAME_OR_PATH" LLM judge (`logitless.rewards.models`), or a callable;
    `options` bind its keyword-only parameters (e.g. `tags=[...]` of format_tags)."""
    if isinstance(spec, str) and spec.startswith(("model:", "judge:")):
        from logitless.rewards.models import model_reward

        return model_reward(spec, **options)
    if callable(spec):
        fn = spec
    elif not isinstance(spec, str):
        raise TypeError(f"reward spec must be a name, 'module:function' or a callable, got {type(spec).__name__}")
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        module = import_user_module(module_name, f"reward '{spec}'")
        if not hasattr(module, attr):
            raise missing_attribute(module, module_name, attr, f"reward '{spec}'")
        fn = getattr(module, attr)
        if not callable(fn):
            raise TypeError(f"reward '{spec}' is a {type(fn).__name__}, not a callable function")
    elif spec in REWARDS:
        fn = REWARDS[spec]
    else:
        close = difflib.get_close_matches(spec, list(REWARDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"unknown reward {spec!r}{hint} Built-ins: {sorted(REWARDS)}; for your own function use 'module:function'"
        )
    if not options:
        return fn
    params = inspect.signature(fn).parameters
    allowed = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    for opt in options:
        if opt not in allowed:
            raise ValueError(
                f"reward '{reward_name(fn)}' has no option '{opt}'; its options (keyword-only parameters) are {allowed}"
            )
    check = getattr(fn, "check_options", None)  # a built-in may validate its options now, not at the first batch
    if check is not None:
        check(**options)
    bound = functools.partial(fn, **options)
    functools.update_wrapper(bound, fn)
    return bound
