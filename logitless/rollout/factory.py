"""`make_engine`: the one place that knows every rollout backend. The backends import shared helpers from
`engine.py`; only this module imports the backends, so there is no import circle."""

from __future__ import annotations

from typing import Any

from .types import RolloutEngine

BACKENDS = ("hf", "static", "continuous")


def make_engine(backend: str, model: Any, tokenizer: Any, **kwargs: Any) -> RolloutEngine:
    """Build a sampler: "hf" (transformers `generate`, optional static cache + compile), "static" (our decode
    loop: shared prefill, static KV cache, CUDA-graph decode step; the fast one on GPU) or "continuous"
    (transformers continuous batching / paged attention). Extra kwargs go to the backend's constructor."""
    if backend == "hf":
        from .hf import HFEngine

        return HFEngine(model, tokenizer, **kwargs)
    if backend == "static":
        from .static import StaticEngine

        return StaticEngine(model, tokenizer, **kwargs)
    if backend == "continuous":
        from .continuous import ContinuousEngine

        return ContinuousEngine(model, tokenizer, **kwargs)
    raise ValueError(f"make_engine(backend={backend!r}): unknown backend; use one of {BACKENDS}")
