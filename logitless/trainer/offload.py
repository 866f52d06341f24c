"""Activation offload: tensors saved for backward go to (pinned) CPU memory and come back ahead of the backward.

With gradient checkpointing the tensors autograd saves outside the checkpointed layers are each layer's inputs
(plus the embedding output, the final norm's input and the fused op's [N, H] hidden rows); inside a layer the
checkpoint's own hooks take over and save nothing. `ActivationOffload` is a
`torch.autograd.graph.saved_tensors_hooks` context around the forward:

- pack: a saved tensor of at least `min_bytes` that is not a parameter is copied into a pinned host buffer on a
  side stream (the device tensor is freed once the copy is done: `record_stream`), and replaced by a key.
- unpack (in backward, layers in reverse order): the tensor is brought back on the side stream, and so is the
  one packed just before it, which the backward needs next, so its copy overlaps this layer's recompute.

On a CPU model the same bookkeeping runs with plain host copies and no streams (nothing to save there; it keeps
the path tested). Gradients are identical with and without offload: only where the saved tensors live changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MIN_BYTES = 1 << 20  # smaller saved tensors (masks, rotary tables, [b, t] loss terms) stay where they are


@dataclass
class _Stashed:
    host: torch.Tensor  # the saved tensor's copy in (pinned) host memory
    device: torch.device  # where it lived, and goes back to
    back: torch.Tensor | None = None  # the copy brought back (prefetched or fetched), until unpacked
    ready: torch.cuda.Event | None = None  # the side stream's event after `back` was copied


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep the large non-parameter tensors of a forward in host memory until backward.

    Use around the forward only. The host copies live as long as this object, which the autograd graph of the
    forward holds (through the unpack hook) until its backward has run.
    """

    def __init__(self, model: nn.Module, min_bytes: int | None = None):
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.params = {_storage_ptr(p) for p in model.parameters()}
        self.stash: dict[int, _Stashed] = {}
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.packed_bytes = 0  # host bytes of this forward (a metric for the caller)
        super().__init__(self._pack, self._unpack)

    def _offloads(self, t: torch.Tensor) -> bool:
        return (
            t.numel() * t.element_size() >= self.min_bytes
            and not isinstance(t, nn.Parameter)
            and not (t.is_leaf and t.requires_grad)
            and t.layout == torch.strided
            and _storage_ptr(t) not in self.params
        )

    def _pack(self, t: torch.Tensor):
        if not self._offloads(t):
            return t
        cuda = t.is_cuda and self.stream is not None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        if cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(t)
        key = len(self.stash)
        self.stash[key] = _Stashed(host, t.device)
        self.packed_bytes += host.numel() * host.element_size()
        return key

    def _fetch(self, key: int) -> None:
        s = self.stash[key]
        if s.back is not None:
            return
        if s.device.type == "cuda" and self.stream is not None:
            with torch.cuda.stream(self.stream):
                s.back = s.host.to(s.device, non_blocking=True)
                s.ready = self.stream.record_event()
        else:
            s.back = s.host.to(s.device, copy=True)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        key: int = packed
        self._fetch(key)
        if key - 1 in self.stash:
            self._fetch(key - 1)  # the backward's next tensor: its copy overlaps this layer's backward
        s = self.stash[key]
        t, s.back = s.back, None
        if s.ready is not None:
            stream = torch.cuda.current_stream(s.device)
            stream.wait_event(s.ready)
            t.record_stream(stream)
            s.ready = None
        return t


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Address of a tensor's storage (None for tensor subclasses without one, e.g. FSDP2's DTensor shards)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
