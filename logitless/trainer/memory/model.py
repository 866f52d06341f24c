"""The memory plan's view of a model, read without its weights: a meta-device skeleton built from the model's config,
and `model_memory` (its sizes, LoRA targets and 4-bit storage as `memory_plan.ModelMemory`)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from logitless.models import UnsupportedModelError
from logitless.models import nf4_experts
from logitless.models.experts import EXPERT_PARAMS, QUANTIZED, expert_modules, moe_shape
from logitless.models.tiled_mlp import untileable_reason
from logitless.models.vision import model_class
from logitless.rollout.fp8 import is_projection
from logitless.rollout.layouts import text_config
from logitless.models.nf4_experts import is_4bit
from logitless.trainer.memory import plan as mp
from logitless.trainer.config.schema import ModelConfig


def model_skeleton(cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of `cfg` built from its config on the meta device: its class, modules and parameter shapes,
    no weights read (the hub's or folder's config.json, from the local cache when it is there, or a GGUF file's
    metadata: `model_checks.read_model_config`, as the preflight reads it)."""
    from logitless.trainer.checks.model import read_model_config
    from logitless.trainer.checks.sources import model_cached

    config = read_model_config(cfg, cached=model_cached(cfg))
    with torch.device("meta"):
        return model_class(config).from_config(config, trust_remote_code=cfg.trust_remote_code, dtype=dtype)


