"""Offload to host memory: activations saved for backward (`ActivationOffload`), and the training state the
rollout does not read, for the rollout's duration (`ParkedState`).

Activation offload: tensors saved for backward go to (pinned) CPU memory and come back ahead of the backward.

With gradient checkpointing the tensors autograd saves outside the checkpointed layers are each layer's inputs
(plus the embedding output, the final norm's input and the fused op's [N, H] hidden rows); inside a layer the
checkpoint's own hooks take over and save nothing. `ActivationOffload` is a
`torch.autograd.graph.saved_tensors_hooks` context around the forward:

- pack: a saved tensor of at least `min_bytes` that is not a parameter is copied into a pinned host buffer on a
  side stream (the device tensor is freed once the copy is done: `record_stream`), and replaced by a key.
- unpack (in backward, layers in reverse order): the tensor is brought back on the side stream, and so is the
  one packed just before it, which the backward needs next, so its copy overlaps this layer's recompute.
- A host copy lives as long as the autograd node that saved it (the node holds the packed handle; the stash only
  refers to it weakly), as with torch's `save_on_cpu`: once a micro-batch's backward has run, its pinned buffers
  go back to torch's host allocator for the next micro-batch, whatever keeps this object alive.

On a CPU model the same bookkeeping runs with plain host copies and no streams (nothing to save there; it keeps
the path tested). Gradients are identical with and without offload: only where the saved tensors live changes.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

MIN_BYTES = 1 << 20  # smaller saved tensors (masks, rotary tables, [b, t] loss terms) stay where they are


@dataclass(eq=False)
class _Stashed:
    key: int  # order of packing: the backward needs key - 1 next
    host: torch.Tensor  # the saved tensor's copy in (pinned) host memory
    device: torch.device  # where it lived, and goes back to
    back: torch.Tensor | None = None  # the copy brought back (prefetched or fetched), until unpacked
    ready: torch.cuda.Event | None = None  # the side stream's event after `back` was copied


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep the large non-parameter tensors of a forward in host memory until backward.

    Use around the forward only. Each host copy lives as long as the autograd node that saved it: until the
    backward has run (or the graph is dropped), not as long as this object.
    """

    def __init__(self, model: nn.Module, min_bytes: int | None = None):
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.params = {_storage_ptr(p) for p in model.parameters()}
        self.stash: dict[int, weakref.ref[_Stashed]] = {}  # key -> the node's handle, for the prefetch
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
        s = _Stashed(len(self.stash), host, t.device)
        self.stash[s.key] = weakref.ref(s)
        self.packed_bytes += host.numel() * host.element_size()
        return s  # the autograd node holds it: the host copy is freed with the node

    def live(self) -> list[_Stashed]:
        """The host copies still held by some autograd node."""
        return [s for ref in self.stash.values() if (s := ref()) is not None]

    def _fetch(self, s: _Stashed) -> None:
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
        s: _Stashed = packed
        self._fetch(s)
        prev = self.stash.get(s.key - 1)
        if prev is not None and (p := prev()) is not None:
            self._fetch(p)  # the backward's next tensor: its copy overlaps this layer's backward
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


class ParkedState:
    """Device tensors moved to pinned host memory and back in place, bit for bit: training state that the rollout
    does not read (optimizer states; FSDP2 parameter shards while the engine decodes from a replica).

    `park(tensors)` copies each distinct storage under `tensors` (a DTensor's local shard) to a host buffer and
    frees it on the device (`UntypedStorage.resize_(0)`, as FSDP2 frees unsharded parameters: every tensor and
    view keeps its identity, the optimizer's keys included). `unpark()` re-allocates the storages and copies the
    bytes back. Equivalent to leaving them in place, minus their device memory in between. The host buffers are
    kept for the next park, so pinning happens once. On a CPU model the same copies run between host buffers
    (nothing to save there; it keeps the path tested).
    """

    def __init__(self) -> None:
        self.host: dict[int, torch.Tensor] = {}  # storage identity -> its bytes on the host
        self.parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.parked_bytes = 0

    def park(self, tensors: list[torch.Tensor]) -> None:
        if self.parked:
            raise RuntimeError("ParkedState.park: already parked; unpark first")
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            st = getattr(t, "_local_tensor", t).untyped_storage()
            if st.nbytes() > 0:
                storages.setdefault(st._cdata, st)
        self.host = {k: v for k, v in self.host.items() if k in storages}  # drop buffers of storages gone since
        for key, st in storages.items():
            host = self.host.get(key)
            if host is None or host.numel() != st.nbytes():
                host = self.host[key] = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=st.device.type == "cuda")
            host.copy_(_bytes(st), non_blocking=True)
            self.parked.append((st, host))
        cuda = next((st.device for st, _ in self.parked if st.device.type == "cuda"), None)
        if cuda is not None:
            torch.cuda.current_stream(cuda).synchronize()  # the copies have read the bytes
        for st, _ in self.parked:
            st.resize_(0)
        self.parked_bytes = sum(h.numel() for _, h in self.parked)

    @contextlib.contextmanager
    def lend(self, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
        """The parked storages under `tensors` back on the device for the block (copied from their host bytes),
        freed again after it; the others stay parked. The block reads them and must not change them: the host bytes
        stay what `unpark` restores. Tensors not parked are left alone. (The replica's sync with the shards parked:
        one FSDP unit's shards lent at a time, so the device never holds every shard beside the replica.)"""
        keys = {getattr(t, "_local_tensor", t).untyped_storage()._cdata for t in tensors}
        lent = [(st, host) for st, host in self.parked if st._cdata in keys and st.nbytes() == 0]
        for st, host in lent:
            st.resize_(host.numel())
            _bytes(st).copy_(host, non_blocking=True)
        try:
            yield
        finally:
            cuda = next((st.device for st, _ in lent if st.device.type == "cuda"), None)
            if cuda is not None:
                torch.cuda.synchronize(cuda)  # every stream's reads of them (an all-gather's copy-in) are done
            for st, _ in lent:
                st.resize_(0)

    def unpark(self) -> None:
        for st, host in self.parked:
            st.resize_(host.numel())
            _bytes(st).copy_(host, non_blocking=True)  # from pinned memory, ordered before any later kernel
        self.parked = []


def _bytes(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    """The optimizer's state tensors on `device` (moments, 8-bit states and their scales), not its step counters."""
    out = []
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values():
            t = getattr(v, "_local_tensor", v)
            if isinstance(t, torch.Tensor) and _on(t, device) and t.numel() > 1:
                out.append(v)
    return out


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
