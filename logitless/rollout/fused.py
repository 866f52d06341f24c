"""Fused projections for decoding: one GEMM for q/k/v and one for gate/up per layer, instead of five.

A decode step of a 1.5B model at 128 rows is over 530 small kernels with a few microseconds of idle GPU between
consecutive ones, inside a CUDA graph too, so fewer and larger kernels make the step faster (bench/LOG.md). Per
layer, q/k/v read the same normed hidden state, and so do gate/up. `fuse_projections` gives each such group one
weight [sum of outs, in] (its members' weights are row blocks of it) and replaces each member by a
`SlicedLinear`: the group's first member computes the whole product, the next ones take their columns from it.
The model's code is unchanged (the attention and MLP modules call their projections as before), eagerly and under
torch.compile, which traces the group into one matrix product.

Where the group's weight comes from:
- the members' weights already lie back to back in one storage (`share_storage` put them there): the group's
  weight is a view of it, no copy (the in-place merged rollout: the training model's frozen base weights);
- a member's weight is on the meta device: a new, uninitialized tensor (a merged copy that its sync fills);
- otherwise a new tensor holding the members' weights (a replica).
A member's `weight` and `bias` stay addressable (`SlicedLinear.weight` is a view of the group's rows), so a sync
that writes a member by name writes the group.

Equivalent to (per group, x the shared input): `q, k, v = (F.linear(x, m.weight, m.bias) for m in (q, k, v))`.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup(nn.Module):
    """The weight [sum of outs, in] (and bias [sum of outs]) of one group of projections."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                 source_biases: list[torch.Tensor | None]):
        super().__init__()
        self.sizes = sizes  # the members' output sizes, in order
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # the replaced layers' biases (not the layers: their weights must be freed), where refresh_bias reads
        self.source_biases = source_biases
        self.product: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, product) within one forward

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's product `F.linear(x, weight, bias)` [..., sum of outs]."""
        return nn.functional.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def refresh_bias(self) -> None:
        """Copy the replaced layers' biases into the group's (for a group whose replaced layers shared a training
        model's biases, which may have trained)."""
        if self.bias is not None:
            start = 0
            for b, n in zip(self.source_biases, self.sizes):
                if b is not None:
                    self.bias[start : start + n].copy_(b)
                start += n


