"""Device memory that is released between rollouts and comes back at the same addresses.

A rollout engine's own weights (the merged-LoRA inference copy, the replica under FSDP2) are read only while it
decodes; during the update they are dead, and the next weight sync rewrites them in full. `SleepableMemory` holds
such tensors in one reserved virtual-address range of CUDA's virtual memory management (cuMemAddressReserve,
cuMemCreate, cuMemMap, through the driver API with ctypes: no compiled extension):
- `sleep()` unmaps and frees the physical memory; the tensors keep their addresses, their contents are lost, and
  reading them before `wake()` is an illegal memory access.
- `wake()` maps fresh physical memory at the same addresses, so CUDA graphs captured over the tensors stay valid;
  the caller then rewrites them (the weight sync).
This is the mechanism of vLLM's sleep mode, for the weights only (the decode KV cache already lives for one
rollout).

Accounting: mapped bytes are outside torch's caching allocator, so `torch.cuda.max_memory_allocated` misses them.
`mapped_peak()` is the most bytes mapped since `reset_mapped_peak()`; the trainer adds it to each phase's peak.
Under `torch.cuda.set_per_process_memory_fraction`, a wake lowers torch's cap by the mapped bytes and a sleep
gives them back, so torch and the mapped memory together stay within the cap.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

ALIGN = 512  # bytes; every tensor in the range starts on this boundary

_LOCATION_DEVICE, _ALLOC_PINNED, _READ_WRITE, _GRANULARITY_MIN = 1, 1, 3, 0
_OUT_OF_MEMORY = 2
_mapped = {"now": 0, "peak": 0}  # bytes mapped by every SleepableMemory of this process


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} failed: CUDA driver error {code} ({text})")
        self.code = code


_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _check(call: str, code: int) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(code, ctypes.byref(text))
        raise DriverError(call, code, (text.value or b"unknown").decode())


def layout(nbytes: Sequence[int], granularity: int) -> tuple[list[int], int]:
    """Offsets of tensors of `nbytes` bytes packed in one range, each on an ALIGN boundary, and the range's size
    rounded up to `granularity` (the driver's mapping unit)."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + int(n)
    size = max(-(-end // granularity) * granularity, granularity)
    return offsets, size


def unavailable(device: torch.device) -> str | None:
    """Why sleepable memory cannot be used on `device` (None if it can): it needs a CUDA device whose driver
    supports virtual memory management."""
    if device.type != "cuda":
        return f"it needs a CUDA device (got {device.type})"
    try:
        lib = _driver()
        supported = ctypes.c_int()
        attribute = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        torch.cuda.init()
        _check("cuDeviceGetAttribute", lib.cuDeviceGetAttribute(ctypes.byref(supported), attribute, _index(device)))
    except (OSError, DriverError) as e:
        return f"the CUDA driver cannot be used for it ({e})"
    return None if supported.value else "this GPU or driver does not support CUDA virtual memory management"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _Raw:
    """A zero-copy view of mapped memory for `torch.as_tensor` (the CUDA array interface)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


class SleepableMemory:
    """`tensors` moved into one sleepable range on their CUDA device; each tensor's `.data` becomes a view of it
    (Parameters stay the same objects). Starts awake, with the tensors' values copied in. fill=False: nothing is
    copied (the contents are undefined until written), so a tensor may be a placeholder that holds no memory of its
    own (an expanded one-element tensor of the right shape): the range is then the only memory they ever take."""

    def __init__(self, tensors: Sequence[torch.Tensor], fill: bool = True):
        if not tensors:
            raise ValueError("SleepableMemory needs at least one tensor")
        self.device = tensors[0].device
        why = unavailable(self.device)
        if why is not None:
            raise RuntimeError(f"sleepable memory is unavailable: {why}")
        if any(t.device != self.device for t in tensors):
            raise ValueError("SleepableMemory: every tensor must be on one device")
        lib = _driver()
        self._prop = _Prop()
        self._prop.type, self._prop.location = _ALLOC_PINNED, _Location(_LOCATION_DEVICE, _index(self.device))
        gran = ctypes.c_size_t()
        _check("cuMemGetAllocationGranularity",
               lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop), _GRANULARITY_MIN))
        offsets, self.size = layout([t.numel() * t.element_size() for t in tensors], gran.value)
        ptr = ctypes.c_uint64()
        with torch.cuda.device(self.device):
            _check("cuMemAddressReserve", lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.size),
                                                                 ctypes.c_size_t(0), ctypes.c_uint64(0),
                                                                 ctypes.c_uint64(0)))
        self.ptr = ptr.value
        self._handle: int | None = None
        self._cap: float | None = None  # torch's memory fraction before a wake lowered it
        self.wake()
        buffer = torch.as_tensor(_Raw(self.ptr, self.size), device=self.device)  # [size] uint8
        with torch.no_grad():
            for t, off in zip(tensors, offsets):
                n = t.numel() * t.element_size()
                view = buffer[off : off + n].view(t.dtype).view(t.shape)
                if fill:
                    view.copy_(t)
                t.data = view
        self.tensors = list(tensors)

    @property
    def awake(self) -> bool:
        return self._handle is not None

    def wake(self) -> None:
        """Map fresh physical memory at the range's addresses (contents undefined until rewritten)."""
        if self.awake:
            return
        lib, handle = _driver(), ctypes.c_uint64()
        with torch.cuda.device(self.device):
            code = lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self._prop),
                                   ctypes.c_uint64(0))
            if code == _OUT_OF_MEMORY:  # memory torch's allocator caches unused: give it back and retry
                torch.cuda.empty_cache()
                code = lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self._prop),
                                       ctypes.c_uint64(0))
            if code == _OUT_OF_MEMORY:
                raise torch.OutOfMemoryError(
                    f"the rollout's weight copy ({self.size / 2**30:.2f} GiB) does not fit back on {self.device}: "
                    "lower the training memory, or set rollout.weight_copy=resident to keep the copy resident"
                )
            _check("cuMemCreate", code)
            try:
                _check("cuMemMap", lib.cuMemMap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size),
                                                ctypes.c_size_t(0), handle, ctypes.c_uint64(0)))
            except DriverError:
                lib.cuMemRelease(handle)
                raise
            access = _AccessDesc(_Location(_LOCATION_DEVICE, _index(self.device)), _READ_WRITE)
            _check("cuMemSetAccess", lib.cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size),
                                                        ctypes.byref(access), ctypes.c_size_t(1)))
        self._handle = handle.value
        _mapped["now"] += self.size
        _mapped["peak"] = max(_mapped["peak"], _mapped["now"])
        self._lower_cap()

    def sleep(self) -> None:
        """Free the physical memory once queued work is done; the tensors' contents are lost."""
        if not self.awake:
            return
        torch.cuda.synchronize(self.device)  # no queued kernel may still read the range
        lib = _driver()
        _check("cuMemUnmap", lib.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size)))
        _check("cuMemRelease", lib.cuMemRelease(ctypes.c_uint64(self._handle)))
        self._handle = None
        _mapped["now"] -= self.size
        self._restore_cap()

    def _lower_cap(self) -> None:
        fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        if fraction < 1.0:
            total = torch.cuda.get_device_properties(self.device).total_memory
            self._cap = fraction
            torch.cuda.set_per_process_memory_fraction(max(fraction - self.size / total, 0.0), self.device)

    def _restore_cap(self) -> None:
        if self._cap is not None:
            torch.cuda.set_per_process_memory_fraction(self._cap, self.device)
            self._cap = None

    def __del__(self) -> None:
        try:
            if self.awake:
                self.sleep()
            _driver().cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


def mapped_peak() -> int:
    """The most bytes all sleepable memory of this process held mapped since the last `reset_mapped_peak`."""
    return _mapped["peak"]


def reset_mapped_peak() -> None:
    _mapped["peak"] = _mapped["now"]
