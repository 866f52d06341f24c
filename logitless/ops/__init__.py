"""Fused ops: hidden states -> per-token log-probabilities (and entropy). They know nothing of GRPO."""

from logitless.ops.reference import token_logprobs_reference

__all__ = ["token_logprobs_reference"]
