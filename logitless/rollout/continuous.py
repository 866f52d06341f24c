"""Backend "continuous": transformers' continuous batching (paged KV cache, `model.generate_batch`).

transformers returns log(softmax(processed scores))[token], i.e. the logprob AFTER its logits processors. With only
temperature active that is exactly log_softmax(raw / T), the distribution documented in `types.py`; with
top-k / top-p / min-p / repetition penalty it would be the filtered one, so those options are refused here
(use backend "hf"). Stop strings are applied after generation (the sequence runs on to EOS / max_new_tokens).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from .engine import build_batch, generation_mode, prepare_prompts, refuse_streams, seeded, sync, unwrap_model
from .layouts import FULL, SLIDING, check_layout
from .vision import refuse_vision
from .types import Prompt, RolloutBatch, SamplingOptions


class ContinuousEngine:
    """Sampling with `model.generate_batch`. `cb_kwargs` are ContinuousBatchingConfig fields (block_size,
    num_blocks, max_batch_tokens, max_memory_percent, use_cuda_graph, default_compile_level, ...); on CPU small
    explicit sizes are needed (the automatic sizing is slow there). Each prompt is sent G times; the paged cache
    shares its prompt blocks (allow_block_sharing)."""

    def __init__(self, model: Any, tokenizer: Any, **cb_kwargs: Any):
        fields = set(ContinuousBatchingConfig.__dataclass_fields__)
        unknown = sorted(set(cb_kwargs) - fields)
        if unknown:
            raise TypeError(f"ContinuousEngine: unknown ContinuousBatchingConfig fields {unknown}")
        if "return_logprobs" in cb_kwargs or "seed" in cb_kwargs:
            raise TypeError("ContinuousEngine: return_logprobs and seed are set by the engine (SamplingOptions.seed)")
        refuse_vision(unwrap_model(model), "continuous")
        check_layout(unwrap_model(model), "continuous", (FULL, SLIDING))  # its paged cache has no chunked layers
        self.model = model
        self.tokenizer = tokenizer
        self.cb_kwargs = cb_kwargs

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions, episodes: Any = None) -> RolloutBatch:
        if episodes is not None:
            raise ValueError("rollout.backend=continuous cannot run multi-turn episodes (agent.*): use "
                             "rollout.backend=static (fastest on GPU) or hf")
        refuse_streams(options, "continuous")
        for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0)):
            if getattr(options, name) != off:
                raise ValueError(
                    f"SamplingOptions.{name}={getattr(options, name)!r} is not supported by backend 'continuous': "
                    "transformers would return logprobs of the filtered distribution; use backend 'hf' or "
                    f"{name}={off!r}"
                )
        prep = prepare_prompts(self.model, self.tokenizer, prompts, options)
        pad_id, eos_ids, device, enc = prep.pad_id, prep.eos_ids, prep.device, prep.encoded
        G = options.num_generations
        cfg = GenerationConfig(
            do_sample=options.temperature > 0,
            temperature=options.temperature if options.temperature > 0 else 1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=options.max_new_tokens,
            eos_token_id=-1 if options.ignore_eos else eos_ids,
            pad_token_id=pad_id,
        )
        cb_cfg = ContinuousBatchingConfig(return_logprobs=True, seed=options.seed, **self.cb_kwargs)
        inputs = [ids for ids in enc for _ in range(G)]  # row i*G + g
        with generation_mode(self.model), seeded(options.seed, device):
            sync(device)
            tg = time.perf_counter()
            results = self.model.generate_batch(inputs, generation_config=cfg, continuous_batching_config=cb_cfg)
            sync(device)
            gen_s = time.perf_counter() - tg
        outs = list(results.values())  # in input order
        bad = [o.request_id for o in outs if o.error is not None]
        if len(outs) != len(inputs) or bad:
            raise RuntimeError(f"continuous batching returned {len(outs)}/{len(inputs)} results; failed: {bad[:5]}")
        B, S = len(outs), max(max(len(o.generated_tokens) for o in outs), 1)
        raw_ids = torch.full((B, S), pad_id, dtype=torch.long)
        raw_logp = torch.zeros((B, S), dtype=torch.float32)
        raw_len = torch.zeros(B, dtype=torch.long)
        for b, o in enumerate(outs):
            n = len(o.generated_tokens)
            raw_len[b] = n
            raw_ids[b, :n] = torch.tensor(o.generated_tokens, dtype=torch.long)
            if len(o.logprobs) != n:
                raise RuntimeError(f"request {o.request_id}: {len(o.logprobs)} logprobs for {n} tokens")
            raw_logp[b, :n] = torch.tensor(o.logprobs, dtype=torch.float32)
        return build_batch(self.tokenizer, prep, raw_ids, raw_logp, raw_len, gen_s)
