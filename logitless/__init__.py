"""logitless: memory-efficient, fast GRPO-family RL fine-tuning of language models."""

__version__ = "0.1.0"
