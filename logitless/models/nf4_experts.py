"""4-bit (NF4) expert stacks for QLoRA on a mixture of experts: stored packed, dequantized one layer at a time.

bitsandbytes quantizes linear layers only; transformers 5 keeps each MoE layer's experts as fused 3-D parameters
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; `experts.py`), most of the model's bytes. `quantize_experts`
stores each stack with bitsandbytes' `quantize_4bit` (the quant type, block size and double quantization the model's
own 4-bit linear layers use: `nf4_options_of`) as frozen buffers of its experts module, and gives the module a
forward that dequantizes its stacks (`dequantize_4bit`, into the stack's own dtype, the compute dtype) just before
the experts' implementation runs (eager, grouped_mm or batched_mm, transformers' code unchanged) and drops them
after: one layer's stacks exist in full precision at a time.

A forward that back-propagates (LoRA on the attention upstream, the router's gate weights) runs the experts under
non-reentrant activation checkpointing (`torch.utils.checkpoint`): autograd would otherwise keep each layer's
dequantized stacks until the backward (every GEMM saves its weight for the input's gradient), i.e. every expert in
full precision. The backward dequantizes and recomputes the layer's experts once more instead.

The module keeps its path and class behaviour (a subclass made once per experts class), so routing replay, the
experts implementation switch and the rollout's copies see it as before; copies (`copy.deepcopy` with the buffers
in the memo, as the rollout's merged LoRA copy makes) share the packed buffers. `dequantize_experts` puts plain
parameters back (a merged export).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .experts import EXPERT_PARAMS, QUANTIZED, expert_modules

# buffers of one stack `name`: f"{name}{suffix}" (nested_*: double quantization's second level)
TENSORS = ("packed", "absmax", "code", "nested_absmax", "nested_code", "nested_offset")


@dataclass(frozen=True)
class Nf4Options:
    """How bitsandbytes quantizes: 4-bit type, values per block scale, and whether the block scales are themselves
    quantized (double quantization, 8-bit in blocks of 256)."""

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True


@dataclass(frozen=True)
class StackMeta:
    """What rebuilds one stack's bitsandbytes QuantState beside its buffers."""

    shape: tuple[int, ...]  # the stack's shape, e.g. [E, 2I, H]
    dtype: torch.dtype  # the stack's dtype, which the dequantized transient has (the compute dtype)
    quant_type: str
    blocksize: int
    nested_blocksize: int | None  # None without double quantization
    nested_dtype: torch.dtype | None


def is_4bit(weight: Any) -> bool:
    """A bitsandbytes 4-bit weight (QLoRA's NF4 base weights of a linear layer)."""
    return type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None


def nf4_options_of(model: nn.Module) -> Nf4Options | None:
    """The quantization of `model`'s first bitsandbytes 4-bit linear weight (None for a model without any)."""
    for p in model.parameters():
        if is_4bit(p):
            qs = p.quant_state
            return Nf4Options(quant_type=qs.quant_type, blocksize=qs.blocksize, double_quant=bool(qs.nested))
    return None


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is an experts module whose stacks `quantize_experts` stored in 4-bit."""
    return bool(getattr(module, QUANTIZED, None))


def stack_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the 3-D expert stacks of an experts module, 4-bit ones included."""
    out = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if n in EXPERT_PARAMS and p.dim() == 3}
    out.update({n: meta.shape for n, meta in getattr(module, QUANTIZED, {}).items()})
    return out


def nf4_bytes(numel: int, options: Nf4Options) -> float:
    """Bytes bitsandbytes stores a tensor of `numel` values in: 4 bits each, and a block scale per `blocksize`
    values (fp32, or 8-bit with one fp32 scale per 256 of them under double quantization)."""
    blocks = numel / options.blocksize
    scales = blocks + 4 * blocks / 256 if options.double_quant else 4 * blocks
    return numel / 2 + scales


def _quantized_class(cls: type) -> type:
    """`cls` (an experts class) with the dequantizing forward, made once per class."""
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"Nf4{cls.__name__}", (Nf4Experts, cls), {})
    return made


_CLASSES: dict[type, type] = {}


