"""The rollout's engine for a run: which backend decodes, from which weights (the model itself or a merged-LoRA copy,
kept where rollout.weight_copy says; with rollout.fp8 an FP8 copy of either), and the sampling options of the rollout
section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from logitless.models.routing import require_routing, routing_of
from logitless.rollout import RolloutEngine, SamplingOptions, make_engine, sleep
from logitless.rollout.engine import unwrap_model
from logitless.rollout.fp8 import Fp8Weights, fp8_layers, require_fp8
from logitless.rollout.weights import LiveWeights, MergedLoraWeights, WeightSource, in_place_refusal, merges
from logitless.trainer.config.schema import RolloutConfig


@dataclass(frozen=True)
class EngineChoice:
    """What a run's placement decides for its engine beside the rollout section, which it never rewrites: the
    defaults leave every decision to the section."""

    replica: bool = False  # the engine decodes from a replica, which fused its projections and syncs itself
    merged_replica: bool = False  # ... a plain model with the LoRA merged in (nothing left to merge)
    resident: bool = False  # a weight copy of the engine's own, kept resident (a replica; an async rollout)
    decode_attention: str | None = None  # rollout.decode_attention's "auto" as the run decides it
    record_routes: bool = False  # record mixture-of-experts routes for replay (`routing_replay_on`)


def make_rollout_engine(cfg: RolloutConfig, model: Any, tokenizer: Any, choice: EngineChoice = EngineChoice()
                        ) -> RolloutEngine:
    """The rollout section's engine; backend "static" decodes from merged LoRA weights when rollout.merge_lora
    allows (`MergedLoraWeights`, kept where rollout.weight_copy says), else from the model, under the
    rollout.max_kv_gib budget. `choice`: the run's placement decisions (`placement.RolloutPlacement`)."""
    if cfg.backend != "static":
        return make_engine(cfg.backend, model, tokenizer, **({"record_routes": True} if choice.record_routes else {}))
    if cfg.fp8:
        return make_engine("static", model, tokenizer, weights=fp8_weights(cfg, model, choice),
                           **_static_options(cfg, choice))
    merged = merges(model, None if choice.merged_replica else cfg.merge_lora)
    mode = "resident" if choice.resident else weight_copy(
        cfg, next(model.parameters()).device, has_copy=merged, distributed=False,
        in_place_why=in_place_refusal(model) if merged else None)
    fuse = choice.replica or cfg.fuse_projections is not False
    weights = MergedLoraWeights(model, mode, fuse=fuse) if merged else LiveWeights(model)
    if not choice.replica:
        check_fused(cfg, getattr(weights, "groups", []),
                    "the model has no plain q/k/v or gate/up layers" if merged else
                    "the engine decodes with the training model itself (full fine-tuning on one process, "
                    "rollout.merge_lora=false, or DoRA adapters), whose layout the rollout does not change")
    return make_engine("static", model, tokenizer, weights=weights, **_static_options(cfg, choice))


def _static_options(cfg: RolloutConfig, choice: EngineChoice) -> dict[str, Any]:
    """The static engine's options of the rollout section (beside its weights)."""
    return dict(max_kv_gib=cfg.max_kv_gib, profile=cfg.profile, length_buckets=cfg.length_buckets,
                compact_finished=cfg.compact_finished, decode_attention=choice.decode_attention or cfg.decode_attention,
                sampler_kernel=cfg.sampler_kernel, step_graph=cfg.step_graph, refill=cfg.refill,
                record_routes=choice.record_routes)


def fp8_weights(cfg: RolloutConfig, model: Any, choice: EngineChoice) -> WeightSource:
    """rollout.fp8's decode weights: a replica's module as it is (FP8 already, synced by the placement), else an FP8
    copy (`Fp8Weights`) of the model, or of its merged-LoRA view where rollout.merge_lora allows. The copy is kept
    where rollout.weight_copy says (`fp8_copy`); the merge before each quantization is made in the base weights
    themselves and written back (in_place) where they can take it, else in a copy freed right after (sleep, on
    CUDA) or kept (resident)."""
    if fp8_layers(unwrap_model(model)):
        return LiveWeights(model)
    device = next(model.parameters()).device
    require_fp8(device)
    mode = "resident" if choice.resident else fp8_copy(cfg, device)
    inner: WeightSource = LiveWeights(model)
    if merges(model, cfg.merge_lora):
        merge = "resident" if choice.resident else "in_place" if in_place_refusal(model) is None else \
            "sleep" if sleep.unavailable(device) is None else "resident"
        inner = MergedLoraWeights(model, merge)
    weights = Fp8Weights(inner, fuse=cfg.fuse_projections is not False, sleep=mode == "sleep")
    check_fused(cfg, weights.groups, "the model has no plain q/k/v or gate/up projections")
    return weights


def fp8_copy(cfg: RolloutConfig, device: torch.device) -> str:
    """Where rollout.fp8's copy lives (rollout.weight_copy): the setting, or when unset sleep on CUDA (where sleepable
    memory works) and resident otherwise. Raises where sleep cannot apply (in_place is refused by the config)."""
    if cfg.weight_copy is None:
        return "sleep" if sleep.unavailable(device) is None else "resident"
    if cfg.weight_copy == "sleep" and sleep.unavailable(device) is not None:
        raise ValueError(f"rollout.weight_copy=sleep cannot apply: {sleep.unavailable(device)}; unset "
                         "rollout.weight_copy or set it to resident")
    return cfg.weight_copy


