"""The `code_tests` reward: run each completion's program with the row's tests in a sandbox.

    code_tests(prompts, completions, tests=[["assert add(1, 2) == 3", "assert add(0, 0) == 0"], ...])
    -> [fraction of tests passed, ...]

The program is the last fenced python block of the completion (```python / ```py / ```), else the whole text; of
a conversation (multi-turn episodes), of its last assistant message.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from logitless.rewards.builtin import completion_text, register_reward
from logitless.rewards.sandbox import SandboxOptions, SandboxPool

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_POOLS: dict[tuple[SandboxOptions, int | None], SandboxPool] = {}
_POOLS_LOCK = threading.Lock()


def extract_program(completion: str) -> str:
    """The last fenced python (or unlabelled) code block of `completion`, else the whole text."""
    blocks = _FENCE_RE.findall(completion)
    return blocks[-1] if blocks else completion


def sandbox_pool(options: SandboxOptions, num_workers: int | None = None) -> SandboxPool:
    """The process-wide pool for these limits (started on first use, stopped at exit)."""
    key = (options, num_workers)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = SandboxPool(options, num_workers)
        return _POOLS[key]


def _tests_of(value: Any, i: int) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value] if value.strip() else None
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        return list(value) or None
    raise ValueError(
        f"reward 'code_tests': row {i} has tests of type {type(value).__name__}; give Python source (a str) or "
        "a list of str, each counted as one test"
    )


@register_reward("code_tests", fields=("tests",))
def code_tests(
    prompts: list[str],
    completions: list[str],
    *,
    all_or_nothing: bool = False,
    timeout_seconds: float = 5.0,
    memory_mb: int = 1024,
    output_kb: int = 1024,
    num_workers: int | None = None,
    **row_fields: list[Any],
) -> list[float | None]:
    """Fraction of the row's `tests` that pass when run after the completion's program in a sandbox (see
    `extract_program`); with all_or_nothing=True, 1.0 only when every test passes, else 0.0.

    `tests` is Python source (one test, e.g. several `assert` lines) or a list of sources, each counted
    separately, in a namespace of its own with genuine builtins; None or empty means "not applicable" (None).
    A test passes only if the program and the test ran to completion without raising, as reported by a per-test
    token the program cannot reach. A program that raises, exits, times out (`timeout_seconds` wall time for the
    program and all its tests) or exceeds `memory_mb` passes nothing. Completions are scored in parallel by
    `num_workers` workers (default: CPUs). See docs/rewards.md for what the sandbox promises.
    """
    if "tests" not in row_fields:
        raise ValueError(
            f"reward 'code_tests' needs a 'tests' row field (Python source or a list of sources); got row fields "
            f"{sorted(row_fields)}. Map your dataset's test column with field_map={{'tests': ...}}"
        )
    tests = row_fields["tests"]
    if len(tests) != len(completions):
        raise ValueError(f"reward 'code_tests': {len(tests)} test entries for {len(completions)} completions")
    pool = sandbox_pool(SandboxOptions(timeout_seconds=timeout_seconds, memory_mb=memory_mb, output_kb=output_kb),
                        num_workers)
    parsed = [_tests_of(t, i) for i, t in enumerate(tests)]
    todo = [i for i, t in enumerate(parsed) if t is not None]
    results = pool.run([(extract_program(completion_text(completions[i])), parsed[i]) for i in todo])
    out: list[float | None] = [None] * len(completions)
    for i, res in zip(todo, results):
        out[i] = float(all(res.passed)) if all_or_nothing else res.fraction
    return out


def _check_options(*, all_or_nothing: bool = False, timeout_seconds: float = 5.0, memory_mb: int = 1024,
                   output_kb: int = 1024, num_workers: int | None = None) -> None:
    """Refuse bad `code_tests` options when they are bound (reward.reward_options.code_tests in a config)."""
    where = "reward.reward_options.code_tests"
    if not isinstance(all_or_nothing, bool):
        raise ValueError(f"{where}.all_or_nothing must be true or false, got {all_or_nothing!r}")
    if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int)
                                    or num_workers <= 0):
        raise ValueError(f"{where}.num_workers must be a positive int or null (= CPU count), got {num_workers!r}")
    try:
        SandboxOptions(timeout_seconds=timeout_seconds, memory_mb=memory_mb, output_kb=output_kb)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


code_tests.check_options = _check_options  # type: ignore[attr-defined]
