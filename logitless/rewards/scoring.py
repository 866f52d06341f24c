"""Run several reward functions over a batch of completions and check what they return.

`async def` reward functions run concurrently (asyncio.gather in one event loop, as TRL runs them), beside the sync
ones, which run in order; `reward.timeout_s` bounds each of their calls through `asyncio.wait_for`. A function may
return an exception object in place of a sample's value: that sample failed alone (an LLM judge whose reply holds
no score), handled as reward.on_error says.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch

from logitless.rewards.builtin import REWARDS, RewardFn, get_reward_fn, reward_name
from logitless.rewards.deadline import call_with_timeout


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than one finite number/None per completion."""


@dataclass
class RewardScores:
    rewards: torch.Tensor  # [B, R] float32, reward of function r for sample b; NaN where it returned None
    total: torch.Tensor  # [B] float32, sum over r of weights[r] * rewards[:, r], skipping NaN (0 if all NaN)
    names: list[str]  # [R] function names
    num_none: list[int]  # [R] samples each function returned None for
    num_errors: list[int]  # [R] samples each function raised or ran out of time on (scored `penalty`; on_error="penalty")
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


def _failed(name: str, i: int, e: BaseException, completions: list[str], on_error: str) -> str:
    """The text of sample i's failure; raises under on_error="raise"."""
    if on_error == "raise":
        raise RewardFunctionError(
            f"reward function '{name}' raised {type(e).__name__}: {e} on sample {i} (completion {_short(completions[i])})"
        ) from e
    return f"{type(e).__name__}: {e}"


def _with_failures(name: str, out: Any, completions: list[str], on_error: str,
                   penalty: float) -> tuple[list[float], int, str | None]:
    """(values, failed samples, first failure) of a batch result whose items may be exceptions: the samples the
    function could not score (each handled by `on_error`)."""
    B = len(completions)
    if not (isinstance(out, (list, tuple)) and any(isinstance(v, BaseException) for v in out)):
        return _check_values(name, out, B), 0, None
    _check_values(name, [0.0 if isinstance(v, BaseException) else v for v in out], B)  # length and the other values
    values, errors, first = [], 0, None
    for i, v in enumerate(out):
        if isinstance(v, BaseException):
            first = first or _failed(name, i, v, completions, on_error)
            errors += 1
            values.append(float(penalty))
        else:
            values.append(_check_values(name, [v], 1)[0])
    return values, errors, first


def is_async(fn: Any) -> bool:
    """Whether calling `fn` returns a coroutine (an `async def` function, a partial of one, or an object whose
    __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


async def _gather(calls: list[tuple[Any, tuple, dict]], timeout_s: float | None) -> list[Any]:
    """Await every call concurrently, each within `timeout_s` (cancelled past it: asyncio.TimeoutError); each
    result is the value or the exception it raised."""
    async def one(fn: Any, args: tuple, kw: dict) -> Any:
        return await asyncio.wait_for(fn(*args, **kw), timeout_s)

    return await asyncio.gather(*(one(*c) for c in calls), return_exceptions=True)


def run_async(calls: list[tuple[Any, tuple, dict]], timeout_s: float | None = None) -> concurrent.futures.Future:
    """Start async calls in an event loop of their own, on a worker thread (so that a caller inside a running loop,
    e.g. a notebook, works too) while the caller goes on; the future's result lists each call's value or exception."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitless-rewards")
    future = pool.submit(asyncio.run, _gather(calls, timeout_s))
    pool.shutdown(wait=False)
    return future


def _score_async(fn: Any, name: str, prompts: list[str], completions: list[str], fields: dict[str, list[Any]],
                 on_error: str, penalty: float, timeout_s: float | None,
                 result: Any) -> tuple[list[float], int, str | None]:
    """(values [B], failed samples, first failure) of an async function from its batch call's `result`; a batch that
    raised is re-run one sample at a time, concurrently."""
    B = len(completions)
    if isinstance(result, RewardFunctionError):
        raise result
    if isinstance(result, asyncio.TimeoutError):
        text = _late(name, timeout_s, f"a batch of {B} completions", "the call was cancelled")
        if on_error == "raise":
            raise RewardFunctionError(f"{text}. Make it faster, raise reward.timeout_s (null: no limit), or set "
                                      "reward.on_error=penalty to score such samples reward.error_penalty")
        return [float(penalty)] * B, B, text
    if not isinstance(result, BaseException):
        return _with_failures(name, result, completions, on_error, penalty)
    calls = [(fn, (prompts[i : i + 1], completions[i : i + 1]), {k: v[i : i + 1] for k, v in fields.items()})
             for i in range(B)]
    values, errors, first = [], 0, None
    for i, one in enumerate(run_async(calls, timeout_s).result()):
        if isinstance(one, (list, tuple)) and len(one) == 1 and isinstance(one[0], BaseException):
            one = one[0]
        if not isinstance(one, BaseException):
            values.extend(_check_values(name, one, 1))
            continue
        if isinstance(one, asyncio.TimeoutError):
            text = _late(name, timeout_s, f"sample {i} alone (completion {_short(completions[i])})", "cancelled")
            if on_error == "raise":
                raise RewardFunctionError(f"{text}. Make it faster, raise reward.timeout_s (null: no limit), or set "
                                          "reward.on_error=penalty") from result
        else:
            text = _failed(name, i, one, completions, on_error)
        first, errors = first or text, errors + 1
        values.append(float(penalty))
    if errors == 0:  # every sample passes alone: the batch call itself is broken
        raise RewardFunctionError(
            f"reward function '{name}' raised {type(result).__name__}: {result} on the batch of {B} completions, but "
            "not on any single sample"
        ) from result
    return values, errors, first


