"""Where a step goes: wall time and peak memory per phase, the rollout's share of the memory-bandwidth ceiling,
and the update's model-FLOP utilization (MFU).

Definitions (the same in the trainer's metrics and in `bench/bench_e2e.py`):

- **Rollout ceiling.** Decoding is bound by memory bandwidth. One decode step of an ideal engine reads every weight
  once (those of the module the engine decodes with: bf16, also for a QLoRA model decoding from a merged bf16 copy;
  the input embedding only when it is tied to the lm_head, since a decode step reads just B of its rows) and the
  live KV cache once: for each row still generating at decode step s, `(prompt_len + s) * kv_bytes_per_token`, with
  `kv_bytes_per_token = layers * 2 * kv_heads * head_dim * 2` (bf16 K and V; a sliding-window layer holds at most
  `window` positions). The ideal time is the sum over decode steps of those bytes divided by the HBM bandwidth;
  `rollout/ceiling_fraction` = ideal time / the rollout call's own wall time (with `train.async_rollout` the
  generate phase is only the wait for it). Prefill is not counted as ideal time (it is compute-bound and small), so
  the fraction is a slight under-estimate of decode efficiency.
- **MFU.** FLOPs the update needs, counted once (recompute from gradient checkpointing not counted): per token,
  `2 * N` forward for the decoder's linear layers (every token; of a mixture of experts' stacks the k of E
  experts a token runs, k / E of them) and the lm_head (completion tokens only: the
  fused op skips prompt positions), plus attention `4 * layers * d_attn * ctx` (QK^T and PV over the causal
  context); backward is `2 *` forward for trainable weights (input and weight
  gradients) and `1 *` forward for frozen ones (input gradients only), so LoRA counts `4 * N` and full
  fine-tuning `6 * N`; attention backward is `2 *` its forward. `train/mfu` = FLOPs / update seconds / peak.
- **Peaks.** `device_peaks` knows the datasheet numbers of common GPUs (dense bf16 FLOP/s, HBM bytes/s);
  `logging.peak_tflops` and `logging.hbm_tbs` override them. Without them (CPU, unknown GPU) both ratios are NaN.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from logitless.models.experts import QUANTIZED, expert_modules, moe_shape
from logitless.rollout import sleep

# Datasheet peaks: dense bf16 FLOP/s, HBM bytes/s (SXM parts). Matched as substrings of the device name.
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100 PCIe": (756e12, 2.0e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
    "L40S": (362e12, 0.864e12),
    "A10G": (125e12, 0.6e12),
    "4090": (165e12, 1.0e12),
}


def device_peaks(device: torch.device, peak_tflops: float | None = None, hbm_tbs: float | None = None) -> tuple[float, float]:
    """(peak dense bf16 FLOP/s, HBM bytes/s) of `device`; NaN where unknown (CPU, an unlisted GPU)."""
    flops, bw = math.nan, math.nan
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (f, b) in DEVICE_PEAKS.items():
            if key in name:
                flops, bw = f, b
                break
    return (peak_tflops * 1e12 if peak_tflops else flops), (hbm_tbs * 1e12 if hbm_tbs else bw)


@dataclass(frozen=True)
class ModelShape:
    """What the accounting needs to know of a decoder-only transformer."""

    layers: int
    kv_bytes_per_token: int  # bf16 K and V of one position over all layers
    d_attn: int  # num_heads * head_dim
    decode_weight_bytes: int  # bf16 bytes one decode step reads (tied embedding once, untied input embedding not)
    body_params: int  # parameters of the decoder's linear layers (run for every token)
    body_trainable: int  # of those, trainable (LoRA: the base is frozen)
    head_params: int  # lm_head (run for completion tokens only: the fused op skips prompt positions)
    head_trainable: int
    lora_params: int  # adapter parameters (counted as trainable body parameters)
    sliding_window: int | None = None
    sliding_layers: int = 0  # layers that only attend within `sliding_window`

    @staticmethod
    def of(model: torch.nn.Module) -> ModelShape:
        """Read the shape of a (possibly PEFT-wrapped) Hugging Face causal LM."""
        base = model
        while hasattr(base, "get_base_model"):
            base = base.get_base_model()
        cfg = base.config.get_text_config(decoder=True) if hasattr(base.config, "get_text_config") else base.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        layers = cfg.num_hidden_layers
        emb = base.get_input_embeddings().weight
        out = base.get_output_embeddings()
        head = out.weight if out is not None else emb
        moe = moe_shape(cfg)
        body = body_trainable = lora = weight_bytes = 0
        for name, p in base.named_parameters():  # a tied weight is listed once
            if "lora_" in name:
                lora += p.numel()
                continue
            if p is emb and p is not head:
                continue  # an untied input embedding: a lookup, read B rows per decode step
            shape = _logical_shape(p)
            n = math.prod(shape)
            weight_bytes += p.numel() * p.element_size() if shape != p.shape else n * 2
            if len(shape) == 3 and moe is not None:  # a fused expert stack: each token runs k of its E experts
                n = n * moe.active // moe.experts
            if len(shape) in (2, 3) and p is not head:
                body += n
                body_trainable += n if p.requires_grad else 0
        for _, experts in expert_modules(base):  # 4-bit stacks (buffers; models/nf4_experts.py): frozen, read dequantized
            for meta in getattr(experts, QUANTIZED, {}).values():
                n = math.prod(meta.shape)
                weight_bytes += n * 2
                body += n * moe.active // moe.experts if moe is not None else n
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        types = getattr(cfg, "layer_types", None) or []
        sliding = sum(t == "sliding_attention" for t in types) if types else (layers if window else 0)
        return ModelShape(
            layers=layers, kv_bytes_per_token=layers * 2 * kv_heads * head_dim * 2, d_attn=heads * head_dim,
            decode_weight_bytes=weight_bytes, body_params=body, body_trainable=body_trainable,
            head_params=head.numel(), head_trainable=head.numel() if head.requires_grad else 0,
            lora_params=lora, sliding_window=window if sliding else None, sliding_layers=sliding,
        )


def _logical_shape(p: torch.Tensor) -> torch.Size:
    """The weight's own shape; a bitsandbytes 4-bit weight (QLoRA) stores it packed and keeps it in quant_state."""
    quant = getattr(p, "quant_state", None)
    return torch.Size(quant.shape) if quant is not None and getattr(quant, "shape", None) is not None else p.shape


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo+1) + ... + (hi-1); 0 when hi <= lo."""
    return (hi - lo) * (lo + hi - 1) // 2 if hi > lo else 0


def decode_ideal_seconds(shape: ModelShape, prompt_lens: list[int], completion_lens: list[int], hbm_bytes_per_s: float) -> float:
    """Seconds an ideal bandwidth-bound engine needs to decode these rows (see the module docstring).

    Row i is live for decode steps s < t_i with context p_i + s, so it reads Σ_s (p_i + s) KV positions of a
    full-attention layer and Σ_s min(p_i + s, window) of a sliding one; the weights are read once per step.
    """
    if not completion_lens or not math.isfinite(hbm_bytes_per_s):
        return math.nan
    per_layer = shape.kv_bytes_per_token / shape.layers
    full_positions = sum(_sum_range(p, p + t) for p, t in zip(prompt_lens, completion_lens))
    kv = (shape.layers - shape.sliding_layers) * per_layer * full_positions
    if shape.sliding_layers:
        w = shape.sliding_window or 0
        slid = sum(_sum_range(p, min(p + t, w)) + w * max(0, p + t - max(p, w)) for p, t in zip(prompt_lens, completion_lens))
        kv += shape.sliding_layers * per_layer * slid
    return (max(completion_lens) * shape.decode_weight_bytes + kv) / hbm_bytes_per_s


def _linear_flops(params: int, trainable: int, tokens: int) -> float:
    """Forward 2/param/token; backward 2 for input gradients, +2 for weight gradients of trainable params."""
    return tokens * (4 * (params - trainable) + 6 * trainable)


def update_flops(shape: ModelShape, seq_lens: list[tuple[int, int]], head_lens: list[int] | None = None) -> float:
    """FLOPs of one forward + backward over sequences given as (prompt_len, completion_len), counted once.
    head_lens: the tokens of each sequence that go through the lm_head (multi-turn episodes: the model's; default:
    the whole completion)."""
    tokens = sum(p + t for p, t in seq_lens)
    completion = sum(t for _, t in seq_lens) if head_lens is None else sum(head_lens)
    body = _linear_flops(shape.body_params + shape.lora_params, shape.body_trainable + shape.lora_params, tokens)
    head = _linear_flops(shape.head_params, shape.head_trainable, completion)
    attn_fwd = sum(4 * shape.layers * shape.d_attn * (n * (n + 1) / 2) for n in (p + t for p, t in seq_lens))
    return body + head + 3 * attn_fwd


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class PhaseTimer:
    """Wall time and peak memory of each phase of one step: `with timer("generate"): ...`.

    On CUDA the peak is the allocator's peak inside the phase (reset at its start) plus the most bytes of sleepable
    weight memory (`rollout/sleep.py`, outside the allocator) mapped during it; on CPU it is the process's
    resident-set high-water mark so far (it cannot be reset). Phases end with a device sync, so each time
    includes the GPU work the phase queued.
    """

    device: torch.device
    rollout_device: torch.device | None = None  # the rollout's own GPU (rollout.device): its peak over the step
    seconds: dict[str, float] = field(default_factory=dict)
    peak_gb: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rollout_device is not None and self.rollout_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.rollout_device)  # not synced: an async rollout may be running

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        cuda = self.device.type == "cuda"
        _sync(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            sleep.reset_mapped_peak()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            peak = (
                (torch.cuda.max_memory_allocated(self.device) + sleep.mapped_peak()) / 2**30
                if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
            )
            self.peak_gb[phase] = max(self.peak_gb.get(phase, 0.0), peak)

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"time/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/peak_gb/{k}": v for k, v in self.peak_gb.items()})
        out["memory/peak_gb"] = max(self.peak_gb.values(), default=0.0)
        if self.rollout_device is not None and self.rollout_device.type == "cuda":
            out["memory/rollout_device_peak_gb"] = torch.cuda.max_memory_allocated(self.rollout_device) / 2**30
        return out
