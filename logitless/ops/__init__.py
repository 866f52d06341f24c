"""Fused ops: hidden states -> per-token log-probabilities (and entropy). They know nothing of GRPO."""

from logitless.ops.reference import token_logprobs_reference
from logitless.ops.token_logprobs import token_logprobs

__all__ = ["token_logprobs", "token_logprobs_reference"]