def _short(text: Any, n: int = 200) -> str:
    text = text if isinstance(text, str) else str(text)  # a conversation (message list) of multi-turn episodes
    return repr(text if len(text) <= n else text[:n] + "...")


def bounds_own_time(fn: Any) -> bool:
    """True for a built-in reward (options bound or not): each bounds its own time per sample (math_verify's and
    code_tests' `timeout_seconds`; the others are linear in the text), so `timeout_s` does not apply to it."""
    base = fn.func if isinstance(fn, functools.partial) else fn
    return any(base is r for r in REWARDS.values()) and getattr(base, "__module__", "").startswith("logitless.")


def _late(name: str, timeout_s: float | None, what: str, fate: str) -> str:
    return f"reward function '{name}' did not return within reward.timeout_s={timeout_s:g} s on {what}; {fate}"


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


def score_completions(
    fns: Sequence[RewardFn | str],
    weights: Sequence[float] | None,
    prompts: Sequence[str],
    completions: Sequence[str | list[dict]],
    rows: Sequence[Any],
    on_error: Literal["raise", "penalty"] = "raise",
    penalty: float = 0.0,
    timeout_s: float | None = None,
) -> RewardScores:
    """Rewards [B, R] of R reward functions on B completions, and their weighted total [B].

    `rows[b]` is the PromptRow (or fields dict) of sample b; its fields are passed as keyword lists. Each function
    is called once on the whole batch. A function that raises is re-run sample by sample to find the failing
    sample: with on_error="raise" a RewardFunctionError names the function, the sample index and its text; with
    on_error="penalty" the failing samples score `penalty` and are counted in `num_errors`. A wrong-length result,
    a non-number or NaN always raises (those are bugs of the function, not of a sample).

    `timeout_s` (None: no limit) bounds each call of a function that is not a built-in (`deadline.py`: the call is
    stopped, or off the main thread abandoned). A batch call past it fails all B samples; a one-sample re-run past
    it fails that sample and, without calling the function again, the samples not yet re-run (so that a hanging
    function costs at most two limits per batch). Failed samples are handled by `on_error` as above.
    """
    if on_error not in ("raise", "penalty"):
        raise ValueError(f"on_error must be 'raise' or 'penalty', got {on_error!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds or None (no limit), got {timeout_s!r}")
    if not (len(prompts) == len(completions) == len(rows)):
        raise ValueError(
            f"score_completions needs one prompt and one row per completion; got {len(prompts)} prompts, "
            f"{len(completions)} completions, {len(rows)} rows"
        )
    fns = [get_reward_fn(f) if isinstance(f, str) else f for f in fns]
    weights = [1.0] * len(fns) if weights is None else list(weights)
    if len(weights) != len(fns):
        raise ValueError(f"got {len(weights)} reward weights for {len(fns)} reward functions; give one per function")
    prompts, completions = list(prompts), list(completions)
    fields = _row_fields(rows)
    names = [reward_name(f) for f in fns]
    B = len(completions)
    columns, num_none, num_errors, error_texts = [], [], [], []
    asynchronous = [i for i, fn in enumerate(fns) if is_async(fn)]  # started together, awaited below
    pending = run_async([(fns[i], (prompts, completions), fields) for i in asynchronous], timeout_s) \
        if asynchronous else None
    for k, (fn, name) in enumerate(zip(fns, names)):
        limit = None if bounds_own_time(fn) else timeout_s
        if k in asynchronous:
            result = pending.result()[asynchronous.index(k)]
            values, errors, first_error = _score_async(fn, name, prompts, completions, fields, on_error, penalty,
                                                       timeout_s, result)
        else:
            values, errors, first_error = _score_one(fn, name, prompts, completions, fields, on_error, penalty, limit)
        columns.append(values)
        num_none.append(sum(math.isnan(v) for v in values))
        num_errors.append(errors)
        error_texts.append(first_error)
    rewards = torch.tensor(columns, dtype=torch.float32).reshape(len(fns), B).T.contiguous()  # [B, R] (R may be 0)
    w = torch.tensor(weights, dtype=torch.float32)  # [R]
    total = torch.nansum(rewards * w, dim=1)  # [B]
    return RewardScores(rewards=rewards, total=total, names=names, num_none=num_none, num_errors=num_errors,
                        error_texts=error_texts)