def base_model(model: Any) -> Any:
    """The transformers model under any peft wrappers."""
    while hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _targets(cfg: ModelConfig, name: str, out_layer: Any, module: Any) -> bool:
    """Whether peft's LoRA config of `cfg` targets linear layer `name` (peft's matching rules)."""
    target = cfg.lora_target_modules
    if module is out_layer:
        return False
    if target == "all-linear":
        return True
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def model_memory(model: Any, cfg: ModelConfig, dtype: torch.dtype) -> mp.ModelMemory:
    """The plan's view of `model` (a skeleton, or a loaded model before or after peft wrapped it) for the settings
    of `cfg`: LoRA rank and targets, 4-bit loading, the compute dtype."""
    base = base_model(model)
    tc = text_config(base)
    heads = getattr(tc, "num_attention_heads", None) or 1  # (a model without attention: its KV counts as one head)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    inter = getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size
    moe = moe_shape(tc)
    if moe is not None:  # a token goes through k experts (and a shared one): the activations' MLP width
        inter = moe.active_intermediate
    out_layer = base.get_output_embeddings()
    width = torch.tensor([], dtype=dtype).element_size()
    modules = [m for _, m in expert_modules(base)]
    experts = {id(p): p for m in modules for p in m.parameters(recurse=False)}
    stacks = {id(p) for m in modules for n, p in m.named_parameters(recurse=False) if n in EXPERT_PARAMS and p.dim() == 3}
    # QLoRA quantizes the linear layers (bitsandbytes) and the fused 3-D expert stacks (models/nf4_experts.py);
    # routers and biases stay in the compute dtype
    quantized = ({id(m.weight) for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)
                  and m is not out_layer} | stacks) if cfg.load_in_4bit else set()
    stored = [meta.shape for m in modules for meta in getattr(m, QUANTIZED, {}).values()]  # loaded 4-bit stacks
    weight_bytes = params = lora_params = expert_bytes = 0
    for shape in stored:  # (buffers, not parameters: counted as the skeleton's stacks are)
        params += math.prod(shape)
        weight_bytes += int(math.prod(shape) * mp.NF4_BYTES)
        expert_bytes += int(math.prod(shape) * mp.NF4_BYTES)
    for name, p in base.named_parameters():
        if "lora_" in name:
            lora_params += p.numel()
            continue
        if is_4bit(p):  # a loaded QLoRA model: packed already, its storage is what it takes
            params += 2 * p.numel() * p.element_size()
            weight_bytes += int(p.numel() * p.element_size() * mp.NF4_BYTES / 0.5)
            continue
        params += p.numel()
        size = int(p.numel() * (mp.NF4_BYTES if id(p) in quantized else width))
        weight_bytes += size
        expert_bytes += size if id(p) in experts else 0
    expert_params = sum(p.numel() for p in experts.values()) + sum(math.prod(shape) for shape in stored)
    # 4-bit stacks compute dequantized, one MoE layer at a time: the largest layer's stacks in the compute dtype
    layer_stacks = [sum(math.prod(s) for s in nf4_experts.stack_shapes(m).values()) for m in modules]
    dequantized = max(layer_stacks, default=0) * width if cfg.load_in_4bit else 0
    active = params - (expert_params - expert_params * moe.active // moe.experts if moe is not None else 0)
    trainable, copy = lora_params, 0
    if cfg.lora and not lora_params:
        for name, m in base.named_modules():
            if isinstance(m, torch.nn.Linear) and _targets(cfg, name, out_layer, m):
                trainable += cfg.lora_r * (m.in_features + m.out_features)
                copy += m.in_features * m.out_features * width
        if cfg.lora_target_experts:  # an adapter per expert (trainer/policy/lora_targets.py expert_targets), a merged stack
            rank = max(1, cfg.lora_r // moe.active) if moe is not None else cfg.lora_r
            for stack in (p for p in experts.values() if p.dim() == 3):
                trainable += rank * stack.shape[0] * (stack.shape[1] + stack.shape[2])
                copy += stack.numel() * width
    elif cfg.lora:  # (a peft expert wrapper's in/out features are one expert's)
        copy = sum(m.in_features * m.out_features * getattr(m, "num_experts", 1) * width
                   for name, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "in_features"))
    fp8 = fp8_sizes(base, cfg, out_layer, width)
    return mp.ModelMemory(
        layers=tc.num_hidden_layers, hidden=tc.hidden_size, intermediate=inter, q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim, vocab=base.get_input_embeddings().weight.shape[0], dtype_bytes=width,
        weight_bytes=weight_bytes, params=params, trainable=trainable if cfg.lora else params, lora=cfg.lora,
        merge_copy_bytes=copy, mlp_tileable=_tileable(base), expert_bytes=expert_bytes, active_params=active,
        dequantized_expert_bytes=dequantized, fp8_bytes=fp8[0], fp8_source_bytes=fp8[1], fp8_merge_bytes=fp8[2],
    )


def fp8_sizes(base: Any, cfg: ModelConfig, out_layer: Any, width: int) -> tuple[int, int, int]:
    """rollout.fp8's sizes of `base` (a skeleton, or a loaded model with or without LoRA layers): (the FP8
    projections: 1 byte per weight and 4 per output row, what those projections take in the model's weights (4-bit
    with QLoRA), the FP8 bytes of the LoRA-targeted ones among them)."""
    fp8 = source = merged = 0
    for name, m in base.named_modules():
        path = name
        while path.endswith(".base_layer"):  # a loaded LoRA layer's base: the projection it wraps
            path = path.removesuffix(".base_layer")
        if not isinstance(m, torch.nn.Linear) or m is out_layer or not is_projection(path):
            continue
        size = m.in_features * m.out_features + 4 * m.out_features
        fp8 += size
        source += int(m.in_features * m.out_features * (mp.NF4_BYTES if cfg.load_in_4bit else width))
        if cfg.lora and (path != name or _targets(cfg, name, out_layer, m)):
            merged += size
    return fp8, source, merged


def _tileable(model: Any) -> bool:
    """Whether every decoder layer of `model` has a dense gated MLP that `models.tiled_mlp` can tile."""
    try:
        return untileable_reason(model) is None
    except UnsupportedModelError:  # no decoder layers found
        return False


def moe_summary(m: mp.ModelMemory) -> str | None:
    """One line on a mixture of experts' sizes as the plan counts them (None for a dense model)."""
    if not m.expert_bytes:
        return None
    count = lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"  # noqa: E731
    size = lambda b: f"{b / mp.GIB:.2f} GiB" if b >= 0.1 * mp.GIB else f"{b / 2**20:.2f} MiB"  # noqa: E731
    held = (f"4-bit, one MoE layer's dequantized at a time: {size(m.dequantized_expert_bytes)}"
            if m.dequantized_expert_bytes else "in the compute dtype")
    return (f"mixture of experts: {count(m.params)} parameters, {count(m.active_params)} active per token; the expert "
            f"stacks are {size(m.expert_bytes)} of the {size(m.weight_bytes)} of weights (held whole: every expert is "
            f"resident, {held}); activations at the active MLP width {m.intermediate:,}")
