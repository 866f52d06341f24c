"""A step that runs out of device memory is retried once with a leaner plan, from the same state.

`retry_on_oom(ctx, step, phase, attempt, reset)` runs `attempt()`; on `torch.OutOfMemoryError` it frees what the
failed attempt held, calls `reset()` (which puts the step's state back: the data position and RNG before a
rollout, the gradients and RNG before an update), applies the next settings of `memory_plan.leaner` to the run
and calls `attempt()` once more; a second error ends the run as before. Nothing is lost: the rollout is redone
with the same prompts and seeds (the static engine's samples do not depend on its waves), or reused for the
update, and an update is retried only if no optimizer step of it was taken. The settings stay lean for the rest
of the run; a warning names them and the step's record counts the retry (`memory/oom_retries`).

One process only: under torchrun one rank's retry would leave the others waiting in a collective, so the error
ends the run there as before (and with train.async_rollout, whose rollout runs on another thread, and with
train.fsdp_offload).
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from logitless.models.tiled_mlp import tile_mlps
from logitless.trainer.memory import plan as mp
from logitless.trainer.memory.model import base_model

T = TypeVar("T")


@dataclass
class MemoryState:
    """The plan's view of the run and its current settings (changed by retries)."""

    model: mp.ModelMemory
    step: mp.StepShape  # the plan's sizes (the longest prompt the config allows)
    facts: mp.RunFacts
    knobs: mp.Knobs
    planned: bool  # a plan was made (CUDA, or train.memory_budget_gib set): predictions are logged
    retries: int = 0  # retries in the current step
    phase: str = "train"  # the update's phase running now ("logprobs" or "train")


def micro_batch_tokens(m: Any, packed: bool) -> int:
    """Tokens a micro-batch computes: its rows' own when packed, rows x (prompt + completion columns) padded."""
    if packed:
        return int(m.prompt_mask.sum()) + int(m.completion_mask.sum())
    return m.prompt_ids.shape[0] * (m.prompt_ids.shape[1] + m.completion_ids.shape[1])


def step_predictions(state: MemoryState, prompts: int, prompt_ids: torch.Tensor, micro: list, packed: bool) -> dict[str, float]:
    """`memory/predicted_gb/<phase>` of a step at its own sizes: its prompts' width (the rollout's cache) and its
    largest micro-batch (the update)."""
    rows, width = prompt_ids.shape
    step = dataclasses.replace(state.step, prompts=prompts, rows=rows, prompt_len=width)
    out = {"generate": mp.generate_bytes(state.model, step, state.facts, state.knobs)}
    if micro:
        tokens = max(micro_batch_tokens(m, packed) for m in micro)
        knobs = dataclasses.replace(state.knobs, micro_batch_tokens=tokens, by_rows=False)
        if state.facts.logprob_pass:
            out["logprobs"] = mp.logprob_bytes(state.model, step, state.facts, knobs)
        out["train"] = mp.train_bytes(state.model, step, state.facts, knobs, tokens=tokens)
    return {f"memory/predicted_gb/{p}": sum(parts.values()) / mp.GIB for p, parts in out.items()}


def apply_knobs(ctx: Any, knobs: mp.Knobs) -> list[str]:
    """Put `knobs` into effect for the rest of the run (config, model, engine); returns the changed settings."""
    cfg, old = ctx.cfg, ctx.memory.knobs
    changes = {}
    if knobs.gradient_checkpointing and not old.gradient_checkpointing:
        enable_checkpointing(ctx.model, lora=cfg.model.lora)
        changes["model.gradient_checkpointing"] = True
    if knobs.activation_offload != old.activation_offload:
        changes["model.activation_offload"] = knobs.activation_offload
    if knobs.tiled_mlp and not old.tiled_mlp:
        tile_mlps(ctx.model, knobs.mlp_chunk_tokens)  # a compiled layer recompiles (its guards see the new forward)
        changes["model.mlp_chunk_tokens"] = knobs.mlp_chunk_tokens
    if knobs.micro_batch_tokens != old.micro_batch_tokens:
        changes["train.micro_batch_tokens"] = knobs.micro_batch_tokens
    if knobs.micro_batch_size != old.micro_batch_size:
        changes["train.micro_batch_size"] = knobs.micro_batch_size
    if knobs.max_kv_gib != old.max_kv_gib:
        ctx.rollout.engine.max_kv_gib = knobs.max_kv_gib
        changes["rollout.max_kv_gib"] = knobs.max_kv_gib
    sections: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    ctx.cfg = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})
    ctx.memory.knobs = knobs
    return [f"{k}={v}" for k, v in changes.items()]


