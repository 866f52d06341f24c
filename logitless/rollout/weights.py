"""Where a rollout engine gets its decode weights: one interface, "sync from the trainable parameters".

A `WeightSource` has a `module` (the causal LM the engine runs) and `sync()` (bring that module's weights up to
date with the trainable parameters). The engine calls `sync()` at the start of every `generate`; the rollout
knows nothing of optimizers, and a sharded trainer (FSDP2) plugs in a source that gathers its shards into the
same module.

- `LiveWeights(model)`: the model itself, as is (a plain model, or PEFT with unmerged adapters). No copy, no sync.
- `MergedLoraWeights(peft_model, mode)`: a plain-model view for decoding at plain-model speed. Every LoRA-wrapped
  layer becomes a copy of its base layer (for QLoRA's 4-bit layers a plain linear layer, W dequantized) holding
  W + ΔW (ΔW = peft's `get_delta_weight` of the active adapters, the sum formed in fp32 and rounded once to the
  base dtype), and every experts module with LoRA on its fused 3-D stacks (peft's `ParamWrapper`,
  model.lora_target_experts) a copy holding each expert's W + ΔW; every other parameter and buffer is shared with
  the training model. The merged tensors keep their addresses across syncs (updated with `copy_`), so a CUDA graph
  captured over them stays valid. Where they live (`mode`): a resident copy (`extra_bytes`), a copy in sleepable
  memory freed between rollouts (`sleep.py`), or the base weights themselves for the rollout only, written back
  exactly afterwards (`in_place`). Merging in place and unmerging by subtraction is never done: in bf16 it would
  change the base weights by rounding.
  With `fuse` (`fused.py`), q/k/v and gate/up decode as one product each: the copy holds each group's weights in
  one tensor, or (`in_place`) the frozen base weights of a group are laid back to back in one storage (same
  values; the training model computes as before).
- `fp8.Fp8Weights(inner)` (rollout.fp8): an FP8 copy of the inner source's projections, requantized at every sync.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, runtime_checkable

import torch

from logitless.models.nf4_experts import is_4bit

from .engine import unwrap_model
from .fused import FusedGroup, fuse_projections, groups_of, owners, share_storage, tensor_at
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


def merge_targets(model: Any) -> list[tuple[str, str, Any]]:
    """(module path, parameter name, LoRA layer) of every weight a merge rewrites in `model`: a LoRA layer's `weight`
    at its own path, or the parameter a peft `ParamWrapper` adapts (a fused 3-D expert stack, model.lora_target_experts)
    at the path of the module holding it, where the wrappers of its other parameters are nested
    (`mlp.experts`, `mlp.experts.base_layer`: both name `mlp.experts`)."""
    out = []
    for name, layer in lora_layers(model):
        path = name
        while path.endswith(".base_layer"):
            path = path.removesuffix(".base_layer")
        out.append((path, adapted_name(layer), layer))
    return out


def adapted_name(layer: Any) -> str:
    """The name of the parameter LoRA layer `layer` adapts on its base layer: `weight`, or a ParamWrapper's own."""
    return getattr(layer, "parameter_name", None) or "weight"


def delta_weight(layer: Any, adapter: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ΔW of `adapter` in LoRA layer `layer` from whole lora_A and lora_B weights `a`, `b` (gathered from shards, say),
    as peft's `get_delta_weight` forms it, in their dtype: (B @ A) x scaling for a linear layer (transposed for
    fan_in_fan_out); for a ParamWrapper over E > 1 experts one product per expert (A [E·r, in] -> [E, r, in],
    B [out, E·r] -> [out, r, E]) laid out as the stack is, [E, out, in] or (transposed stacks) [E, in, out]."""
    experts = getattr(layer, "num_experts", 1)
    if experts > 1:
        a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
        equation = "ore,eri->eoi" if layer._did_swap_in_out_features else "ore,eri->eio"
        return torch.einsum(equation, b, a) * layer.scaling[adapter]
    delta = b @ a
    return (delta.T if getattr(layer, "fan_in_fan_out", False) else delta) * layer.scaling[adapter]


def merge_refusal(model: Any) -> str | None:
    """Why `model`'s adapters cannot be merged into an inference copy (None if they can)."""
    layers = lora_layers(model)
    if not layers:
        return "the model has no LoRA adapters"
    for name, layer in layers:
        base = layer.get_base_layer()
        weight = getattr(base, adapted_name(layer), None)
        plain = isinstance(weight, torch.nn.Parameter) and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        if not plain and not is_4bit(weight):
            return (f"layer {name} wraps a {type(base).__name__} whose weight is neither a plain float tensor nor "
                    "bitsandbytes 4-bit (quantized otherwise?)")
        if any(layer.use_dora.get(a, False) for a in layer.active_adapters):
            return f"layer {name} uses DoRA, whose update is not an additive weight delta"
        if getattr(layer, "merged", False):
            return f"layer {name} already has adapters merged into its base weights"
    return None


def base_weight(layer: Any) -> torch.Tensor:
    """The base weight W of a LoRA layer as a float tensor: as is, or dequantized from 4-bit (in its compute dtype)."""
    weight = getattr(layer.get_base_layer(), adapted_name(layer))
    if not is_4bit(weight):
        return weight
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight.data, weight.quant_state)


