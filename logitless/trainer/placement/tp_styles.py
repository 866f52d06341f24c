"""The split replica's own ParallelStyles (`torch.distributed.tensor.parallel`) where torch's round differently from
one device: see `tensor_parallel.py` for the split as a whole (which imports this module where a replica is split).

- `RowwiseFp32Sum`: o_proj and down_proj split by input columns (RowwiseParallel) with the group's partial
  products summed in fp32. Torch's RowwiseParallel rounds each rank's partial product to the model's dtype and
  all-reduces those (NCCL sums bf16 in bf16): in bf16, N + 1 roundings of 8-bit mantissas per output where one
  device's GEMM accumulates the whole product in fp32 and rounds once. Here each rank's partial product stays in
  fp32 (`partial_product`), the all-reduce sums fp32, and the sum plus the bias is rounded once to the layer's
  dtype: the one-device result up to the fp32 order of the sum.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import RowwiseParallel


def partial_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32 ([..., K] x [N, K] -> [..., N] fp32) for inputs of any float dtype, accumulated in fp32 and
    never rounded to the inputs' dtype: on CUDA a 16-bit GEMM with an fp32 output (`torch.mm(out_dtype=)`: the
    weights read once in their own dtype), elsewhere the product of fp32 upcasts (the same numbers: the product
    of two 16-bit floats is exact in fp32)."""
    if w.dtype == torch.float32 and x.dtype == torch.float32:
        return F.linear(x, w)
    if x.is_cuda and x.dtype == w.dtype and w.dtype in (torch.bfloat16, torch.float16):
        out = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        return out.view(*x.shape[:-1], w.shape[0])
    return F.linear(x.float(), w.float())


def _summed_in_fp32(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward of a `RowwiseFp32Sum` linear layer: x [..., K / N] (this rank's input columns, a plain tensor or
    a DTensor sharded on its last dimension) -> [..., out] replicated, in the weight's dtype."""
    w = self.weight
    x = x.to_local() if isinstance(x, DTensor) else x
    part = partial_product(x, w.to_local())
    y = DTensor.from_local(part, w.device_mesh, [Partial()], run_check=False).full_tensor()  # fp32 all-reduce
    if self.bias is not None:
        y = y + self.bias.to_local()
    return y.to(w.dtype)


class RowwiseFp32Sum(RowwiseParallel):
    """RowwiseParallel for an nn.Linear whose output is replicated, with the partial products summed in fp32 and
    rounded once (see the module docstring). The weight is split as RowwiseParallel splits it (Shard(1), the bias
    replicated); the forward runs on this rank's local tensors, so the layer takes a plain input sharded on its
    last dimension (a column-split layer's local output) and returns a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"RowwiseFp32Sum splits nn.Linear layers only, not {type(module).__name__}")
        if self.output_layouts != (Replicate(),) or not self.use_local_output:
            raise NotImplementedError("RowwiseFp32Sum returns a replicated plain tensor only")
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.forward = types.MethodType(_summed_in_fp32, module)
        return module
