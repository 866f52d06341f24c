"""Rollout engines: G samples per prompt with the sampler's per-token logprobs (see `types.py` for which
distribution those are). `make_engine("hf" | "static" | "continuous", model, tokenizer)` returns a `RolloutEngine`."""

from __future__ import annotations

from .engine import generation_mode
from .factory import BACKENDS, make_engine
from .types import Prompt, RolloutBatch, RolloutEngine, RolloutTiming, SamplingOptions

__all__ = [
    "BACKENDS",
    "Prompt",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutTiming",
    "SamplingOptions",
    "generation_mode",
    "make_engine",
]
