"""Sequence-tiled MLP: each decoder layer's feed-forward block run over chunks of the tokens, its intermediate
activations recomputed chunk by chunk in the backward (`model.mlp_chunk_tokens`).

A dense MLP (Llama / Qwen / Mistral / Gemma style: `down_proj(act(gate_proj(x)) * up_proj(x))`, or a fused
`gate_up_proj`) computes every token on its own, so running it over chunks of at most `chunk` tokens gives the
same output. Untiled, autograd keeps the MLP's [N, I] intermediates of every token for the backward (gate, up,
act(gate) and their product; I = intermediate size, 12,288 at 8B: about 9 GiB per layer at 128K tokens in bf16).
`TiledMLP` keeps only the MLP's input [N, H]; its backward runs each chunk's forward again with grad and
back-propagates it before the next, so the intermediates of one chunk at most exist at a time. The price is one
more forward of the MLP per backward (under gradient checkpointing the MLP's forward then runs three times).

Exact: each token's output is the same computation; the gradients of the weights are summed over the chunks
instead of inside one GEMM (float rounding of the order of the sum; 16-bit gradients are summed in fp32 and rounded
once, as the GEMM's fp32 accumulator does, which holds one layer's MLP gradients in fp32 while it back-propagates).
Dropout inside the MLP (peft's lora_dropout) draws the same masks in the recompute (the RNG state of the forward
restored, chunks in the forward's order), and the recompute runs under the forward's autocast state. The gradients
of the MLP's trained parameters come back through autograd as those of any input (hooks, FSDP2's reduce-scatter
and `torch.autograd.grad` see them as usual).

At most `chunk` tokens the MLP runs whole, as before. Under torch.compile (`model.compile_layers`) a tiled call
runs eagerly (`torch.compiler.disable`): the layer compiles into the graphs before and after its MLP. The wrapped
forward is the module's own at the time of tiling (Liger-Kernel's SwiGLU where it is patched in), bound per module
instance, so a deep copy of the model (the rollout's copies, the reference policy) tiles with its own weights.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from logitless.models.lm_head import decoder_layers

CHUNK_ATTR = "_logitless_mlp_chunk_tokens"  # the chunk size, on a tiled MLP module
FORWARD_ATTR = "_logitless_mlp_forward"  # the module's forward before tiling (a plain function of (module, x))
MOE_NAMES = ("experts", "router", "gate")  # children of a mixture-of-experts block (its tokens are routed)


def feed_forward(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's dense feed-forward block (`layer.mlp` with gate/up/down projections, or a fused gate_up),
    or None where it has none (a mixture of experts, another layout)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module) or any(hasattr(mlp, n) for n in MOE_NAMES):
        return None
    gated = hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj") or hasattr(mlp, "gate_up_proj")
    return mlp if gated and hasattr(mlp, "down_proj") else None


def untileable_reason(model: nn.Module) -> str | None:
    """Why `model`'s MLPs cannot be tiled (a layer without a dense gated MLP), or None when every layer's can."""
    layers = decoder_layers(model)
    odd = [i for i, layer in enumerate(layers) if feed_forward(layer) is None]
    if not odd:
        return None
    mlp = getattr(layers[odd[0]], "mlp", None)
    kind = type(mlp).__name__ if mlp is not None else "no `mlp` module"
    if mlp is not None and any(hasattr(mlp, n) for n in MOE_NAMES):
        kind += " (a mixture of experts: its tokens are routed to experts, whose stacks the tiling does not run)"
    return (f"decoder layer {odd[0]} of {type(layers[odd[0]]).__name__} ({len(odd)} of {len(layers)} layers) has "
            f"{kind}, not a dense gated MLP (gate_proj, up_proj, down_proj): only those are tiled")


def check_tileable(model: nn.Module, chunk_tokens: Any, setting: str = "model.mlp_chunk_tokens") -> None:
    """Raise ValueError naming `setting` unless `chunk_tokens` is a positive int and every decoder layer of `model`
    has a dense gated MLP."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"{setting}={chunk_tokens!r}: the chunk must be a positive number of tokens")
    why = untileable_reason(model)
    if why is not None:
        raise ValueError(f"{setting}={chunk_tokens}: {why}. Set {setting}=null for this model")


def tile_mlps(model: nn.Module, chunk_tokens: int, setting: str = "model.mlp_chunk_tokens") -> int:
    """Make every decoder layer's MLP of `model` run over chunks of at most `chunk_tokens` tokens (`TiledMLP`), in
    place; an MLP tiled already gets the new size. Returns the number of MLPs. Raises ValueError naming `setting`
    (`check_tileable`) before changing any."""
    check_tileable(model, chunk_tokens, setting)
    mlps = [feed_forward(layer) for layer in decoder_layers(model)]
    for mlp in mlps:
        if FORWARD_ATTR not in mlp.__dict__:
            own = mlp.__dict__.get("forward")  # a forward bound on the instance (Liger's kernel, its dispatch)
            mlp.__dict__[FORWARD_ATTR] = own.__func__ if own is not None else type(mlp).forward
            mlp.__dict__["forward"] = types.MethodType(_tiled_forward, mlp)
        mlp.__dict__[CHUNK_ATTR] = chunk_tokens
    return len(mlps)


