"""The static engine's sampler: per-row random streams and one fused sampling pass over the logits.

Per-row random streams
----------------------
Every sampled token draws its noise from a counter-based hash of (row key, step, vocabulary index), where the
row key is a hash of (seed, prompt index, sample index). A row's tokens therefore depend only on its own key and
its own logits: not on how many rows are decoded together, on the order of the waves, or on which device
generates the other rows. This is what makes a wave-split rollout identical to a single-wave one.

The hash is a 32-bit integer mixer (Wellons' "lowbias32") run in int64 tensor arithmetic: every product stays
below 2**63, so the result is the same on every device and under torch.compile. Its top 24 bits give a uniform
u in (0, 1) (clamped below 1: in fp32 the top value would round to 1), and -log(-log u) a Gumbel variate.

Fused sampling pass
-------------------
`sample_tokens` computes, in one pass over the [B, V] logits, log_softmax(logits / T) at the sampled token and
the token itself: argmax(filtered scores + Gumbel) is an exact draw from softmax(filtered scores) (the
Gumbel-max trick; the same as the exponential race argmax p / Exp(1)). On CUDA it is compiled by torch.compile
into a few fused kernels instead of a dozen [B, V] passes, the logits' upcast to fp32 included. Top-k / top-p /
min-p and repetition penalty are transformers' own processors, applied to the temperature-scaled logits before the
race when they are on.

`step_sampler` picks how an unfiltered step draws: "torch" (`sample_tokens`, compiled on CUDA) or "triton"
(`ops.triton_sampling.sample_step`: the same draw, bit for bit in tokens, as two kernels that read the logits
once in their own dtype and fold the step into the row keys themselves, with no dynamo call per step).
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import LogitsProcessor

from logitless.models.compiled import EAGER_NUMERICS
from logitless.ops.hash32 import GOLDEN, MASK32, counter_salt, mix32
from logitless.ops.hash32 import mul32 as _mul32  # noqa: F401  (tests check it here, beside mix32)


def step_salt(step: int) -> int:
    """The host-side hash a row key is folded with at decode step `step`: step_keys(keys, step) equals
    mix32(keys ^ step_salt(step)) (what the Triton draw computes in its kernel)."""
    return counter_salt(step)


def _fold(h: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """Hash `value` into the running key `h` (order-dependent). An int value is hashed on the host: a device
    tensor made from it would be a host-to-device copy, which synchronizes the stream (once per decode step). A
    tensor value (a step counter on the device, as in a replayed CUDA graph) is hashed on the device, the same."""
    mixed = step_salt(value) if isinstance(value, int) else mix32(value.long() + GOLDEN)
    return mix32((h ^ mixed) & MASK32)


def row_keys(seed: int, prompt_index: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """[B] int64 key of each row's random stream, from (seed, prompt index, sample index); any int seed."""
    seed = int(seed) % 2**64
    h = torch.full_like(prompt_index, seed & MASK32, dtype=torch.long)
    h = _fold(mix32(h), seed >> 32)
    return _fold(_fold(h, prompt_index.long()), sample_index.long())


