"""FP8 rollouts (rollout.fp8): the decode's linear layers hold float8_e4m3fn weights with per-output-channel scales.

Which layers: the attention and MLP projections of every decoder layer (`PROJECTIONS`, plain `nn.Linear`, and the
fused q/k/v and gate/up groups of `fused.py`). The embedding, the lm_head, the norms and the routers stay in the
model's dtype, and so do a mixture of experts' expert stacks (`.experts.` modules: not quantized yet).

The numbers (`quantize`, `Fp8Linear.forward`), the same on every device:

    weight W [out, in]:     s_w[j] = max_k |W[j, k]| / 448 (fp32; 1 for an all-zero row),  W_q = e4m3(W / s_w)
    activation x [t, in]:   s_x[t] = max_k |x[t, k]| / 448, per token at every call,        x_q = e4m3(x / s_x)
    y = (x_q @ W_qᵀ) · s_x · s_wᵀ  accumulated in fp32, rounded once to the model's dtype, + bias

e4m3 rounds to nearest even; the quotients are clamped to ±448 first (fp32 rounding can put the largest one a hair
above it). On a CUDA GPU with FP8 (compute capability 8.9+: Ada, Hopper) the product is `torch._scaled_mm` (FP8
tensor cores, row-wise scales, bf16 out) where both sizes of the weight are multiples of 16; elsewhere (the CPU,
odd sizes) the same numbers are computed from the FP8 values in fp32 (`emulated_product`), so CPU tests exercise the
quantization itself. A CUDA GPU without FP8 is refused (`fp8_unsupported`).

Where the weights come from (refreshed at every weight sync):
- `Fp8Weights(inner)`: one process. An FP8 copy of the inner source's module (the training model, or a merged-LoRA
  view `MergedLoraWeights`, merged for the sync and released right after it), sharing every other parameter;
  each sync quantizes the inner module's current weights into it (`Fp8Linear.refresh`).
- a replica (`to_fp8` on `RolloutCopy` / `MergedRolloutCopy`, trainer/distributed/parallel.py): the replica's
  linear layers are FP8 themselves, and its sync quantizes each whole weight (merged: W + ΔW in fp32) as it writes
  it (`fused.write_at` -> `Fp8Linear.write`): 1 byte per weight plus a scale per row instead of 2.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .engine import model_device, unwrap_model
from .fused import GROUPS, FusedGroup, SlicedLinear, groups_of
from .sleep import SleepableMemory

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHUNK_ROWS = 4096  # rows quantized at once in a sync (bounds its fp32 temporary)


def fp8_unsupported(device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """Why FP8 decode cannot run on `device` (None: it can; the CPU emulates it). `capability`: the CUDA device's
    compute capability (default: asked of the device)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 decode runs on CUDA GPUs of compute capability 8.9+ or emulated on the CPU, not on {device.type}"
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if capability is None else f"{device}"
        return (f"{name} has compute capability {major}.{minor}, and torch._scaled_mm's FP8 products need 8.9 or newer "
                "(Ada: L4, L40S, RTX 4090; Hopper: H100, H200)")
    return None


def require_fp8(device: torch.device) -> None:
    """Raise, naming rollout.fp8 and the fix, where `fp8_unsupported(device)`."""
    why = fp8_unsupported(device)
    if why is not None:
        raise ValueError(f"rollout.fp8=true cannot run here: {why}; set rollout.fp8=false (bf16 decode)")


