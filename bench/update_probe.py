"""The update-only probe of bench/bench_e2e.py (`--update-only`) and the model shapes of other families.

An update-only probe runs the trainer's real step (`logitless.trainer.train`: settings decided, model loaded and
prepared, micro-batches planned, logprobs, loss, backward, clipping, AdamW) on completions that are given instead
of decoded: the rollout engine is replaced by `GivenCompletions`, which returns `--prompt-tokens` random prompt
tokens and T random completion tokens per sample at once. So the update's peak memory and time at a long T are
measured in minutes where decoding T tokens first would take hours. Its results say `"probe": "update-only"`;
the phases of a step other than the update (generate, score) do not describe a real rollout there.

The rewards are a hash of each completion's text (`text_hash`): distinct random completions get distinct rewards,
so every advantage is non-zero and the whole update runs. `--one-long-row` gives only the first sample of each
prompt T tokens and the group's others a single token, so one T-token row is updated per prompt (what a 10-minute
command holds at 128K and 8B).

Shapes of other families (`FAMILY_SHAPES`), random init like bench_e2e's Qwen2.5 shapes: Qwen3-8B and Llama-3.1-8B,
with their positions raised to `LONG_POSITIONS` so that a long probe passes the context check (a random model needs
no RoPE scaling); the mixtures of experts Qwen3-30B-A3B (128 experts, 8 per token), gpt-oss-20b (32, 4; bf16
weights, not the published MXFP4) and OLMoE-1B-7B (64, 8), as published; and a tiny Qwen3 and Qwen3-MoE for CPU runs.
"""

from __future__ import annotations

import importlib.util
import math
import time
import zlib
from typing import Any, Sequence

import torch

LONG_POSITIONS = 262_144
FAMILY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {  # name: (model_type, config fields)
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12_288, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151_936, tie_word_embeddings=False,
                               rope_theta=1_000_000.0, max_position_embeddings=LONG_POSITIONS)),
    "llama3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128_256,
                                  tie_word_embeddings=False, rope_theta=500_000.0, bos_token_id=128_000,
                                  eos_token_id=128_001, max_position_embeddings=LONG_POSITIONS)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=151_936, tie_word_embeddings=True,
                                 max_position_embeddings=LONG_POSITIONS)),
    # mixtures of experts, as their published config.json files give them (positions and RoPE as published)
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151_936,
                                        tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                                        max_position_embeddings=40_960, bos_token_id=151_643,
                                        eos_token_id=151_645)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"] * 12, vocab_size=201_088,
                                    tie_word_embeddings=False, max_position_embeddings=131_072, rms_norm_eps=1e-5,
                                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150_000.0,
                                                     "original_max_position_embeddings": 4096},
                                    eos_token_id=200_002, pad_token_id=199_999)),
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                  num_experts_per_tok=8, norm_topk_prob=False, vocab_size=50_304,
                                  tie_word_embeddings=False, rope_theta=10_000.0, rms_norm_eps=1e-5,
                                  max_position_embeddings=4096, eos_token_id=50_279, pad_token_id=1)),
    "tiny-qwen3-moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=8, num_experts_per_tok=2, vocab_size=151_936,
                                         tie_word_embeddings=True, max_position_embeddings=LONG_POSITIONS)),
}


CONFIG = {  # what an update-only probe's results say instead of the full step's rollout, reward and data
    "backend": "none: completions given (update_probe.GivenCompletions)", "reward": "text_hash",
    "data": "random prompt and completion tokens",
}


def family_config(shape: str, tokenizer_size: int, any_tokenizer: bool = False) -> Any:
    """The transformers config of FAMILY_SHAPES[shape]. Raises SystemExit when the tokenizer has more tokens than the
    shape's vocabulary (a Llama shape needs a Llama tokenizer), unless `any_tokenizer`: an update-only probe feeds
    the model random ids below its vocabulary size, so any tokenizer serves it."""
    from transformers import AutoConfig

    model_type, fields = FAMILY_SHAPES[shape]
    if tokenizer_size > fields["vocab_size"] and not any_tokenizer:
        raise SystemExit(f"--shape {shape} has a vocabulary of {fields['vocab_size']:,} tokens, the tokenizer "
                         f"{tokenizer_size:,}: give --tokenizer a tokenizer of that family (or probe the update "
                         "alone: --update-only feeds the model random ids of its own vocabulary)")
    return AutoConfig.for_model(model_type, **fields)


def check_qlora() -> None:
    """Raise SystemExit unless QLoRA (bitsandbytes' 4-bit weights) can run here: a CUDA GPU and bitsandbytes."""
    if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
        have = "no CUDA GPU" if not torch.cuda.is_available() else "bitsandbytes is not installed"
        raise SystemExit(f"--qlora (model.load_in_4bit=true) needs bitsandbytes and a CUDA GPU: {have} here. "
                         "Drop --qlora, or run on a GPU with bitsandbytes installed")


