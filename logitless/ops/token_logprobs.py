"""Public entry of the fused token-logprob op: input validation and backend dispatch."""

from __future__ import annotations

import math
import numbers

import torch

from logitless.ops.chunked import ChunkedTokenLogprobs, chunked_forward, default_chunk_size
from logitless.ops.reference import token_logprobs_reference

BACKENDS = ("auto", "chunked", "triton", "reference")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def token_logprobs(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] integer token ids in [0, V)
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    backend: str = "auto",
    grad_hint: torch.Tensor | None = None,  # [N] expected d loss / d logp (a speed hint, see below)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target token (and the entropy of its distribution) without [N, V] logits.

    Equivalent to (but never materializing the [N, V] logits, and accumulating in fp32)::

        logits = (hidden.float() @ weight.float().T + (0 if bias is None else bias.float())) / temperature
        logprobs = torch.log_softmax(logits, dim=-1)                      # [N, V]
        logp = logprobs.gather(-1, targets.long()[:, None]).squeeze(-1)  # [N]
        entropy = -(logprobs.exp() * logprobs).sum(-1) if with_entropy else None  # [N]

    Returns `(logp [N], entropy [N] or None)` in float32 (float64 for float64 inputs) for float32, bfloat16,
    float16 or float64 inputs. Differentiable w.r.t. `hidden`, `weight` and `bias`, with upstream gradients
    for both outputs. A frozen weight (`requires_grad=False`) costs no weight-gradient GEMM. Under
    `torch.no_grad()` (or when no input requires grad) nothing is saved for backward.

    Memory: the "chunked" backend processes `chunk_size` rows at a time; each [chunk_size, V] fp32 tile is
    `4 * chunk_size * V` bytes and about 3 tiles are live at once. The default `chunk_size` is
    `2**24 // V` rows on CPU (~64 MiB per tile; V=151,665 -> 96 rows) and `2**27 // V` on CUDA (~512 MiB;
    V=151,665 -> 880 rows), a multiple of 16 and at most 4096, independent of N. A trainable head adds an
    fp32 [V, H] grad accumulator; a frozen head without entropy saves an fp32 [N, H] partial grad of `hidden`
    (the same order as `hidden` itself).

    Backends: "auto" (Triton kernel on CUDA when available, else "chunked"), "chunked" (pure PyTorch, any
    device), "triton" (CUDA only; ignores `chunk_size`), "reference" (dense oracle, allocates [N, V]).

    `grad_hint` [N]: the gradient the loss will send to `logp`, when it is known before the forward (e.g.
    on-policy GRPO without a KL term, see `logitless.objectives.on_policy_logp_grad`). With a trainable head
    on the Triton backend, the forward then also forms the gradients for that upstream: 3 GEMMs in all
    instead of 4. Backward uses them only if its upstream gradient equals the hint exactly (one device sync
    to compare) and the entropy gets no gradient; otherwise it recomputes as without a hint. So a wrong hint
    costs time, never correctness. What it changes is rounding: grad_W is accumulated over at most 16 row
    chunks in the weight's dtype (`triton_op.HINT_FP32_ACCUMULATE` for fp32). Other backends, a frozen head
    and no-grad calls ignore it.
    """
    _validate(hidden, weight, targets, bias, temperature, with_entropy, chunk_size, backend)
    _validate_hint(grad_hint, hidden)
    temperature = float(temperature)

    if backend == "reference":
        return token_logprobs_reference(
            hidden, weight, targets, bias=bias, temperature=temperature, with_entropy=with_entropy
        )
    if backend in ("auto", "triton"):
        triton_fn = _triton_impl(hidden, backend)
        if triton_fn is not None:
            return triton_fn(hidden, weight, targets, bias, temperature, with_entropy, grad_hint)

    chunk = default_chunk_size(weight.shape[0], hidden.device) if chunk_size is None else int(chunk_size)
    targets = targets.long()
    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:  # old/ref logprobs: plain forward, nothing saved
        logp, entropy, _ = chunked_forward(hidden, weight, targets, bias, temperature, with_entropy, chunk)
        return logp, entropy
    return ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, temperature, with_entropy, chunk)


def _triton_impl(hidden: torch.Tensor, backend: str):
    """The Triton entry point if it should be used, else None; raises only when backend="triton" cannot be."""
    forced = backend == "triton"
    if hidden.device.type != "cuda":
        if forced:
            raise ValueError(
                f"backend='triton' needs CUDA tensors, got hidden on device {hidden.device}; "
                "use backend='chunked' (or 'auto') on this device"
            )
        return None
    if not forced and hidden.dtype == torch.float64:
        return None  # the kernel targets fp32/bf16/fp16; fp64 (gradcheck) stays on the exact chunked path
    try:
        from logitless.ops import triton_op
    except ImportError as exc:
        if forced:
            raise RuntimeError(f"backend='triton' requested but the Triton kernel cannot be imported: {exc}") from exc
        return None
    if not triton_op.triton_available(hidden.device):
        if forced:
            raise RuntimeError(
                f"backend='triton' requested but Triton is not available on {hidden.device}; use backend='chunked'"
            )
        return None
    return triton_op.triton_token_logprobs


def _validate_hint(grad_hint, hidden) -> None:
    if grad_hint is None:
        return
    if not isinstance(grad_hint, torch.Tensor):
        raise TypeError(f"grad_hint must be a torch.Tensor [N] or None, got {type(grad_hint).__name__}")
    if tuple(grad_hint.shape) != (hidden.shape[0],):
        raise ValueError(
            f"grad_hint shape {tuple(grad_hint.shape)} must be [N] = [{hidden.shape[0]}] (one value per token, "
            "in the order of targets)"
        )
    if not grad_hint.is_floating_point():
        raise TypeError(f"grad_hint must be a floating tensor (d loss / d logp), got {grad_hint.dtype}")
    if grad_hint.device != hidden.device:
        raise ValueError(f"grad_hint is on {grad_hint.device} but hidden is on {hidden.device}; move it there")
    if grad_hint.requires_grad:
        raise ValueError("grad_hint must not require grad; pass grad_hint.detach()")


def _validate(hidden, weight, targets, bias, temperature, with_entropy, chunk_size, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}; flatten batch dims first")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H] (the lm_head weight), got shape {tuple(weight.shape)}")
    if targets.dim() != 1:
        raise ValueError(f"targets must be 1-D [N], got shape {tuple(targets.shape)}; flatten batch dims first")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must have a floating dtype in {_FLOAT_DTYPES}, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}; cast one of them (e.g. "
            f"hidden.to(weight.dtype))"
        )
    if targets.dtype == torch.bool or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor (int64/int32) of token ids, got {targets.dtype}")
    n, h = hidden.shape
    v = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not match hidden shape {tuple(hidden.shape)}: "
            f"expected weight [V, {h}] (pass the lm_head weight, not its transpose)"
        )
    if targets.shape[0] != n:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must be [N] = [{n}] to match hidden {tuple(hidden.shape)}"
        )
    if v == 0:
        raise ValueError(f"weight must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("targets", targets)):
        if t.device != hidden.device:
            raise ValueError(
                f"{name} is on {t.device} but hidden is on {hidden.device}; move all inputs to one device"
            )
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (v,):
            raise ValueError(
                f"bias shape {tuple(bias.shape)} must be [V] = [{v}] to match weight {tuple(weight.shape)}"
            )
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match weight dtype {weight.dtype}")
        if bias.device != hidden.device:
            raise ValueError(
                f"bias is on {bias.device} but hidden is on {hidden.device}; move all inputs to one device"
            )
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a positive float, got {temperature!r} ({type(temperature).__name__})")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(with_entropy, bool):
        raise TypeError(f"with_entropy must be a bool, got {with_entropy!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    if n > 0:
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one reduction, one device sync
        if lo < 0 or hi >= v:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"targets must be token ids in [0, V) = [0, {v}), got a value {bad} (min {lo}, max {hi}); "
                "mask or replace padding ids before calling"
            )