def enable_checkpointing(model: torch.nn.Module, *, lora: bool) -> None:
    """Gradient checkpointing on a model already prepared for training (as `prepare_for_training` turns it on)."""
    base = base_model(model)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False
    if lora:
        base.enable_input_require_grads()


def free_memory(device: torch.device) -> None:
    """Give the memory of a failed attempt back (its tensors are garbage once the error is dropped)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def retry_on_oom(ctx: Any, step: int, phase: str, attempt: Callable[[], T], reset: Callable[[], None]) -> T:
    """`attempt()`, retried once with leaner settings after an out-of-memory error (see the module docstring).
    `phase`: "generate" or "update" (the update says itself whether logprobs or train failed)."""
    state: MemoryState | None = ctx.memory
    steps_before = ctx.scheduler.last_epoch
    try:
        return attempt()
    except torch.OutOfMemoryError as e:
        where = state.phase if phase == "update" and state is not None else phase
        why = _no_retry(ctx, state, where, steps_before)
        if why is not None:
            raise type(e)(f"{_first_line(e)} (step {step}, {where}; no retry: {why})") from e
        first_line = _first_line(e)
    free_memory(ctx.device)  # the error (and the failed attempt's tensors it held) is gone here
    knobs = _leaner(ctx, state, where)
    reset()
    changed = apply_knobs(ctx, knobs)
    state.retries += 1
    warnings.warn(f"step {step} ran out of device memory in its {where} phase ({first_line}); retrying it with "
                  f"{', '.join(changed)} (kept for the rest of the run)", stacklevel=2)
    try:
        return attempt()
    except torch.OutOfMemoryError as e:
        raise type(e)(f"{_first_line(e)} (step {step}, again after its retry with {', '.join(changed)}; no retry: "
                      "the step was retried once already). Lower train.memory_budget_gib (the plan then starts "
                      "leaner), or lower rollout.max_completion_length or train.prompts_per_step") from e


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else "out of memory"


def _leaner(ctx: Any, state: MemoryState, where: str) -> mp.Knobs | None:
    return mp.leaner(state.model, state.step, state.facts, state.knobs, where,
                     cache_len=getattr(ctx.rollout.engine, "cache_length", 0))


def _no_retry(ctx: Any, state: MemoryState | None, where: str, steps_before: int) -> str | None:
    """Why a step that ran out of memory in `where` cannot be retried, or None."""
    if state is None:
        return "no memory plan"
    if ctx.world.size > 1:
        return "under torchrun the other ranks would wait in a collective"
    if ctx.world.sharded:
        return "train.fsdp_offload's sharded model keeps its settings"
    if ctx.rollout.prefetch is not None:
        return "train.async_rollout runs the rollout on another thread"
    if state.retries:
        return "the step was retried once already"
    if ctx.scheduler.last_epoch != steps_before:
        return "an optimizer step of it was already taken"
    if _leaner(ctx, state, where) is None:
        return "the settings are the leanest already" if where != "generate" or state.facts.backend == "static" \
            else f"rollout.backend={state.facts.backend} has no KV cap (rollout.backend=static decodes in waves)"
    return None


def memory_state(ctx: Any, resolved: Any) -> MemoryState:
    """The run's MemoryState: the plan's model and sizes where a plan was made, else read from the loaded model
    (so that a retry has its ladder on CPU too)."""
    from logitless.trainer.memory import auto

    cfg = ctx.cfg
    if resolved.plan is not None:
        return MemoryState(resolved.model, resolved.step, resolved.facts, mp.knobs_of(cfg), planned=True)
    dtype = ctx.model.get_input_embeddings().weight.dtype
    kernels = auto.layer_kernels(cfg.model.compile_layers, cfg.model.liger_kernels)
    return MemoryState(auto.model_memory(ctx.model, cfg.model, dtype), auto.step_shape(cfg, ctx.model, ctx.world.size),
                       auto.run_facts(cfg, cfg.rollout.backend, kernels, ctx.device), mp.knobs_of(cfg), planned=False)


def memory_metrics(ctx: Any, ro: Any, plan: Any) -> dict[str, float]:
    """The step's `memory/oom_retries`, and its `memory/predicted_gb/<phase>` where a plan was made."""
    out = {"memory/oom_retries": float(ctx.memory.retries)}
    if ctx.memory.planned:
        micro = plan.micro[: len(plan.micro) - plan.padding]
        out.update(step_predictions(ctx.memory, len(ro.rows), ro.batch.prompt_ids, micro, ctx.cfg.train.packed is True))
    return out
