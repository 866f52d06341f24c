"""Rollout data types: sampling options, the rollout batch, and the engine protocol.

Which distribution `sampler_logp` holds
---------------------------------------
`sampler_logp[b, t] = log_softmax(raw_logits / T)[token]`, where `raw_logits` are the model's logits at that
step in float32 and `T` is the temperature (`T = 1` when `temperature == 0`, i.e. greedy). It is taken AFTER
temperature but BEFORE repetition penalty and before top-k / top-p / min-p filtering. This is exactly the
distribution the trainer's fused op computes from the same weights (`log_softmax(h·Wᵀ / T)`), so the
importance ratio `exp(logp_train - sampler_logp)` is 1 when the weights match and only measures
policy/sampler mismatch (numerics, stale weights), not the truncation of the filters. With filters on, the
token was actually drawn from the filtered distribution; the ratio then ignores the filters, as TRL, verl and
OpenRLHF do when they recompute old logprobs with the training model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, Union, runtime_checkable

import torch

from logitless.models.vision import ImageInputs

Prompt = Union[str, list]  # raw text, chat messages [{"role": ..., "content": ...}, ...], or token ids [int, ...]


@dataclass
class SamplingOptions:
    """How to sample `num_generations` completions per prompt."""

    num_generations: int = 8  # G, samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus; 1.0 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off (CTRL-style, as transformers)
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings; kept at the end of the completion
    eos_token_ids: list[int] | None = None  # None: from the model's generation config, else the tokenizer
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    seed: int | None = None  # same seed + same inputs + same device = same completions
    # The prompts of several calls decoded as one (the `static` engine only): [(seed, prompts), ...] in order, and
    # each part's rows draw from the random streams its own call with that seed would (prompt indices counted from
    # the part's first prompt), so each part's samples are that call's. None: one part, `seed`.
    streams: list[tuple[int, int]] | None = None
    max_prompt_length: int | None = None  # tokens; None: context window - max_new_tokens
    truncate_prompt: bool = False  # left-truncate over-long prompts instead of raising
    # extra keyword arguments of the tokenizer's apply_chat_template for chat prompts (e.g. enable_thinking=False)
    chat_template_kwargs: dict[str, Any] | None = None

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the bad field, its value and the fix."""

        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"SamplingOptions.{name}={getattr(self, name)!r} is invalid: {fix}")

        if not isinstance(self.num_generations, int) or isinstance(self.num_generations, bool):
            raise TypeError(f"SamplingOptions.num_generations must be an int, got {self.num_generations!r}")
        if self.num_generations < 1:
            raise bad("num_generations", "use G >= 1 samples per prompt")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "use a finite temperature >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "use 0 < top_p <= 1 (1 disables nucleus filtering)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "use an int >= 0 (0 disables top-k)")
        if not (0.0 <= self.min_p < 1.0):
            raise bad("min_p", "use 0 <= min_p < 1 (0 disables min-p)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise bad("repetition_penalty", "use a positive value (1.0 disables it)")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise TypeError(f"SamplingOptions.max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "use max_new_tokens >= 1")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", 'pass a list of non-empty strings, e.g. stop=["</answer>"]')
        if self.eos_token_ids is not None:
            if isinstance(self.eos_token_ids, int) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.eos_token_ids
            ):
                raise bad("eos_token_ids", "pass a list of non-negative token ids, or None for the model's")
        if self.streams is not None and not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 for x in p) and p[1] >= 0 for p in self.streams
        ):
            raise bad("streams", "pass a list of (seed, number of prompts) pairs of ints, or None")
        if self.max_prompt_length is not None and (
            not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1
        ):
            raise bad("max_prompt_length", "use a positive int or None")

    @property
    def logp_temperature(self) -> float:
        """Temperature of the recorded logprobs (1.0 for greedy)."""
        return float(self.temperature) if self.temperature > 0 else 1.0


@dataclass
class RolloutTiming:
    seconds: float  # wall time of the generate call, tokenization and post-processing included
    num_tokens: int  # completion tokens under completion_mask
    tokens_per_s: float  # num_tokens / seconds
    generate_seconds: float = 0.0  # model time only (prefill + decode), synchronized
    parts: dict[str, float] = field(default_factory=dict)  # seconds per part of decoding (engines that profile)


@dataclass
class RolloutBatch:
    """B = num_prompts * G rows; row i*G + g is sample g of prompt i. Tensors are on the CPU (`.to(device)`)."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded with the pad id
    prompt_mask: torch.Tensor  # [B, P] long, 1 on prompt tokens
    completion_ids: torch.Tensor  # [B, T] long, right-padded with the pad id
    completion_mask: torch.Tensor  # [B, T] long, 1 up to and including EOS / the stop-string token
    sampler_logp: torch.Tensor  # [B, T] fp32, log_softmax(raw_logits / T)[token]; 0 at padding
    finished: torch.Tensor  # [B] bool, ended by EOS or a stop string
    truncated: torch.Tensor  # [B] bool, hit max_new_tokens without finishing
    prompt_index: torch.Tensor  # [B] long, which prompt each row samples
    completions: list[str]  # decoded completion texts (special tokens skipped; cut after a stop string)
    timing: RolloutTiming
    # Multi-turn episodes (`episodes.py`); None for single-turn rollouts.
    env_mask: torch.Tensor | None = None  # [B, T] long, 1 on completion tokens the driver wrote (never trained)
    episodes: list | None = None  # [B] `episodes.EpisodeRecord` of each row
    # Mixture-of-experts routes (engines built with record_routes; `models/routing.py`): the experts each token was
    # routed to in each MoE layer, uint8 (int16 beyond 255 experts), the sentinel (255 / -1) where none was recorded
    # (padding, a row's last token, which is never fed forward). Aligned to prompt_ids and completion_ids.
    prompt_routes: torch.Tensor | None = None  # [B, P, layers, k]
    completion_routes: torch.Tensor | None = None  # [B, T, layers, k]
    # A vision-language model's image tensors of each row (the processor's, shared by a prompt's G rows), in sequence
    # order: the prompt's, then (episodes) its observations'. The image placeholders are prompt or observation tokens,
    # so images are context only. None: no row has images.
    images: ImageInputs | None = None

    def loss_mask(self) -> torch.Tensor:
        """[B, T] long: the completion tokens the model wrote (all of completion_mask without episodes)."""
        if self.env_mask is None:
            return self.completion_mask
        return self.completion_mask * (1 - self.env_mask)

    @property
    def num_generations(self) -> int:
        n = int(self.prompt_index.max().item()) + 1 if self.prompt_index.numel() else 1
        return self.prompt_index.numel() // n

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {
            k: (v.to(device) if isinstance(v, (torch.Tensor, ImageInputs)) else v) for k, v in self.__dict__.items()
        }
        return RolloutBatch(**moved)


@runtime_checkable
class RolloutEngine(Protocol):
    """A sampler. A new backend (vLLM, SGLang, ...) implements this one method; the trainer sees nothing else.

    `episodes`: an `episodes.EpisodeDriver` that answers the model between turns (multi-turn episodes); engines
    that cannot run episodes raise ValueError naming `rollout.backend` when one is given."""

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions, episodes: Any = None) -> RolloutBatch: ...
