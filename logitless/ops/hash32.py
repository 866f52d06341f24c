"""The 32-bit integer hash behind the samplers' per-row random streams (lowbias32), in torch int64 arithmetic and
for one host int. Every product stays below 2**63, so the result is the same on every device and under
torch.compile; `ops/triton_sampling.py` computes the same hash in uint32 inside its kernel."""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive counters


def mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for x in [0, 2**32) without int64 overflow: split m into 16-bit halves."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (lowbias32) of int64 tensors holding values in [0, 2**32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    """`mix32` of one Python int, on the host: equal to mix32(torch.tensor(x)) for 0 <= x < 2**63."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def counter_salt(counter: int) -> int:
    """The salt of a step counter: mix32((counter + GOLDEN) mod 2**32). The Triton draw computes the same from a
    counter it reads on the device (`triton_sampling.sample_step` with a tensor salt)."""
    return mix32_int(counter + GOLDEN)