class SlicedLinear(nn.Module):
    """Output columns [start, stop) of `group`'s product `group(x)` (`F.linear(x, group.weight, group.bias)`; an FP8
    group's own product, `fp8.Fp8Linear`), `[..., start:stop]`.

    The group's members are called one after the other on the same input (q, k, v; gate, up): the first computes
    the whole product and leaves it on the group, the next ones take their columns while the input is the same
    tensor, the last drops it (nothing outlives the forward). Called in another order, or on another input, a
    member computes the product itself: slower, never wrong."""

    def __init__(self, group: nn.Module, start: int, stop: int, last: bool):
        super().__init__()
        self._group = [group]  # not a submodule: the parent module owns the group once
        self.in_features, self.out_features = group.in_features, stop - start
        self.start, self.stop, self.last = start, stop, last

    @property
    def group(self) -> nn.Module:  # a FusedGroup, or an FP8 group (`fp8.Fp8Linear`)
        return self._group[0]

    @property
    def weight(self) -> torch.Tensor:  # a view of the group's rows: writing it writes the group
        return self.group.weight[self.start : self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.group.bias
        return None if b is None else b[self.start : self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        cached = g.product
        if cached is not None and cached[0] is x:
            out = cached[1]
        else:
            out = g(x)
        g.product = None if self.last else (x, out)
        return out[..., self.start : self.stop]


def groups_of(module: nn.Module, names: Iterable[str] | None = None) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, member attribute names) of every group of GROUPS whose members are plain `nn.Linear` layers with
    one input size, dtype and device (and whose qualified names are all in `names`, when given)."""
    wanted = None if names is None else set(names)
    found = []
    for parent_name, parent in module.named_modules():
        for attrs in GROUPS:
            parts = [getattr(parent, a, None) for a in attrs]
            qualified = [f"{parent_name}.{a}" if parent_name else a for a in attrs]
            if not all(type(p) is nn.Linear for p in parts):  # exact: not 4-bit or other Linear subclasses
                continue
            if wanted is not None and not wanted.issuperset(qualified):
                continue
            if len({(p.in_features, p.weight.dtype, p.weight.device) for p in parts}) != 1:
                continue
            found.append((parent, attrs))
    return found


@torch.no_grad()
def share_storage(layers: list[nn.Module]) -> None:
    """Put the weights of `layers` (each with a `.weight` [out_i, in], same in, dtype, device) back to back in one
    new storage: each weight Parameter keeps its identity and values, its `.data` becomes a row block of it."""
    weights = [m.weight for m in layers]
    fused = torch.cat([w.detach() for w in weights])
    start = 0
    for w in weights:
        w.data = fused[start : start + w.shape[0]]
        start += w.shape[0]


def _adjacent(weights: list[torch.Tensor]) -> bool:
    """Whether the weights are consecutive row blocks of one contiguous storage."""
    first = weights[0]
    if first.device.type == "meta" or not all(w.is_contiguous() for w in weights):
        return False
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for w in weights:
        if w.untyped_storage().data_ptr() != ptr or w.storage_offset() != offset:
            return False
        offset += w.numel()
    return True


def _bias(m: nn.Module) -> torch.Tensor:
    return m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])


@torch.no_grad()
def fuse_projections(module: nn.Module, names: Iterable[str] | None = None,
                     device: torch.device | None = None) -> list[FusedGroup]:
    """Replace every group of `groups_of(module, names)` by `SlicedLinear` members of one `FusedGroup` (registered
    on the parent as `q_proj_k_proj_v_proj_fused` / `gate_proj_up_proj_fused`); returns the groups. The group's
    weight is a view where the members' weights lie back to back, new and uninitialized (on `device`) where they
    are on the meta device, else a new copy; its bias is a new copy (zeros for a member without one)."""
    fused = []
    for parent, attrs in groups_of(module, names):
        parts = [getattr(parent, a) for a in attrs]
        weights = [p.weight for p in parts]
        rows, cols = sum(w.shape[0] for w in weights), weights[0].shape[1]
        if _adjacent(weights):
            first = weights[0].detach()
            weight = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, cols), (cols, 1))
        elif any(w.device.type == "meta" for w in weights):
            weight = torch.empty(rows, cols, dtype=weights[0].dtype, device=device)
        else:
            weight = torch.cat([w.detach() for w in weights])
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([_bias(p).detach() for p in parts]).to(weight.device)
        group = FusedGroup(weight, bias, [w.shape[0] for w in weights], [p.bias for p in parts])
        setattr(parent, "_".join(attrs) + "_fused", group)
        start = 0
        for i, (attr, w) in enumerate(zip(attrs, weights)):
            setattr(parent, attr, SlicedLinear(group, start, start + w.shape[0], last=i == len(attrs) - 1))
            start += w.shape[0]
        fused.append(group)
    return fused


def _locate(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the submodule, the attribute) a qualified parameter name names in `module`."""
    owner, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module), leaf


def tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor a qualified parameter name names in `module`, also a fused member's (`...q_proj.weight`: a view
    of its group's rows)."""
    return getattr(*_locate(module, name))


def owners(module: nn.Module, names: Iterable[str]) -> list[torch.Tensor]:
    """The distinct tensors that hold the named parameters: a fused member's group weight or bias, else the
    parameter itself; an FP8 layer's weight is held by its FP8 weight and scales (`Fp8Linear.held`). For
    `SleepableMemory`, which must move whole storages."""
    out: dict[int, torch.Tensor] = {}
    for name in names:
        m, leaf = _locate(module, name)
        holder = m.group if isinstance(m, SlicedLinear) else m
        for t in holder.held(leaf) if hasattr(holder, "held") else [getattr(holder, leaf)]:
            out.setdefault(id(t), t)
    return list(out.values())


@torch.no_grad()
def write_at(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set the tensor a qualified parameter name names in `module` to `value` (a weight sync's write): copied in
    place, also a fused member's rows of its group; an FP8 layer's weight is quantized into it (`Fp8Linear.write`:
    its FP8 rows and their scales)."""
    m, leaf = _locate(module, name)
    holder, start = (m.group, m.start) if isinstance(m, SlicedLinear) else (m, 0)
    if hasattr(holder, "write"):
        holder.write(leaf, value, start)
    else:
        tensor_at(module, name).copy_(value)
