"""Run several reward functions over a batch of completions and check what they return.

`async def` reward functions run concurrently (asyncio.gather in one event loop, as TRL runs them), beside the sync
ones, which run in order. A function may return an exception object in place of a sample's value: that sample
failed alone (an LLM judge whose reply holds no score), handled as reward.on_error says.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch

from logitless.rewards.builtin import RewardFn, get_reward_fn, reward_name


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than one finite number/None per completion."""


@dataclass
class RewardScores:
    rewards: torch.Tensor  # [B, R] float32, reward of function r for sample b; NaN where it returned None
    total: torch.Tensor  # [B] float32, sum over r of weights[r] * rewards[:, r], skipping NaN (0 if all NaN)
    names: list[str]  # [R] function names
    num_none: list[int]  # [R] samples each function returned None for
    num_errors: list[int]  # [R] samples each function raised on (scored `penalty`; on_error="penalty" only)
    error_texts: list[str | None] = field(default_factory=list)  # [R] first exception of each function, as text


def _row_fields(rows: Sequence[Any]) -> dict[str, list[Any]]:
    """Row fields as lists aligned with the rows (None where a row lacks a field)."""
    dicts = [r if isinstance(r, dict) else r.fields for r in rows]
    keys: list[str] = []
    for d in dicts:
        keys.extend(k for k in d if k not in keys)
    reserved = {"prompts", "completions"} & set(keys)
    if reserved:
        raise ValueError(f"row fields may not be named {sorted(reserved)} (reserved reward arguments); rename them")
    return {k: [d.get(k) for d in dicts] for k in keys}


def _short(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _check_values(name: str, values: Any, expected: int) -> list[float]:
    try:
        n = len(values)
    except TypeError:
        raise RewardFunctionError(
            f"reward function '{name}' returned {type(values).__name__}, expected a list of {expected} floats/None"
        ) from None
    if n != expected:
        raise RewardFunctionError(
            f"reward function '{name}' returned {n} values for {expected} completions (expected length {expected})"
        )
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (str, bytes, torch.Tensor)) or not hasattr(v, "__float__"):
            raise RewardFunctionError(
                f"reward function '{name}' returned {type(v).__name__} {v!r:.100} for sample {i}; "
                "expected a float or None"
            )
        f = float(v)
        if math.isnan(f):
            raise RewardFunctionError(
                f"reward function '{name}' returned NaN for sample {i}; return None for 'not applicable' instead"
            )
        if math.isinf(f):
            raise RewardFunctionError(f"reward function '{name}' returned {f} for sample {i}; rewards must be finite")
        out.append(f)
    return out


def is_async(fn: Any) -> bool:
    """Whether calling `fn` returns a coroutine (an `async def` function, a partial of one, or an object whose
    __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _gather(calls: list[tuple[Any, tuple, dict]]) -> list[Any]:
    """Await every call concurrently; each result is the value or the exception it raised."""
    return await asyncio.gather(*(fn(*args, **kw) for fn, args, kw in calls), return_exceptions=True)


def run_async(calls: list[tuple[Any, tuple, dict]]) -> concurrent.futures.Future:
    """Start the async calls in an event loop of their own (a worker thread, so that a caller inside a running
    loop, e.g. a notebook, works too); the future's result lists each call's value or exception."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitless-rewards")
    future = pool.submit(asyncio.run, _gather(calls))
    pool.shutdown(wait=False)
    return future


def _call_all(fns: Sequence[Any], args: tuple, kw: dict) -> list[Any]:
    """Each function's batch result (or the exception it raised): the async ones concurrently, in a worker
    thread, while the sync ones run here in order."""
    asynchronous = [i for i, fn in enumerate(fns) if is_async(fn)]
    pending = run_async([(fns[i], args, kw) for i in asynchronous]) if asynchronous else None
    out: list[Any] = [None] * len(fns)
    for i, fn in enumerate(fns):
        if i in asynchronous:
            continue
        try:
            out[i] = fn(*args, **kw)
        except Exception as e:
            out[i] = e
    if pending is not None:
        for i, result in zip(asynchronous, pending.result()):
            out[i] = result
    return out