def _score_one(fn: RewardFn, name: str, prompts: list[str], completions: list[str], fields: dict[str, list[Any]],
               on_error: str, penalty: float, timeout_s: float | None) -> tuple[list[float], int, str | None]:
    """(values [B], failed samples, first failure as text) of one reward function (see `score_completions`)."""
    B = len(completions)
    try:
        out, fate = call_with_timeout(fn, (prompts, completions), fields, timeout_s)
    except RewardFunctionError:
        raise
    except Exception as batch_error:
        return _score_each(fn, name, prompts, completions, fields, on_error, penalty, timeout_s, batch_error)
    if fate is None:
        return _with_failures(name, out, completions, on_error, penalty)
    text = _late(name, timeout_s, f"a batch of {B} completions", fate)
    if on_error == "raise":
        raise RewardFunctionError(
            f"{text}. Make it faster, raise reward.timeout_s (null: no limit), or set reward.on_error=penalty to "
            "score such samples reward.error_penalty"
        )
    return [float(penalty)] * B, B, text


def _score_each(fn: RewardFn, name: str, prompts: list[str], completions: list[str], fields: dict[str, list[Any]],
                on_error: str, penalty: float, timeout_s: float | None,
                batch_error: Exception) -> tuple[list[float], int, str | None]:
    """The batch call raised: each sample alone, to find the ones that fail."""
    values: list[float] = []
    errors, first_error, out_of_time = 0, None, False
    for i in range(len(completions)):
        if out_of_time:  # a re-run already hung: the rest fail without another call
            errors += 1
            values.append(float(penalty))
            continue
        try:
            one, fate = call_with_timeout(
                fn, (prompts[i : i + 1], completions[i : i + 1]), {k: v[i : i + 1] for k, v in fields.items()},
                timeout_s,
            )
        except Exception as e:
            if on_error == "raise":
                raise RewardFunctionError(
                    f"reward function '{name}' raised {type(e).__name__}: {e} on sample {i} "
                    f"(completion {_short(completions[i])})"
                ) from e
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            values.append(float(penalty))
            continue
        if fate is not None:
            text = _late(name, timeout_s, f"sample {i} alone (completion {_short(completions[i])})", fate)
            if on_error == "raise":
                raise RewardFunctionError(
                    f"{text}; the batch call had raised {type(batch_error).__name__}: {batch_error}. Make it faster, "
                    "raise reward.timeout_s (null: no limit), or set reward.on_error=penalty"
                ) from batch_error
            errors += 1
            first_error = first_error or text
            values.append(float(penalty))
            out_of_time = True
            continue
        one_values, failed, text = _with_failures(name, one, completions[i : i + 1], on_error, penalty)
        values.extend(one_values)
        errors, first_error = errors + failed, first_error or text
    if errors == 0:  # every sample passes alone: the batch call itself is broken
        raise RewardFunctionError(
            f"reward function '{name}' raised {type(batch_error).__name__}: {batch_error} on the batch of "
            f"{len(completions)} completions, but not on any single sample"
        ) from batch_error
    return values, errors, first_error


def add_reward_column(scores: RewardScores, name: str, values: Sequence[float | None], weight: float) -> RewardScores:
    """`scores` with one more reward column `name` (e.g. an environment's own episode rewards; None where there is
    none, NaN in the column) added to the total with `weight`. Values are checked as a reward function's are."""
    B = scores.rewards.shape[0]
    if name in scores.names:
        raise ValueError(f"a reward function is already named {name!r}; rename it (the {name!r} column is built in)")
    column = torch.tensor(_check_values(name, values, B), dtype=torch.float32)  # [B]
    rewards = torch.cat([scores.rewards, column[:, None]], 1)  # [B, R + 1]
    total = torch.nansum(torch.stack([scores.total, column * weight]), 0)  # [B]
    return RewardScores(rewards=rewards, total=total, names=[*scores.names, name],
                        num_none=[*scores.num_none, sum(math.isnan(v) for v in column.tolist())],
                        num_errors=[*scores.num_errors, 0], error_texts=[*scores.error_texts, None])
