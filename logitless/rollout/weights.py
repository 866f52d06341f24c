"""Where a rollout engine gets its decode weights: one interface, "sync from the trainable parameters".

A `WeightSource` has a `module` (the causal LM the engine runs) and `sync()` (bring that module's weights up to
date with the trainable parameters). The engine calls `sync()` at the start of every `generate`; the rollout
knows nothing of optimizers, and a sharded trainer (FSDP2) plugs in a source that gathers its shards into the
same module.

- `LiveWeights(model)`: the model itself, as is (a plain model, or PEFT with unmerged adapters). No copy, no sync.
- `MergedLoraWeights(peft_model)`: a plain-model view for decoding at plain-model speed. Every LoRA-wrapped layer
  becomes a copy of its base layer holding W + ΔW (ΔW = peft's `get_delta_weight` of the active adapters, the sum
  formed in fp32 and rounded once to the base dtype); every other parameter and buffer is shared with the
  training model, so the copy costs only the targeted layers' weights (`extra_bytes`). The merged tensors keep
  their addresses across syncs (updated with `copy_`), so a CUDA graph captured over them stays valid. The base
  weights are never written: merging in place and unmerging in bf16 would change them by rounding at every step.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, runtime_checkable

import torch

from .engine import unwrap_model


@runtime_checkable
class WeightSource(Protocol):
    """Decode weights for a rollout engine."""

    @property
    def module(self) -> Any: ...  # the causal LM the engine decodes with

    def sync(self) -> None: ...  # bring `module` up to date with the trainable parameters


class LiveWeights:
    """Decode with the model itself (its parameters are read in place, so there is nothing to sync)."""

    def __init__(self, model: Any):
        self.module = model
        self.extra_bytes = 0

    def sync(self) -> None:
        return None


def lora_layers(model: Any) -> list[tuple[str, Any]]:
    """(qualified name, layer) of every PEFT LoRA layer in `model`."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def merge_refusal(model: Any) -> str | None:
    """Why `model`'s adapters cannot be merged into an inference copy (None if they can)."""
    layers = lora_layers(model)
    if not layers:
        return "the model has no LoRA adapters"
    for name, layer in layers:
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"layer {name} wraps a {type(base).__name__} whose weight is not a plain float tensor (quantized?)"
        if any(layer.use_dora.get(a, False) for a in layer.active_adapters):
            return f"layer {name} uses DoRA, whose update is not an additive weight delta"
        if getattr(layer, "merged", False):
            return f"layer {name} already has adapters merged into its base weights"
    return None


def fresh_copy(module: Any, memo: dict | None = None) -> Any:
    """`copy.deepcopy(module, memo)` without a compiled call inherited from `module` (it would run the original)."""
    out = copy.deepcopy(module, memo)
    for attr in ("_compiled_call", "_last_compile_config"):
        out.__dict__.pop(attr, None)
    return out


class MergedLoraWeights:
    """A plain-model inference copy of a PEFT LoRA model: merged weights for the LoRA layers, everything else
    shared. `sync()` recomputes W + ΔW from the current adapters in place."""

    def __init__(self, peft_model: Any):
        why = merge_refusal(peft_model)
        if why is not None:
            raise ValueError(f"rollout.merge_lora=true cannot merge this model's adapters: {why}; set "
                             "rollout.merge_lora=false to decode with the unmerged PEFT model")
        base = unwrap_model(peft_model)  # the transformers model with LoRA layers injected
        shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}  # deepcopy shares, never copies, these
        self.module = fresh_copy(base, memo=shared)
        self._pairs: list[tuple[Any, torch.Tensor]] = []  # (training-side LoRA layer, merged weight)
        copies = dict(lora_layers(self.module))
        for name, layer in lora_layers(base):
            plain = copy.copy(layer.get_base_layer())  # same class and attributes, own parameter dict
            plain._parameters = dict(plain._parameters)
            merged = torch.nn.Parameter(torch.empty_like(plain.weight), requires_grad=False)
            plain.weight = merged
            assert copies[name] is self.module.get_submodule(name)
            self.module.set_submodule(name, plain)
            self._pairs.append((layer, merged.data))
        self.module.eval().requires_grad_(False)
        self.extra_bytes = sum(w.numel() * w.element_size() for _, w in self._pairs)
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        for layer, merged in self._pairs:
            w = layer.get_base_layer().weight.float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                    w = w + layer.get_delta_weight(adapter).float()
            merged.copy_(w)


def rollout_weights(model: Any, merge_lora: bool | None) -> WeightSource:
    """The weight source for `model`: merged LoRA when `merge_lora` (None: when the adapters can be merged), else
    the model itself."""
    if merge_lora is False:
        return LiveWeights(model)
    has_lora = hasattr(model, "peft_config")
    if merge_lora is None and (not has_lora or merge_refusal(model) is not None):
        return LiveWeights(model)
    if not has_lora:
        raise ValueError("rollout.merge_lora=true needs a LoRA model (model.lora_r > 0); unset it for full fine-tuning")
    return MergedLoraWeights(model)