class Nf4Experts(nn.Module):
    """The forward of a 4-bit experts module (mixed in before its own class): dequantize, run, drop."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._dequantized_forward, *args, use_reentrant=False, **kwargs)
        return self._dequantized_forward(*args, **kwargs)

    def _dequantized_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The experts' own forward (transformers' implementation dispatch) over the dequantized stacks."""
        stacks = getattr(self, QUANTIZED)
        for name in stacks:
            self.__dict__[name] = dequantized(self, name)  # a plain attribute: found before nn.Module's lookup
        try:
            return super().forward(*args, **kwargs)
        finally:
            for name in stacks:
                self.__dict__.pop(name, None)


def _quant_state(module: nn.Module, name: str) -> Any:
    from bitsandbytes.functional import QuantState

    meta: StackMeta = getattr(module, QUANTIZED)[name]
    buf = lambda s: getattr(module, f"{name}_{s}")  # noqa: E731
    state2 = offset = None
    if meta.nested_blocksize is not None:
        state2 = QuantState(absmax=buf("nested_absmax"), code=buf("nested_code"), blocksize=meta.nested_blocksize,
                            dtype=meta.nested_dtype)
        offset = buf("nested_offset")
    return QuantState(absmax=buf("absmax"), shape=torch.Size(meta.shape), code=buf("code"), blocksize=meta.blocksize,
                      quant_type=meta.quant_type, dtype=meta.dtype, offset=offset, state2=state2)


def dequantized(module: nn.Module, name: str) -> torch.Tensor:
    """Stack `name` of a 4-bit experts module in its dtype (a new tensor of its full shape)."""
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(getattr(module, f"{name}_packed"), _quant_state(module, name))


@torch.no_grad()
def quantize_experts(model: nn.Module, options: Nf4Options) -> int:
    """Store every 3-D expert stack of `model` (each experts module's `gate_up_proj` / `down_proj`) in 4-bit with
    `options`, frozen, freeing the full-precision parameter as it goes; returns how many experts modules changed.
    Biases (gpt_oss) and routers stay as they are."""
    from bitsandbytes.functional import quantize_4bit

    done = 0
    for _, module in expert_modules(model):
        if is_quantized(module):
            continue
        metas = {}
        for name in [n for n, p in module.named_parameters(recurse=False) if n in EXPERT_PARAMS and p.dim() == 3]:
            w = module._parameters.pop(name)
            packed, qs = quantize_4bit(w.data, blocksize=options.blocksize, compress_statistics=options.double_quant,
                                       quant_type=options.quant_type, quant_storage=torch.uint8)
            nested = qs.state2 if qs.nested else None
            metas[name] = StackMeta(shape=tuple(w.shape), dtype=w.dtype, quant_type=qs.quant_type,
                                    blocksize=qs.blocksize, nested_blocksize=nested.blocksize if nested else None,
                                    nested_dtype=nested.dtype if nested else None)
            tensors = {"packed": packed, "absmax": qs.absmax, "code": qs.code}
            if nested is not None:
                tensors.update(nested_absmax=nested.absmax, nested_code=nested.code,
                               nested_offset=torch.as_tensor(qs.offset, device=w.device))
            for suffix, t in tensors.items():
                module.register_buffer(f"{name}_{suffix}", t, persistent=False)
            del w
        setattr(module, QUANTIZED, metas)
        module.__class__ = _quantized_class(type(module))
        done += 1
    return done


@torch.no_grad()
def dequantize_experts(model: nn.Module) -> int:
    """Undo `quantize_experts`: every 4-bit experts module of `model` gets plain frozen parameters holding its
    dequantized stacks and its own class back; returns how many modules changed."""
    done = 0
    for module in model.modules():
        if not is_quantized(module):
            continue
        for name in getattr(module, QUANTIZED):
            w = dequantized(module, name)
            for suffix in TENSORS:
                module._buffers.pop(f"{name}_{suffix}", None)
            module.register_parameter(name, nn.Parameter(w, requires_grad=False))
        delattr(module, QUANTIZED)
        module.__class__ = next(c for c in type(module).__mro__[1:] if c is not Nf4Experts)
        done += 1
    return done
