"""logitless: memory-efficient, fast GRPO-family RL fine-tuning of language models."""

from logitless.ops import token_logprobs

__version__ = "0.1.0"

__all__ = ["token_logprobs", "__version__"]