def _one_by_one(fn: Any, prompts: list, completions: list, fields: dict[str, list]) -> list[Any]:
    """`fn` on each sample alone: the value list or the exception of each (async functions concurrently)."""
    calls = [(fn, (prompts[i : i + 1], completions[i : i + 1]), {k: v[i : i + 1] for k, v in fields.items()})
             for i in range(len(completions))]
    if is_async(fn):
        return run_async(calls).result()
    out = []
    for f, args, kw in calls:
        try:
            out.append(f(*args, **kw))
        except Exception as e:
            out.append(e)
    return out


def score_completions(
    fns: Sequence[RewardFn | str],
    weights: Sequence[float] | None,
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[Any],
    on_error: Literal["raise", "penalty"] = "raise",
    penalty: float = 0.0,
) -> RewardScores:
    """Rewards [B, R] of R reward functions on B completions, and their weighted total [B].

    `rows[b]` is the PromptRow (or fields dict) of sample b; its fields are passed as keyword lists. A function
    that raises is re-run sample by sample to find the failing sample: with on_error="raise" a
    RewardFunctionError names the function, the sample index and its text; with on_error="penalty" the
    failing samples score `penalty` and are counted in `num_errors`. A wrong-length result, a non-number or
    NaN always raises (those are bugs of the function, not of a sample).
    """
    if on_error not in ("raise", "penalty"):
        raise ValueError(f"on_error must be 'raise' or 'penalty', got {on_error!r}")
    if not (len(prompts) == len(completions) == len(rows)):
        raise ValueError(
            f"score_completions needs one prompt and one row per completion; got {len(prompts)} prompts, "
            f"{len(completions)} completions, {len(rows)} rows"
        )
    if len(fns) == 0:
        raise ValueError("score_completions needs at least one reward function")
    fns = [get_reward_fn(f) if isinstance(f, str) else f for f in fns]
    weights = [1.0] * len(fns) if weights is None else list(weights)
    if len(weights) != len(fns):
        raise ValueError(f"got {len(weights)} reward weights for {len(fns)} reward functions; give one per function")
    prompts, completions = list(prompts), list(completions)
    fields = _row_fields(rows)
    names = [reward_name(f) for f in fns]
    B = len(completions)
    columns, num_none, num_errors, error_texts = [], [], [], []
    results = _call_all(fns, (prompts, completions), fields)
    for fn, name, result in zip(fns, names, results):
        errors, first_error = 0, None

        def failed(i: int, e: BaseException) -> float:
            nonlocal errors, first_error
            if on_error == "raise":
                raise RewardFunctionError(
                    f"reward function '{name}' raised {type(e).__name__}: {e} on sample {i} "
                    f"(completion {_short(completions[i])})"
                ) from e
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            return float(penalty)

        if isinstance(result, RewardFunctionError):
            raise result
        if not isinstance(result, BaseException):
            if isinstance(result, (list, tuple)) and any(isinstance(v, BaseException) for v in result):
                _check_values(name, [0.0 if isinstance(v, BaseException) else v for v in result], B)  # the rest
                values = [failed(i, v) if isinstance(v, BaseException) else _check_values(name, [v], 1)[0]
                          for i, v in enumerate(result)]
            else:
                values = _check_values(name, result, B)
        else:
            batch_error = result
            values = []
            for i, one in enumerate(_one_by_one(fn, prompts, completions, fields)):
                if isinstance(one, BaseException):
                    values.append(failed(i, one))
                    continue
                if isinstance(one, (list, tuple)) and len(one) == 1 and isinstance(one[0], BaseException):
                    values.append(failed(i, one[0]))
                    continue
                values.extend(_check_values(name, one, 1))
            if errors == 0:  # every sample passes alone: the batch call itself is broken
                raise RewardFunctionError(
                    f"reward function '{name}' raised {type(batch_error).__name__}: {batch_error} on the batch of "
                    f"{B} completions, but not on any single sample"
                ) from batch_error
        columns.append(values)
        num_none.append(sum(math.isnan(v) for v in values))
        num_errors.append(errors)
        error_texts.append(first_error)
    rewards = torch.tensor(columns, dtype=torch.float32).T.reshape(B, len(fns))  # [B, R]
    w = torch.tensor(weights, dtype=torch.float32)  # [R]
    total = torch.nansum(rewards * w, dim=1)  # [B]
    return RewardScores(rewards=rewards, total=total, names=names, num_none=num_none, num_errors=num_errors,
                        error_texts=error_texts)
