"""One decode step's token draw over the logits as two Triton kernels: the upcast, temperature, log-sum-exp, the
Gumbel-max race and the gather in one read of the [B, V] logits.

    token, logp = sample_step(logits, keys, salt, temperature, greedy)
    # logits [B, V] bf16/fp16/fp32 (rows any stride, vocabulary contiguous), keys [B] int64 in [0, 2**32),
    # salt an int in [0, 2**32), or a 0-d int64 device tensor holding a counter c, whose salt the kernel computes
    # as counter_salt(c) = mix32((c + GOLDEN) mod 2**32) -> token [B] int64, logp [B] fp32

Equivalent to (`sample_step_reference`, the static engine's torch sampler in `logitless.rollout.sampling`):

    z = logits.float() / temperature                                   # [B, V]
    k = mix32(keys ^ salt)                                             # [B] the rows' keys at this step
    h = mix32(k[:, None] ^ mix32(2 * arange(V) + 1)[None, :])          # [B, V] one 32-bit hash per (row, token)
    u = min(((h >> 8) + 0.5) / 2**24, 1 - 2**-24)                      # uniform in (0, 1), in fp32
    token = argmax(z if greedy else z - log(-log(u)), -1)              # the first index of the maximum
    logp = z[token] - logsumexp(z, -1)

with mix32 the lowbias32 integer hash (`ops/hash32.py`). A counter read on the device lets a captured CUDA graph
draw a new step at each replay without a host-to-device copy. The draw is exact: the Gumbel-max trick picks token v
with probability softmax(z)[v]. Each program reads one block of one row's vocabulary once, in the logits' own dtype
(no fp32 copy of the logits), and writes that block's max, sum of exponentials, best score and its token; the
second kernel combines a row's blocks. The block size depends on V only, so a row's result does not depend on the
other rows of the batch (a wave-split rollout equals a single-wave one). `block_partials` is the first kernel
alone, over a shard of a vocabulary (columns holding token ids offset, offset + 1, ...: each column's noise is
its global id's), for the draw over a vocabulary split across processes (`rollout/vocab_split.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitless.ops.hash32 import GOLDEN, counter_salt, mix32

BLOCK_V = 4096  # vocabulary entries per program
NUM_WARPS = 8
_GOLDEN = tl.constexpr(GOLDEN)  # a jitted kernel reads only constexpr globals


@triton.jit
def _mix32(x):
    """lowbias32 of uint32 values (products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _block_kernel(
    X, KEYS, PM, PS, PB, PZ, PI,  # logits; keys; per-block max, sum of exp, best score, z at best, best token
    COUNTER,  # a 0-d int64 counter whose salt is drawn with (COUNTED), else unused
    stride_x, V, NB, salt, temperature, OFFSET,  # OFFSET: the token id of column 0 (a vocabulary shard's first)
    SCALE: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr, COUNTED: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = c * BLOCK + offs
    valid = cols < V
    x = tl.load(X + b.to(tl.int64) * stride_x + cols, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.math.div_rn(x, temperature) if SCALE else x  # IEEE division, as torch's logits / T
    m = tl.max(z, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a block of -inf logits adds exp(-inf) = 0
    s = tl.sum(tl.exp(z - m_safe), 0)
    if GREEDY:
        score = z
    else:
        if COUNTED:  # counter_salt(c): the uint32 sum wraps modulo 2**32
            salt = _mix32(tl.load(COUNTER).to(tl.uint32) + tl.full((), _GOLDEN, tl.uint32))
        key = _mix32(tl.load(KEYS + b).to(tl.uint32) ^ salt.to(tl.uint32))
        code = _mix32(((cols + OFFSET) * 2 + 1).to(tl.uint32))
        h = _mix32(code ^ key)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        u = tl.minimum(u, 0.99999994039535522)  # 1 - 2**-24: u < 1, so the noise is finite
        score = z - tl.log(-tl.log(u))
    score = tl.where(valid, score, float("-inf"))
    i = tl.argmax(score, 0)  # the first index of the block's maximum
    best = tl.max(score, 0)
    zb = tl.sum(tl.where(offs == i, z, 0.0), 0)
    o = b * NB + c
    tl.store(PM + o, m)
    tl.store(PS + o, s)
    tl.store(PB + o, best)
    tl.store(PZ + o, zb)
    tl.store(PI + o, (OFFSET + c * BLOCK + i).to(tl.int32))


@triton.jit
def _combine_kernel(PM, PS, PB, PZ, PI, TOKEN, LOGP, NB, BLOCK_NB: tl.constexpr):
    b = tl.program_id(0)
    o = tl.arange(0, BLOCK_NB)
    v = o < NB
    m = tl.load(PM + b * NB + o, mask=v, other=float("-inf"))
    s = tl.load(PS + b * NB + o, mask=v, other=0.0)
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    lse = top_safe + tl.log(tl.sum(s * tl.exp(m - top_safe), 0))
    best = tl.load(PB + b * NB + o, mask=v, other=float("-inf"))
    c = tl.argmax(best, 0)  # the first block holding the maximum: the lowest token among equal scores
    tl.store(TOKEN + b, tl.load(PI + b * NB + c).to(tl.int64))
    tl.store(LOGP + b, tl.load(PZ + b * NB + c) - lse)


def sample_step(logits: torch.Tensor, keys: torch.Tensor, salt: int | torch.Tensor, temperature: float,
                greedy: bool, block: int = BLOCK_V) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, logp [B] fp32) of one decode step; see the module docstring. temperature > 0 (the
    recorded logprobs' temperature; greedy draws the argmax whatever it is). salt: an int, or a 0-d int64 counter
    on the logits' device (read when the kernel runs; its salt is `counter_salt`)."""
    part, idx = block_partials(logits, keys, salt, temperature, greedy, block)
    B, nb = idx.shape
    token = torch.empty(B, dtype=torch.long, device=idx.device)
    logp = torch.empty(B, dtype=torch.float32, device=idx.device)
    if B:
        _combine_kernel[(B,)](part[0], part[1], part[2], part[3], idx, token, logp, nb,
                              BLOCK_NB=max(2, triton.next_power_of_2(nb)))
    return token, logp


def block_partials(logits: torch.Tensor, keys: torch.Tensor, salt: int | torch.Tensor, temperature: float,
                   greedy: bool, block: int = BLOCK_V, offset: int = 0,
                   width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first kernel of `sample_step` alone: each block of each row's logits [B, V] as (max of z, sum of
    exp(z - max), best score, z at the best) [4, B, nb] fp32 and its best token [B, nb] int32 (a block's first
    index of its maximum), for the columns holding token ids offset .. offset + V - 1 (a shard of a vocabulary:
    the noise of each token is its global id's). width: the columns the blocks span (>= V, default V; blocks
    past V are empty: max -inf, sum 0, best -inf), so that every shard of a vocabulary has the same blocks."""
    counted = torch.is_tensor(salt)
    if counted and (salt.dim() != 0 or salt.dtype != torch.long or salt.device != logits.device):
        raise ValueError(f"sample_step: a tensor salt is a 0-d int64 counter on {logits.device}, got "
                         f"{tuple(salt.shape)} {salt.dtype} on {salt.device}")
    if logits.dim() != 2 or keys.shape != logits.shape[:1]:
        raise ValueError(f"sample_step needs logits [B, V] and keys [B], got {tuple(logits.shape)} and "
                         f"{tuple(keys.shape)}")
    if not temperature > 0:
        raise ValueError(f"sample_step: temperature={temperature!r} must be > 0")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    width = V if width is None else width
    if width < V:
        raise ValueError(f"block_partials: width={width} is below the logits' {V} columns")
    block = min(block, max(16, triton.next_power_of_2(width)))
    nb = triton.cdiv(width, block)
    dev = logits.device
    part = torch.empty((4, B, nb), dtype=torch.float32, device=dev)  # max, sum, best score, z at best
    idx = torch.empty((B, nb), dtype=torch.int32, device=dev)
    if B:
        _block_kernel[(B, nb)](logits, keys.contiguous(), part[0], part[1], part[2], part[3], idx,
                               salt if counted else idx, logits.stride(0), V, nb,  # (idx: not read)
                               0 if counted else int(salt) & 0xFFFFFFFF, float(temperature), int(offset),
                               SCALE=temperature != 1.0, GREEDY=bool(greedy), BLOCK=block, COUNTED=counted,
                               num_warps=NUM_WARPS if block >= 1024 else 4)
    return part, idx


def sample_step_reference(logits: torch.Tensor, keys: torch.Tensor, salt: int | torch.Tensor, temperature: float,
                          greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive computation `sample_step` is equivalent to, in torch ([B, V] fp32 buffers)."""
    salt = counter_salt(int(salt)) if torch.is_tensor(salt) else salt
    z = logits.float() / temperature if temperature != 1.0 else logits.float()
    if greedy:
        token = z.argmax(-1)
    else:
        k = mix32(keys.long() ^ (int(salt) & 0xFFFFFFFF))
        codes = mix32(torch.arange(z.shape[-1], device=z.device, dtype=torch.long) * 2 + 1)
        h = mix32(k[:, None] ^ codes[None, :])
        u = (((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)).clamp(max=1.0 - 2**-24)
        token = (z - torch.log(-torch.log(u))).argmax(-1)
    logp = z.gather(1, token[:, None]).squeeze(1) - torch.logsumexp(z, -1)
    return token, logp