def in_place_refusal(model: Any) -> str | None:
    """Why the merged weights cannot be written into `model`'s base weights for a rollout (None if they can)."""
    for name, layer in lora_layers(model):
        weight = getattr(layer.get_base_layer(), adapted_name(layer))
        if is_4bit(weight):
            return f"layer {name}'s base weight is 4-bit: it cannot hold W + ΔW"
        if weight.requires_grad:
            return f"layer {name}'s base weight trains"
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

    def __init__(self, peft_model: Any, mode: str = "resident", fuse: bool = False):
        if mode not in self.MODES:
            raise ValueError(f"rollout.weight_copy={mode!r}: use one of {', '.join(self.MODES)}")
        why = merge_refusal(peft_model)
        if why is not None:
            raise ValueError(f"rollout.merge_lora=true cannot merge this model's adapters: {why}; set "
                             "rollout.merge_lora=false to decode with the unmerged PEFT model")
        base = unwrap_model(peft_model)  # the transformers model with LoRA layers injected
        why = in_place_refusal(base) if mode == "in_place" else None
        if why is not None:
            raise ValueError(f"rollout.weight_copy={mode} merges into frozen full-precision base weights, but {why}; "
                             "use rollout.weight_copy=sleep or resident")
        shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}  # deepcopy shares, never copies, these
        self.module = fresh_copy(base, memo=shared).eval()  # shared parameters keep their requires_grad
        self.mode = mode
        targets = merge_targets(base)  # (path, parameter, LoRA layer); expert stacks: several at one path
        device = base_weight(targets[0][2]).device
        names = list(dict.fromkeys(path for path, _, _ in targets))
        for name in names:  # each LoRA-wrapped module becomes a plain copy of what it wraps
            plain = _plain_layer(base.get_submodule(name).get_base_layer())
            for param in (p for path, p, _ in targets if path == name and mode != "in_place"):
                w = getattr(plain, param)  # allocated below: in a fused group, or on its own
                setattr(plain, param, torch.nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False))
            self.module.set_submodule(name, plain)
        if fuse and mode == "in_place":
            for parent, attrs in groups_of(self.module, names):  # the training model's frozen base weights
                share_storage([getattr(parent, a) for a in attrs])
        self.groups: list[FusedGroup] = fuse_projections(self.module, names, device=device) if fuse else []
        merged = [f"{path}.{param}" for path, param, _ in targets]
        for name in merged:  # the weights left out of a group
            module, _, param = name.rpartition(".")
            owner, w = self.module.get_submodule(module), tensor_at(self.module, name)
            if w.device.type == "meta":
                setattr(owner, param, torch.nn.Parameter(torch.empty_like(w, device=device), requires_grad=False))
        held = owners(self.module, merged)  # whole storages: a group's, or a layer's
        pin = device.type == "cuda"
        self.memory = SleepableMemory(held) if mode == "sleep" else None  # (moves them: views are taken after)
        # (training-side LoRA layer, merged weight): a fused layer's is a view of its group's rows
        self._pairs = [(layer, tensor_at(self.module, name)) for name, (_, _, layer) in zip(merged, targets)]
        self._host = [_host_copy(w, pin) for _, w in self._pairs] if mode == "in_place" else []  # the exact base
        biases = sum(g.bias.numel() * g.bias.element_size() for g in self.groups if g.bias is not None)
        self.extra_bytes = biases + (0 if mode == "in_place" else sum(t.numel() * t.element_size() for t in held))
        self._merged = False  # in_place: the base weights hold W + ΔW now
        if mode == "resident":
            self.sync()  # the copy holds W + ΔW from the start; the other modes merge at each rollout's sync
        elif self.memory is not None:
            self.memory.sleep()  # nothing to hold until the first rollout

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
        # in_place: the base weights are being written from here on; a sync that fails part way (out of memory)
        # leaves some merged, and the next release or sync writes all of them back first
        self._merged = self.mode == "in_place"
        for layer, merged in self._pairs:
            w = base_weight(layer).float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                    w = w + layer.get_delta_weight(adapter).float()
            merged.copy_(w)
        for group in self.groups:
            group.refresh_bias()  # a fused group's bias is its own copy of the (shared) biases


def _host_copy(w: torch.Tensor, pin: bool) -> torch.Tensor:
    host = w.detach().to("cpu", copy=True)
    return host.pin_memory() if pin else host


def _plain_layer(base: Any) -> Any:
    """A layer computing what `base` computes, with its own parameter dict (bias shared): a shallow copy (also of
    an experts module), or for a bitsandbytes 4-bit linear layer a plain `nn.Linear` in its compute dtype (weight
    set by the caller)."""
    if not is_4bit(getattr(base, "weight", None)):
        plain = copy.copy(base)  # same class and attributes
        plain._parameters = dict(plain._parameters)
        return plain
    dtype = getattr(base, "compute_dtype", None) or base.weight.quant_state.dtype
    plain = torch.nn.Linear(base.in_features, base.out_features, bias=False, device="meta", dtype=dtype)
    plain.bias = base.bias
    return plain


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


def rollout_weights(model: Any, merge_lora: bool | None) -> WeightSource:
    """The weight source for `model`: a resident merged-LoRA copy when `merge_lora` (None: when the adapters can be
    merged), else the model itself."""
    return MergedLoraWeights(model) if merges(model, merge_lora) else LiveWeights(model)
