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
  They can also live in sleepable memory (freed between rollouts) or in the base weights themselves during the
  rollout only (`MergedLoraWeights`'s modes).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, runtime_checkable

import torch

from .engine import unwrap_model
from .sleep import SleepableMemory


@runtime_checkable
class WeightSource(Protocol):
    """Decode weights for a rollout engine."""

    @property
    def module(self) -> Any: ...  # the causal LM the engine decodes with

    def sync(self) -> None: ...  # bring `module` up to date with the trainable parameters

    def release(self) -> None: ...  # the rollout is over: free what the next `sync` rebuilds (if anything)


class LiveWeights:
    """Decode with the model itself (its parameters are read in place, so there is nothing to sync)."""

    def __init__(self, model: Any):
        self.module = model
        self.extra_bytes = 0

    def sync(self) -> None:
        return None

    def release(self) -> None:
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
    """A plain-model inference view of a PEFT LoRA model: merged weights W + ΔW for the LoRA layers, every other
    parameter and buffer shared. `sync()` recomputes W + ΔW from the current adapters. Where the merged weights
    live (`mode`):
    - "resident": a copy of the LoRA layers' weights beside the model (`extra_bytes` of device memory, always).
    - "sleep" (CUDA): that copy in `SleepableMemory`, freed by `release()` after each rollout and mapped back at
      the same addresses by the next `sync()`: device memory during rollouts only.
    - "in_place": no copy. `sync()` writes W + ΔW into the frozen base weights themselves and `release()` writes
      the exact base weights back from a pinned host copy taken at construction (the base never trains), so the
      training model is bit-for-bit unchanged outside the rollout. Costs the host copy and one host-to-device copy
      of the LoRA layers' weights per rollout.
    """

    MODES = ("resident", "sleep", "in_place")

    def __init__(self, peft_model: Any, mode: str = "resident"):
        if mode not in self.MODES:
            raise ValueError(f"rollout.weight_copy={mode!r}: use one of {', '.join(self.MODES)}")
        why = merge_refusal(peft_model)
        if why is not None:
            raise ValueError(f"rollout.merge_lora=true cannot merge this model's adapters: {why}; set "
                             "rollout.merge_lora=false to decode with the unmerged PEFT model")
        base = unwrap_model(peft_model)  # the transformers model with LoRA layers injected
        if mode == "in_place":
            trained = [n for n, layer in lora_layers(base) if layer.get_base_layer().weight.requires_grad]
            if trained:
                raise ValueError(f"rollout.weight_copy=in_place merges into frozen base weights, but {trained[0]}'s "
                                 "base weight trains; use rollout.weight_copy=resident")
        shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}  # deepcopy shares, never copies, these
        self.module = fresh_copy(base, memo=shared).eval()  # shared parameters keep their requires_grad
        self.mode = mode
        self._pairs: list[tuple[Any, torch.nn.Parameter]] = []  # (training-side LoRA layer, merged weight)
        copies = dict(lora_layers(self.module))
        for name, layer in lora_layers(base):
            plain = copy.copy(layer.get_base_layer())  # same class and attributes, own parameter dict
            plain._parameters = dict(plain._parameters)
            if mode != "in_place":
                plain.weight = torch.nn.Parameter(torch.empty_like(plain.weight), requires_grad=False)
            assert copies[name] is self.module.get_submodule(name)
            self.module.set_submodule(name, plain)
            self._pairs.append((layer, plain.weight))
        self._host: list[torch.Tensor] = []  # in_place: the exact base weights
        if mode == "in_place":
            pin = self._pairs[0][1].device.type == "cuda"
            self._host = [w.detach().to("cpu", copy=True) for _, w in self._pairs]
            self._host = [h.pin_memory() if pin else h for h in self._host]
        self.extra_bytes = 0 if mode == "in_place" else sum(w.numel() * w.element_size() for _, w in self._pairs)
        self.memory = SleepableMemory([w for _, w in self._pairs]) if mode == "sleep" else None
        self._merged = False  # in_place: the base weights hold W + ΔW now
        self.sync()
        self.release()

    @torch.no_grad()
    def release(self) -> None:
        """The rollout is over: free the sleeping copy, or write the exact base weights back (in_place)."""
        if self.memory is not None:
            self.memory.sleep()
        self._restore()

    def _restore(self) -> None:
        if self._merged:
            for (_, w), h in zip(self._pairs, self._host):
                w.copy_(h, non_blocking=True)  # from pinned memory, ordered before any later kernel
            self._merged = False

    @torch.no_grad()
    def sync(self) -> None:
        """Set every merged weight to W + ΔW of the current adapters (the sum in fp32, rounded once)."""
        if self.memory is not None:
            self.memory.wake()
        self._restore()  # in_place and not released yet: merge from the exact base, never twice
        for layer, merged in self._pairs:
            w = layer.get_base_layer().weight.float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                    w = w + layer.get_delta_weight(adapter).float()
            merged.copy_(w)
        self._merged = self.mode == "in_place"


def merges(model: Any, merge_lora: bool | None) -> bool:
    """Whether `rollout_weights(model, merge_lora)` decodes from merged LoRA weights (raises where merge_lora=true
    cannot apply)."""
    if merge_lora is False:
        return False
    has_lora = hasattr(model, "peft_config")
    if merge_lora is None:
        return has_lora and merge_refusal(model) is None
    if not has_lora:
        raise ValueError("rollout.merge_lora=true needs a LoRA model (model.lora_r > 0); unset it for full fine-tuning")
    return True


def rollout_weights(model: Any, merge_lora: bool | None, mode: str = "resident") -> WeightSource:
    """The weight source for `model`: merged LoRA when `merge_lora` (None: when the adapters can be merged; `mode`:
    where the merged weights live, see `MergedLoraWeights`), else the model itself."""
    return MergedLoraWeights(model, mode) if merges(model, merge_lora) else LiveWeights(model)
