"""Experiment: fewer, larger GEMMs per decode step by fusing the projections that read the same input.

A decode step of the Qwen2.5-1.5B shape at 128 rows is over 530 kernels with about 3 µs of idle GPU between
consecutive ones, also inside a CUDA graph (bench/LOG.md, "Step graphs: dropped"). Per layer, q/k/v read the
same normed hidden state, and so do gate/up. `fuse_projections` gives each such group one weight [sum of outs,
H] (and bias) and replaces every projection by a `SlicedLinear`: the group's first member computes the whole
product, the others take their columns from it, so a decode step runs one QKV and one gate-up GEMM per layer,
eagerly and under torch.compile (checked: the compiled graph has 3 fewer matrix products per layer). The model's code is unchanged: the attention and MLP modules call their projections as
before.

`tests/test_bench_fused_projections.py` checks the fused model against the original on CPU;
`bench/prof_decode.py --fuse-projections` times the `static` engine on a fused copy in the same process.
"""

from __future__ import annotations


import torch
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SlicedLinear(nn.Module):
    """Columns [start, stop) of `group`'s product: F.linear(x, group.weight, group.bias)[..., start:stop].

    The group's members are called one after the other on the same input (q, k, v; gate, up): the first computes
    the whole product and leaves it on the group, the next ones take their columns from it while the input is the
    same tensor, and the last drops it (no tensor outlives the forward). torch.compile traces this into one GEMM."""

    def __init__(self, group: nn.Linear, start: int, stop: int, last: bool):
        super().__init__()
        self.group = [group]  # not a submodule: the parent owns it once
        self.start, self.stop, self.last = start, stop, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group[0]
        cached = g.product
        if cached is not None and cached[0] is x:
            out = cached[1]
        else:
            out = nn.functional.linear(x, g.weight, g.bias)
        g.product = None if self.last else (x, out)
        return out[..., self.start : self.stop]


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of GROUPS found in one module (all nn.Linear, same input size and dtype); returns how many
    groups were fused. The fused weights are new tensors: this is for an inference copy."""
    fused = 0
    for module in list(model.modules()):
        for names in GROUPS:
            parts = [getattr(module, n, None) for n in names]
            if not all(isinstance(p, nn.Linear) for p in parts):
                continue
            if len({p.in_features for p in parts}) != 1 or len({p.weight.dtype for p in parts}) != 1:
                continue
            has_bias = [p.bias is not None for p in parts]
            group = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=any(has_bias),
                              device=parts[0].weight.device, dtype=parts[0].weight.dtype)
            group.weight.copy_(torch.cat([p.weight for p in parts]))
            if group.bias is not None:
                group.bias.copy_(torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                                            for p in parts]))
            group.product = None
            setattr(module, "_".join(names) + "_fused", group)
            start = 0
            for i, (name, part) in enumerate(zip(names, parts)):
                setattr(module, name, SlicedLinear(group, start, start + part.out_features, last=i == len(names) - 1))
                start += part.out_features
            fused += 1
    return fused