ROUTE_BACKENDS = ("static", "hf")  # rollout backends that record mixture-of-experts routes


def routing_replay_on(cfg: Any, model: Any, *, agent: bool, separate_decode: bool) -> bool:
    """model.routing_replay resolved: whether the rollout records each token's experts and the trainer's forwards
    replay them (`models/routing.py`). "auto": on for a mixture-of-experts model with a supported router wherever
    routes can be recorded (rollout.backend static or hf, single-turn, decoded in this process); true: the same,
    with an error naming what stands in the way."""
    want = cfg.model.routing_replay
    if want is False:
        return False
    base = unwrap_model(model)
    if routing_of(base) is None:
        if want is True:
            require_routing(base, "model.routing_replay")  # raises, saying why
        return False
    why = routing_replay_obstacle(cfg.rollout.backend, agent, separate_decode)
    if why is not None and want is True:
        raise ValueError(f"model.routing_replay=true: {why}; set model.routing_replay=auto (off here) or false")
    return why is None


def routing_replay_obstacle(backend: str, agent: bool, separate_decode: bool) -> str | None:
    """Why the rollout cannot record routes for replay (None: it can; backend "auto" counts as one that can)."""
    if backend not in (*ROUTE_BACKENDS, "auto"):
        return f"rollout.backend={backend} does not record routes (use static or hf)"
    if agent:
        return "multi-turn episodes (agent.tools / agent.environment / agent.driver) do not record routes yet"
    if separate_decode:
        return ("a shared rollout GPU's decode process or a tensor-parallel rollout (rollout.device or "
                "rollout.tensor_parallel under torchrun) does not record routes yet")
    return None


def decode_attention_for(packed: bool) -> str:
    """rollout.decode_attention for `auto` in a run: the static engine's decode attention rounds as the trainer's own
    attention does where one of its kernels is the trainer's. Padded micro-batches run torch's sdpa (its
    memory-efficient kernel), so the decode takes sdpa: the sampler then tracks the trainer to hf's level on every
    family (bench/LOG.md, "The decode kernel rounds as the trainer does"). Packed ones run varlen flash attention,
    which none of the decode's kernels is, so the decode takes the engine's own choice (`auto`: the Triton
    flash-decoding kernel on a recent CUDA GPU, 1.38-1.60x faster than sdpa per decode step); each run logs the gap
    it has (`rollout/mismatch_*`)."""
    return "auto" if packed else "sdpa"

def check_fused(cfg: RolloutConfig, groups: list, why: str) -> None:
    """Refuse rollout.fuse_projections=true where the rollout's weights fused nothing (`why` says why not)."""
    if cfg.fuse_projections and not groups:
        raise ValueError(f"rollout.fuse_projections=true found no projections to fuse: {why}; unset "
                         "rollout.fuse_projections")

def weight_copy(cfg: RolloutConfig, device: torch.device, *, has_copy: bool, distributed: bool,
                in_place_why: str | None = None) -> str:
    """Where the rollout's merged weights or replica live (rollout.weight_copy; see `MergedLoraWeights`): the
    setting, or when unset in_place on one CUDA process (sleep where the base weights cannot take the merge:
    4-bit), sleep under torchrun on CUDA, resident otherwise. Raises when the setting cannot apply."""
    mode = cfg.weight_copy
    if mode is None:
        if not has_copy or device.type != "cuda":
            return "resident"
        if not distributed and in_place_why is None:
            return "in_place"
        return "sleep" if sleep.unavailable(device) is None else "resident"
    why = None
    if not has_copy:
        why = ("the engine decodes with the training model itself (no merged-LoRA copy: full fine-tuning on one "
               "process, rollout.merge_lora=false, or DoRA adapters)")
    elif mode == "sleep":
        why = sleep.unavailable(device)
    elif mode == "in_place":
        why = ("the training weights are sharded (torchrun or train.fsdp_offload; use sleep or resident)" if distributed
               else in_place_why)
    if why is not None and mode != "resident":
        raise ValueError(f"rollout.weight_copy={mode} cannot apply: {why}; unset rollout.weight_copy or set it to "
                         "resident")
    return mode

def sampling_options(
    cfg: RolloutConfig,
    *,
    seed: int | None,
    num_generations: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    section: str = "rollout",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> SamplingOptions:
    """`logitless.rollout.SamplingOptions` of the rollout section (TRL names mapped to the engine's);
    `chat_template_kwargs`: data.chat_template_kwargs.

    An invalid option is reported under its config key (`rollout.top_p`, or `eval.pass_k` for `section="eval"`).
    """
    options = SamplingOptions(
        num_generations=cfg.num_generations if num_generations is None else num_generations,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
        max_new_tokens=cfg.max_completion_length if max_new_tokens is None else max_new_tokens,
        stop=list(cfg.stop),
        seed=seed,
        max_prompt_length=cfg.max_prompt_length,
        chat_template_kwargs=dict(chat_template_kwargs) if chat_template_kwargs else None,
    )
    keys = {f: f"rollout.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                                         "max_prompt_length", "num_generations")}
    keys["max_new_tokens"] = "rollout.max_completion_length"
    if section == "eval":
        keys["num_generations"] = "eval.pass_k"
        if max_new_tokens is not None:
            keys["max_new_tokens"] = "eval.max_completion_length"
    try:
        options.validate()
    except (ValueError, TypeError) as e:
        message = str(e)
        for name, key in keys.items():
            message = message.replace(f"SamplingOptions.{name}", key)
        raise type(e)(message) from None
    return options