def mlp_chunk_tokens(model: nn.Module) -> int | None:
    """The chunk size of `model`'s tiled MLPs, or None when they are not tiled."""
    for layer in decoder_layers(model):
        mlp = feed_forward(layer)
        if mlp is not None and CHUNK_ATTR in mlp.__dict__:
            return mlp.__dict__[CHUNK_ATTR]
    return None


def _tiled_forward(self: nn.Module, x: Tensor) -> Tensor:
    """A tiled MLP's forward: the module's own for at most its chunk of tokens, `tiled_call` above it."""
    if x.numel() <= self.__dict__[CHUNK_ATTR] * x.shape[-1]:
        return self.__dict__[FORWARD_ATTR](self, x)
    return tiled_call(self, self.__dict__[FORWARD_ATTR], x, self.__dict__[CHUNK_ATTR])


@torch.compiler.disable
def tiled_call(module: nn.Module, forward: Callable[[nn.Module, Tensor], Tensor], x: Tensor, chunk: int) -> Tensor:
    """`forward(module, x)` over chunks of at most `chunk` tokens of x [..., H] (any leading dims): through
    `TiledMLP` where autograd records it, a plain loop otherwise (no grad, or nothing that needs one)."""
    flat = x.reshape(-1, x.shape[-1])
    params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    if torch.is_grad_enabled() and (flat.requires_grad or params):
        out = TiledMLP.apply(module, forward, chunk, flat, *params)
    else:
        out = _chunks_forward(module, forward, flat, chunk)
    return out.view(*x.shape[:-1], out.shape[-1])


def _chunks_forward(module: nn.Module, forward: Callable, flat: Tensor, chunk: int) -> Tensor:
    """forward(module, ·) of each chunk of the [N, H] rows, written into one [N, H_out] output."""
    out = None
    for start in range(0, flat.shape[0], chunk):
        y = forward(module, flat[start:start + chunk].unsqueeze(0))[0]
        if out is None:
            out = y.new_empty(flat.shape[0], y.shape[-1])
        out[start:start + y.shape[0]] = y
    return out


class TiledMLP(torch.autograd.Function):
    """forward(module, forward, chunk, x [N, H], *params) -> [N, H_out]: the MLP over chunks of x without keeping
    any intermediate; params are the module's parameters that need a gradient (their gradients are returned)."""

    @staticmethod
    def forward(ctx: Any, module: nn.Module, forward: Callable, chunk: int, x: Tensor, *params: Tensor) -> Tensor:
        ctx.module, ctx.fn, ctx.chunk, ctx.n_params = module, forward, chunk, len(params)
        ctx.device_type = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type),
                        torch.is_autocast_cache_enabled())
        ctx.rng = _rng_state(x.device) if module.training and _has_dropout(module) else None
        ctx.save_for_backward(x)
        return _chunks_forward(module, forward, x, chunk)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        module, chunk = ctx.module, ctx.chunk
        params = [p for p in module.parameters() if p.requires_grad]  # the same parameters, in the same order
        if len(params) != ctx.n_params:
            raise RuntimeError(f"TiledMLP: {type(module).__name__} has {len(params)} parameters that need a gradient "
                               f"in the backward, {ctx.n_params} in the forward; freeze or unfreeze between steps")
        wants_x = ctx.needs_input_grad[3]
        x_grad = torch.empty_like(x) if wants_x else None
        sums: list[Tensor | None] = [None] * len(params)
        enabled, dtype, cache = ctx.autocast
        with _restored_rng(ctx.rng, x.device), torch.enable_grad(), \
                torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled, cache_enabled=cache):
            for start in range(0, x.shape[0], chunk):
                part = x[start:start + chunk].detach().requires_grad_(wants_x)
                y = ctx.fn(module, part.unsqueeze(0))[0]
                inputs = ([part] if wants_x else []) + params
                grads = torch.autograd.grad(y, inputs, grad[start:start + chunk], allow_unused=True)
                if wants_x:
                    x_grad[start:start + chunk] = grads[0] if grads[0] is not None else 0
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:  # bf16/fp16 gradients summed in fp32, rounded once (as one GEMM does)
                        sums[i] = g.to(_accumulator(g.dtype)) if sums[i] is None else sums[i].add_(g)
        return (None, None, None, x_grad, *(s if s is None else s.to(p.dtype) for s, p in zip(sums, params)))


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype the chunks' gradients of a `dtype` parameter are summed in: fp32 for 16-bit floats."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _has_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The CPU generator's state and the device's (CUDA), as torch.utils.checkpoint keeps them for a recompute."""
    accel = None
    if device.type == "cuda":
        accel = torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), accel


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None] | None, device: torch.device) -> Iterator[None]:
    """The RNG state `state` (from `_rng_state`) in force inside, the caller's restored after; nothing for None."""
    if state is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else "cpu"):
        torch.set_rng_state(state[0])
        if cuda:
            torch.cuda.set_rng_state(state[1], device)
        yield
