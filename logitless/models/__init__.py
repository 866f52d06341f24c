"""Model plumbing: final hidden states without logits, the lm_head, and completion logprobs via the fused op."""

from logitless.models.lm_head import (
    LMHead,
    UnsupportedModelError,
    causal_lm_of,
    decoder_body,
    final_hidden_states,
    lm_head_of,
    position_ids_from_mask,
)
from logitless.models.logprobs import completion_logprobs, gather_positions, scatter_positions

__all__ = [
    "LMHead",
    "UnsupportedModelError",
    "causal_lm_of",
    "completion_logprobs",
    "decoder_body",
    "final_hidden_states",
    "gather_positions",
    "lm_head_of",
    "position_ids_from_mask",
    "scatter_positions",
]