def scales(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of each row of `x` [..., K]: max |x| over the row / 448 in fp32 ([...]), 1 for an all-zero
    row (it quantizes to zeros)."""
    amax = x.detach().abs().amax(-1).float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, s): `x` [..., K] per row in e4m3, x_q = e4m3(clamp(x / s, ±448)) (round to nearest even), with its
    fp32 scales s = `scales(x)` [...]; x ≈ x_q · s."""
    s = scales(x)
    q = (x.detach().float() / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x_q · s in fp32 (`quantize`'s inverse up to its rounding)."""
    return q.float() * s[..., None]


def emulated_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """(x_q @ W_qᵀ) · s_x · s_wᵀ in fp32 [t, out] from e4m3 x_q [t, in], W_q [out, in] and their fp32 scales [t],
    [out]: what `torch._scaled_mm` computes with row-wise scales, before its rounding to bf16."""
    return (xq.float() @ wq.float().t()) * xs[:, None] * ws[None, :]


class Fp8Linear(nn.Module):
    """A linear layer y = x Wᵀ + b with W in e4m3 and a scale per output row (see the module docstring), and a
    fused group's product where it stands for several (`sizes`: the members' output sizes; `fused.SlicedLinear`
    members take their columns). `sources`: the tensors `refresh()` quantizes into its rows, in order (a live
    weight; None: written by a sync through `write`); `source_biases`: where a fused group's own bias is refreshed
    from."""

    def __init__(self, in_features: int, sizes: Sequence[int], device: torch.device, bias: torch.Tensor | None,
                 sources: Sequence[torch.Tensor] | None = None,
                 source_biases: Sequence[torch.Tensor | None] | None = None):
        super().__init__()
        self.in_features, self.sizes = in_features, list(sizes)
        self.out_features = sum(self.sizes)
        self.qweight = nn.Parameter(torch.zeros(self.out_features, in_features, dtype=FP8, device=device),
                                    requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(self.out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self._sources = list(sources) if sources is not None else None  # (not submodules: plain references)
        self._source_biases = list(source_biases) if source_biases is not None else None
        self.product: tuple[torch.Tensor, torch.Tensor] | None = None  # a fused group's (input, product)
        # torch._scaled_mm: CUDA with FP8, both sizes multiples of 16 (its layout rule); else the emulation
        self.hardware = device.type == "cuda" and fp8_unsupported(device) is None and \
            in_features % 16 == 0 and self.out_features % 16 == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the FP8 weight and its scales (the bias aside)."""
        return self.qweight.numel() + 4 * self.weight_scale.numel()

    def held(self, leaf: str) -> list[torch.Tensor]:
        """The tensors that hold parameter `leaf` ("weight": the FP8 weight and its scales; "bias")."""
        return [self.qweight, self.weight_scale] if leaf == "weight" else [getattr(self, leaf)]

    @torch.no_grad()
    def write(self, leaf: str, value: torch.Tensor, start: int = 0) -> None:
        """Set rows [start, start + len(value)) of parameter `leaf` from `value`: a weight quantized per row (its FP8
        values and scales), a bias copied."""
        if leaf != "weight":
            getattr(self, leaf)[start : start + value.shape[0]].copy_(value)
            return
        device = self.qweight.device
        for r in range(0, value.shape[0], CHUNK_ROWS):
            q, s = quantize(value[r : r + CHUNK_ROWS].to(device))
            self.qweight[start + r : start + r + q.shape[0]].copy_(q)
            self.weight_scale[start + r : start + r + q.shape[0]].copy_(s)

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize the sources' current values into the weight (and copy the source biases into a fused group's
        own bias); nothing without sources."""
        if self._sources is None:
            return
        start = 0
        for i, w in enumerate(self._sources):
            self.write("weight", w, start)
            b = self._source_biases[i] if self._source_biases is not None else None
            if b is not None:
                self.write("bias", b, start)
            start += w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, xs = quantize(x.reshape(-1, shape[-1]))
        if self.hardware:
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=xs[:, None], scale_b=self.weight_scale[None, :],
                                 out_dtype=torch.bfloat16).to(x.dtype)
        else:
            y = emulated_product(xq, xs, self.qweight, self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, sizes={self.sizes}, bias={self.bias is not None}, fp8=e4m3"


def is_projection(name: str) -> bool:
    """Whether the module at qualified `name` is a projection FP8 decode quantizes (not inside an experts module)."""
    return name.rpartition(".")[2] in PROJECTIONS and ".experts." not in f".{name}."


def to_fp8(module: nn.Module, *, sources: bool = False, fuse: bool = False,
           device: torch.device | None = None) -> list[Fp8Linear]:
    """Replace every projection of `module`'s decoder layers (`is_projection`: plain `nn.Linear`, and the fused
    groups of `fused.py`) by an `Fp8Linear`, in place; returns them. sources=True: each keeps its replaced weight
    as its source (shared, not copied) and `refresh()` requantizes from it; else it is quantized once now (a weight
    on the meta device: left for the first sync's `write`) and dropped. fuse: plain q/k/v and gate/up layers
    become one FP8 group each (`fused.SlicedLinear` members). device: where a meta weight's FP8 copy lives."""
    out = []
    for parent_name, parent in list(module.named_modules()):
        for attrs in GROUPS:
            fused_name = "_".join(attrs) + "_fused"
            group = parent.__dict__["_modules"].get(fused_name)
            if isinstance(group, FusedGroup) and is_projection(f"{parent_name}.{attrs[0]}"):
                # (its bias stays the group's: refreshed by the inner source's sync, or written by a replica's)
                layer = _layer([group.weight], group.sizes, group.bias, sources, device)
                setattr(parent, fused_name, layer)
                for m in (getattr(parent, a) for a in attrs):
                    m._group[0] = layer
                out.append(layer)
    names = {id(m): n for n, m in module.named_modules()}
    if fuse:
        for parent, attrs in groups_of(module):
            parts = [getattr(parent, a) for a in attrs]
            if not is_projection(names[id(parts[0])]):
                continue
            biases = [p.bias for p in parts]
            bias = None if all(b is None for b in biases) else torch.cat([
                b.detach() if b is not None else p.weight.new_zeros(p.out_features) for b, p in zip(biases, parts)])
            layer = _layer([p.weight for p in parts], [p.out_features for p in parts], bias, sources, device, biases,
                           fused=True)
            setattr(parent, "_".join(attrs) + "_fused", layer)
            start = 0
            for i, (attr, p) in enumerate(zip(attrs, parts)):
                setattr(parent, attr, SlicedLinear(layer, start, start + p.out_features, last=i == len(attrs) - 1))
                start += p.out_features
            out.append(layer)
    for name, m in list(module.named_modules()):
        if type(m) is nn.Linear and is_projection(name):
            layer = _layer([m.weight], [m.out_features], m.bias, sources, device)
            module.set_submodule(name, layer)
            out.append(layer)
    return out


def _layer(weights: list[torch.Tensor], sizes: list[int], bias: torch.Tensor | None, sources: bool,
           device: torch.device | None, source_biases: Sequence[torch.Tensor | None] | None = None,
           fused: bool = False) -> Fp8Linear:
    """The FP8 layer over `weights` (row blocks of `sizes`): its sources, or quantized from them now."""
    where = weights[0].device if weights[0].device.type != "meta" else device
    if where is None or where.type == "meta":
        raise ValueError("to_fp8: a weight is on the meta device; pass the device its FP8 copy is to live on")
    # a fused group's bias is its own copy (refreshed from the members' where they have sources); one layer's is shared
    own_bias = fused or source_biases is not None
    layer = Fp8Linear(weights[0].shape[1], sizes, where, bias.to(where) if bias is not None and own_bias else bias,
                      weights if sources else None, source_biases if sources and own_bias else None)
    if not sources and weights[0].device.type != "meta":
        start = 0
        for w in weights:
            layer.write("weight", w, start)
            start += w.shape[0]
    return layer


def refuse_unmerged(module: nn.Module) -> None:
    """Refuse a decode module with unmerged LoRA adapters (its projections are PEFT layers), naming the fix."""
    if any(".lora_A." in n for n, _ in module.named_parameters()):
        raise ValueError("rollout.fp8=true quantizes plain linear layers, but this rollout decodes unmerged LoRA "
                         "adapters (rollout.merge_lora=false, DoRA adapters, or other trainable parameters beside "
                         "the adapters): unset rollout.merge_lora, or set rollout.fp8=false")


def fp8_replica(model: nn.Module, fuse: bool) -> list[Fp8Linear]:
    """Make a replica's projections FP8 in place (`to_fp8`, quantized from its weights now, which are dropped);
    returns its fused groups (q/k/v, gate/up with `fuse`). Its sync then writes through `fused.write_at`."""
    require_fp8(model_device(model))
    refuse_unmerged(model)
    return [layer for layer in _found(to_fp8(model, fuse=fuse), model) if len(layer.sizes) > 1]


def _found(layers: list[Fp8Linear], model: nn.Module) -> list[Fp8Linear]:
    """`layers`, refused naming rollout.fp8 where `to_fp8` found none in `model`."""
    if not layers:
        raise ValueError(f"rollout.fp8=true found no projection layers ({', '.join(PROJECTIONS)}) to quantize in "
                         f"{type(model).__name__}; set rollout.fp8=false")
    return layers


def fp8_layers(module: nn.Module) -> list[Fp8Linear]:
    """The FP8 layers of `module` (empty: it decodes in its own dtype)."""
    return [m for m in module.modules() if isinstance(m, Fp8Linear)]


class Fp8Weights:
    """A weight source (`weights.WeightSource`) that decodes from an FP8 copy of `inner`'s module on one process.

    `module`: a copy of the inner module whose projections are `Fp8Linear` layers holding their own FP8 weights
    and scales (`extra_bytes`); every other parameter and buffer is shared with the inner module (the embedding,
    norms, lm_head: the training model's). `sync()`: the inner sync (a merge, where the inner source merges LoRA),
    every FP8 layer requantized from the inner module's weights, then the inner release (an in-place merge is
    written back, a sleeping merged copy freed): between syncs only the FP8 copy is held. fuse: q/k/v and gate/up
    as one FP8 product each. sleep (CUDA): the FP8 weights live in sleepable memory, freed by `release()` after each
    rollout and mapped back at the same addresses by the next `sync()`."""

    def __init__(self, inner: Any, *, fuse: bool = False, sleep: bool = False):
        from .weights import fresh_copy

        base = unwrap_model(inner.module)
        device = model_device(base)
        require_fp8(device)
        refuse_unmerged(base)
        shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}
        self.inner = inner
        self.module = fresh_copy(base, memo=shared).eval()
        self.layers = _found(to_fp8(self.module, sources=True, fuse=fuse), base)
        self.groups = [layer for layer in self.layers if len(layer.sizes) > 1]  # fused q/k/v, gate/up
        own = sum(layer.bias.numel() * layer.bias.element_size() for layer in self.groups if layer.bias is not None)
        self.extra_bytes = sum(layer.nbytes for layer in self.layers) + own + getattr(inner, "extra_bytes", 0)
        held = [t for layer in self.layers for t in layer.held("weight")]
        self.memory = SleepableMemory(held, fill=False) if sleep else None
        if self.memory is None:
            self._refresh()  # resident: valid from the start
        else:
            self.memory.sleep()  # nothing to hold until the first rollout

    @torch.no_grad()
    def _refresh(self) -> None:
        self.inner.sync()
        try:
            for layer in self.layers:
                layer.refresh()
        finally:
            self.inner.release()

    def sync(self) -> None:
        """Requantize every FP8 layer from the inner source's current (merged) weights."""
        if self.memory is not None:
            self.memory.wake()
        self._refresh()

    def release(self) -> None:
        """The rollout is over: free the sleeping FP8 weights (with sleep)."""
        if self.memory is not None:
            self.memory.sleep()