def step_keys(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """[B] keys of the rows' draws at decode step `step` (an int, or a 0-d int64 tensor on the keys' device)."""
    return _fold(keys, step)


TURN_TAG = 0x7475726E  # folded into a row key before a turn index, so turn keys never equal step keys


def turn_keys(keys: torch.Tensor, turn: int) -> torch.Tensor:
    """[B] row keys of turn `turn` of multi-turn episodes: the keys themselves for turn 0 (a one-turn episode draws
    what a single-turn rollout draws), a fold of (TURN_TAG, turn) after it."""
    return keys if turn == 0 else _fold(_fold(keys, TURN_TAG), turn)


def rows_turn_keys(keys: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """[B] `turn_keys` of each row at its own turn `turns` [B] (int64): rows of one call may be at different turns."""
    return torch.where(turns == 0, keys, _fold(_fold(keys, TURN_TAG), turns))


def rows_step_keys(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] keys that a draw at step 0 folds into `step_keys(keys, steps)` row by row: keys ^ salt(steps) ^ salt(0).
    A `StepSampler` takes one step for all rows; with these keys and step 0 each row draws at its own step
    `steps` [B] (int64, on the keys' device), the same tokens bit for bit, with the torch or the Triton draw."""
    return keys ^ mix32(steps.long() + GOLDEN) ^ step_salt(0)


def vocab_codes(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] int64 hashed vocabulary indices, computed once per call and reused at every step."""
    return mix32(torch.arange(vocab, dtype=torch.long, device=device) * 2 + 1)


def gumbel(keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[B, V] fp32 Gumbel(0, 1) noise: element (b, v) depends only on keys[b] and codes[v]."""
    h = mix32(keys[:, None] ^ codes[None, :])  # [B, V] in [0, 2**32)
    # (h >> 8) + 0.5 is not exact in fp32 above 2**23 (spacing 1): the top value rounds to 2**24, u to 1.0 and
    # the noise to +inf (+inf + -inf = NaN for a filtered token), which argmax would pick whatever its
    # probability: once per 2**24 elements, about 1 % of the draws over a 150k vocabulary. The clamp keeps u < 1.
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)
    u = u.clamp(max=1.0 - 2**-24)  # (0, 1), never 0 or 1; every other value unchanged
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: torch.Tensor,  # [B, V] raw logits (any float dtype; computed in fp32)
    scores: torch.Tensor | None,  # [B, V] fp32 filtered logits / T to draw from, or None: logits / T
    keys: torch.Tensor,  # [B] int64 step keys (`step_keys`)
    codes: torch.Tensor,  # [V] int64 (`vocab_codes`)
    temperature: float,  # of the recorded logprobs
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logp [B]) with logp = log_softmax(logits / T)[token] and token drawn from softmax(scores)
    (argmax for greedy) by the Gumbel-max trick with the rows' own noise."""
    logits = logits.float()  # (a no-op for fp32; fused into the compiled pass for bf16)
    scaled = logits / temperature if temperature != 1.0 else logits
    lse = torch.logsumexp(scaled, dim=-1)  # [B]
    draw = scaled if scores is None else scores
    token = draw.argmax(-1) if greedy else (draw + gumbel(keys, codes)).argmax(-1)
    logp = scaled.gather(1, token[:, None]).squeeze(1) - lse
    return token, logp


_compiled: dict[bool, Callable] = {}


def fused_sampler(device: torch.device, compile: bool) -> Callable:
    """`sample_tokens`, compiled into fused kernels on CUDA when `compile` (one compiled function per process)."""
    if not compile or device.type != "cuda":
        return sample_tokens
    if True not in _compiled:
        # dynamic after a second row count. Not fullgraph: a process that samples at more (temperature, greedy,
        # shape) variants than dynamo's recompile limit (8) then runs the extra ones eagerly instead of failing.
        _compiled[True] = torch.compile(sample_tokens, options=EAGER_NUMERICS)
    return _compiled[True]


SAMPLER_KERNELS = ("torch", "triton")
StepSampler = Callable[[torch.Tensor, torch.Tensor, "int | torch.Tensor", torch.Tensor, float, bool],
                       tuple[torch.Tensor, torch.Tensor]]


def resolve_sampler_kernel(kernel: str, device: torch.device, has_triton: bool) -> str:
    """How the static engine draws an unfiltered token. "auto": "triton" on a CUDA GPU with triton installed
    (measured faster, bench/LOG.md), else "torch". "triton" asked for explicitly is refused off CUDA and without
    triton; any other name is refused."""
    if kernel not in ("auto", *SAMPLER_KERNELS):
        raise ValueError(f"rollout.sampler_kernel={kernel!r}: use one of {('auto', *SAMPLER_KERNELS)}")
    if kernel == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if kernel == "triton" and (device.type != "cuda" or not has_triton):
        raise ValueError(f"rollout.sampler_kernel=triton runs Triton kernels on a CUDA GPU, but the rollout decodes "
                         f"on {device}{'' if device.type != 'cuda' else ' without the triton package'}; set "
                         "rollout.sampler_kernel=torch (or auto)")
    return kernel


def step_sampler(device: torch.device, kernel: str, compile: bool) -> StepSampler:
    """draw(logits [B, V], keys [B] row keys, step, codes [V], T, greedy) -> (token [B], logp [B]) of an unfiltered
    decode step: `sample_tokens` at `step_keys(keys, step)` ("torch"; compiled on CUDA when `compile`), or the
    Triton kernels computing the same ("triton", CUDA). step: an int, or a 0-d int64 device tensor (the draw then
    reads it on the device, so a captured CUDA graph draws each replay's step)."""
    if kernel == "triton":
        from logitless.ops.triton_sampling import sample_step

        def triton_draw(logits, keys, step, codes, temperature, greedy):
            return sample_step(logits, keys, step if torch.is_tensor(step) else step_salt(step), temperature, greedy)

        return triton_draw
    fn = fused_sampler(device, compile)

    def torch_draw(logits, keys, step, codes, temperature, greedy):
        return fn(logits, None, step_keys(keys, step), codes, temperature, greedy)

    return torch_draw


def filtered_draw(filters: list[LogitsProcessor]) -> StepSampler:
    """A `StepSampler` drawing eagerly through top-k / top-p / min-p `filters` (processors that read no earlier
    tokens: the multi-turn and refill decodes keep no whole-sequence history for them)."""

    def draw(logits, keys, step, codes, temperature, greedy):
        scores = apply_filters(filters, None, logits.float() / temperature)
        return sample_tokens(logits, scores, step_keys(keys, step), codes, temperature, greedy)

    return draw


def apply_filters(filters: list[LogitsProcessor], history: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor | None:
    """transformers' repetition penalty / top-k / top-p / min-p over the temperature-scaled logits (both commute
    with the positive scale 1/T, so the order matches `generate`'s); None when no filter is on."""
    if not filters:
        return None
    scores = scaled
    for proc in filters:
        scores = proc(history, scores)
    return scores