def refusal(a: Any) -> str | None:
    """Why bench_e2e's arguments `a` ask for what the probes cannot run (None when they can); SystemExit for --qlora
    where bitsandbytes or CUDA is missing."""
    if a.full and a.qlora:
        return "--full and --qlora: QLoRA trains LoRA adapters on 4-bit weights; pick one"
    if a.qlora:
        check_qlora()
    others = [s for s in a.systems.split(",") if s != "logitless"]
    if a.qlora and others:
        return f"--qlora is logitless's model.load_in_4bit; the TRL runs train bf16 LoRA: drop {','.join(others)}"
    if a.update_only and others:
        return f"--update-only runs logitless's update on given completions; drop {','.join(others)} from --systems"
    if a.update_only and a.turns > 1:
        return "--update-only gives single-turn completions; drop --turns"
    if a.update_only and a.prompt_tokens < 1:
        return f"--prompt-tokens={a.prompt_tokens}: give at least 1"
    if a.one_long_row and not a.update_only:
        return "--one-long-row shapes the given completions of --update-only; add --update-only"
    return None


def text_hash(prompts: list[Any], completions: list[Any], **row_fields: Any) -> list[float]:
    """A reward in [0, 1) that differs between different completions (CRC-32 of the text): non-zero advantages
    for random completions, whose other rewards (e.g. distinct characters) saturate at long T."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [zlib.crc32(t.encode()) / 2**32 for t in texts]


class GivenCompletions:
    """A rollout engine that decodes nothing (`logitless.rollout.RolloutEngine`): for each of the n prompts,
    `prompt_tokens` random tokens (the prompts' text is not used), and for each of its G samples `completion_tokens`
    random tokens (with `one_long_row`: the first sample of each prompt, the others one token), drawn uniformly from
    the tokenizer's ids with the call's seed, all counted as finished (none truncated). Their sampler logprobs are
    those of the uniform distribution over the model's vocabulary, about what a random-init model gives."""

    def __init__(self, tokenizer: Any, vocab_size: int, prompt_tokens: int, completion_tokens: int,
                 one_long_row: bool = False) -> None:
        if prompt_tokens < 1 or completion_tokens < 1:
            raise ValueError(f"GivenCompletions: prompt_tokens={prompt_tokens} and completion_tokens="
                             f"{completion_tokens} must both be >= 1")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.prompt_tokens, self.completion_tokens, self.one_long_row = prompt_tokens, completion_tokens, one_long_row

    def generate(self, prompts: Sequence[Any], options: Any, episodes: Any = None) -> Any:
        from logitless.rollout.types import RolloutBatch, RolloutTiming

        if episodes is not None:
            raise ValueError("the update-only probe gives single-turn completions; drop --turns")
        t0 = time.perf_counter()
        n, G = len(prompts), options.num_generations
        B, P, T = n * G, self.prompt_tokens, self.completion_tokens
        g = torch.Generator().manual_seed(options.seed if options.seed is not None else 0)
        ids = min(self.vocab_size, len(self.tokenizer))  # ids of the model that the tokenizer can decode
        prompt_ids = torch.randint(0, ids, (n, P), generator=g).repeat_interleave(G, 0)  # [B, P]
        completion_ids = torch.randint(0, ids, (B, T), generator=g)  # [B, T]
        lengths = torch.full((B,), T, dtype=torch.long)
        if self.one_long_row:
            lengths[torch.arange(B) % G != 0] = 1
        completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [B, T] right-padded
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
        sampler_logp = torch.full((B, T), -math.log(self.vocab_size)) * completion_mask  # [B, T], 0 at padding
        texts = self.tokenizer.batch_decode([row[:k] for row, k in zip(completion_ids.tolist(), lengths.tolist())],
                                            skip_special_tokens=True)
        seconds = time.perf_counter() - t0
        tokens = int(lengths.sum())
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
            completion_mask=completion_mask, sampler_logp=sampler_logp, finished=torch.ones(B, dtype=torch.bool),
            truncated=torch.zeros(B, dtype=torch.bool), prompt_index=torch.arange(n).repeat_interleave(G),
            completions=texts, timing=RolloutTiming(seconds, tokens, tokens / max(seconds, 1e-9), seconds))


def install(prompt_tokens: int, completion_tokens: int, one_long_row: bool) -> None:
    """Make the trainer build `GivenCompletions` instead of its rollout engine (in this worker process)."""
    from logitless.trainer.placement import placement

    def given(rollout_cfg: Any, model: Any, tokenizer: Any, *choice: Any) -> GivenCompletions:
        vocab = model.get_input_embeddings().weight.shape[0]
        return GivenCompletions(tokenizer, vocab, prompt_tokens, completion_tokens, one_long_row)

    placement.make_rollout_engine = given


def settings(prompt_tokens: int) -> list[str]:
    """The trainer settings of an update-only probe (before the user's --set): the rewards that keep every advantage
    non-zero, a prompt limit that holds the given prompts and the task's own (the data is still checked), and no
    sampler-mismatch warning (the given logprobs are the uniform distribution's, not a sampler's)."""
    return ["reward.reward_funcs=[bench.update_probe:text_hash]", "rollout.backend=hf",
            f"rollout.max_prompt_length={max(prompt_tokens, 512)}", "logging.mismatch_warning=null"]
