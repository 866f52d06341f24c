"""Backend "hf": batched transformers `generate` (KV cache, left padding, optional static cache + torch.compile)
that also returns the sampler's per-token logprobs without storing [B, steps, V] scores."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from logitless.models import UnsupportedModelError, decoder_body
from logitless.models.vision import encode_once, image_forward_inputs
from logitless.models.routing import ForwardLog, MoERouting, recording, require_routing

from .attention import gqa_decode
from .engine import build_batch, generation_mode, prepare_prompts, refuse_streams, seeded, sync, unwrap_model
from .hf_turns import generate_episodes
from .layouts import CHUNKED, layer_types, text_config
from .types import Prompt, RolloutBatch, SamplingOptions
from .vision import BanPlaceholders, is_processor, placeholder_tokens, prompt_images, text_tokenizer


class LogprobRecorder(LogitsProcessor):
    """First processor of the list: sees the raw fp32 logits of every step and records
    log_softmax(raw / T)[token] of the token sampled at the previous step (which now ends `input_ids`).

    Keeps only the previous step's raw scores (a reference, [B, V]) and their logsumexp ([B]); the last
    step's token is gathered by `finish` from the returned sequences. Equivalent to:
        logp[:, t] = torch.log_softmax(scores_t / T, -1).gather(-1, tokens[:, t:t+1])
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self._prev: torch.Tensor | None = None  # [B, V] raw scores of the previous step
        self._prev_lse: torch.Tensor | None = None  # [B]
        self.steps: list[torch.Tensor] = []  # each [B] fp32

    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        picked = self._prev.gather(1, tokens[:, None]).squeeze(1).float()
        return picked / self.temperature - self._prev_lse

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prev is not None:
            self.steps.append(self._gather(input_ids[:, -1]))
        self._prev = scores
        self._prev_lse = torch.logsumexp(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] logprobs aligned with the S generated tokens; releases the stored scores."""
        if self._prev is not None and len(self.steps) < completion_ids.shape[1]:
            self.steps.append(self._gather(completion_ids[:, len(self.steps)]))
        self._prev = self._prev_lse = None
        if len(self.steps) != completion_ids.shape[1]:
            raise RuntimeError(
                f"LogprobRecorder saw {len(self.steps)} steps for {completion_ids.shape[1]} generated tokens"
            )
        if self.steps:
            out = torch.stack(self.steps, 1)
        else:
            out = completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
        self.steps = []
        return out


def sampling_processors(options: SamplingOptions) -> list[LogitsProcessor]:
    """transformers' own processors in generate's order: repetition penalty, temperature, top-k, top-p, min-p."""
    procs: list[LogitsProcessor] = []
    if options.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(options.repetition_penalty))
    if options.temperature > 0:
        if options.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(options.temperature))
        if options.top_k > 0:
            procs.append(TopKLogitsWarper(options.top_k))
        if options.top_p < 1.0:
            procs.append(TopPLogitsWarper(options.top_p))
        if options.min_p > 0.0:
            procs.append(MinPLogitsWarper(options.min_p))
    return procs


@contextlib.contextmanager
def _blank_generation_config(model: Any) -> Iterator[None]:
    """`generate` fills unset fields from `model.generation_config`; a blank one makes ours authoritative
    (e.g. eos_token_id=None really means no EOS)."""
    base = unwrap_model(model)
    saved = getattr(base, "generation_config", None)
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


class HFEngine:
    """Sampling with transformers `generate`.

    static_cache: preallocated KV cache; on CUDA `generate` then compiles the decode step (CUDA graphs) unless
        compile=False. The compiled graph is reused by later calls of the same shapes.
    fast_gqa: decode attention without expanding the KV cache to all query heads (`attention.py`).
    Prompts are tokenized once per prompt and the ids expanded G times (generate has no shared-prefix prefill).
    record_routes: record the experts of every token (`RolloutBatch.prompt_routes`/`completion_routes`; a
        mixture-of-experts model, `models/routing.py`) by the routers' hooks during `generate` itself, one entry per
        forward (the prefill, then one per step), so the routes are those the sampler used (a later forward of the
        whole sequence computes other shapes and may flip near-tied experts).
    tokenizer: a tokenizer, or a vision-language model's processor: chat prompts with images are then encoded by it
        and `generate` gets each row's image tensors and token types (M-RoPE positions are the model's own); the
        image placeholder tokens are never sampled (`vision.BanPlaceholders`), and `RolloutBatch.images` carries
        the tensors to the trainer.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        static_cache: bool = False,
        compile: bool | None = None,
        fast_gqa: bool = True,
        record_routes: bool = False,
    ):
        self.model = model
        self.fast_gqa = fast_gqa
        self.processor = tokenizer if is_processor(tokenizer) else None
        self.tokenizer = text_tokenizer(tokenizer)
        self.placeholders = placeholder_tokens(unwrap_model(model))
        self.static_cache = static_cache
        self.compile = static_cache if compile is None else compile
        self.routing = require_routing(unwrap_model(model), "model.routing_replay") if record_routes else None
        if self.compile and not static_cache:
            raise ValueError("HFEngine(compile=True) needs static_cache=True (only static caches are compiled)")
        cfg = text_config(unwrap_model(model))
        if static_cache and CHUNKED in layer_types(cfg):
            raise UnsupportedModelError(
                f"HFEngine(static_cache=True) cannot run model_type {cfg.model_type!r}: transformers' static-cache "
                "generate fails on chunked-attention layers. Use static_cache=False, or rollout.backend=static"
            )

    def generation_config(self, options: SamplingOptions, max_new_tokens: int, pad_id: int,
                          eos_ids: list[int] | None, stops: list[str] | None) -> GenerationConfig:
        """`generate`'s config: sampling (the processors of `sampling_processors` do the transforms), lengths,
        special tokens and the cache."""
        return GenerationConfig(
            do_sample=options.temperature > 0,
            temperature=1.0,  # the processors do the sampling transforms
            top_k=0 if options.temperature > 0 else None,
            top_p=1.0 if options.temperature > 0 else None,
            repetition_penalty=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=eos_ids,
            stop_strings=stops or None,
            use_cache=True,
            cache_implementation="static" if self.static_cache else None,
            disable_compile=not self.compile,
        )

    @staticmethod
    def processors(options: SamplingOptions) -> tuple[LogprobRecorder, LogitsProcessorList]:
        """A fresh logprob recorder, and the processor list that runs it first, then the sampling transforms."""
        recorder = LogprobRecorder(options.logp_temperature)
        return recorder, LogitsProcessorList([recorder, *sampling_processors(options)])

    @contextlib.contextmanager
    def sampling(self, options: SamplingOptions, device: torch.device) -> Iterator[None]:
        """Everything `generate` runs under: generation mode, the seed, a blank generation config, GQA decode."""
        gqa = gqa_decode(unwrap_model(self.model).config) if self.fast_gqa else contextlib.nullcontext()
        with generation_mode(self.model), seeded(options.seed, device), _blank_generation_config(self.model), gqa:
            yield

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions, episodes: Any = None) -> RolloutBatch:
        refuse_streams(options, "hf")
        if episodes is not None:
            if any(prompt_images(p) for p in prompts):
                raise ValueError("multi-turn episodes take the prompts as token ids (the driver's prompt_ids), with "
                                 "their images in the driver's prompt_images (the built-in AgentDriver sets both)")
            if self.routing is not None:
                raise ValueError("routing replay does not cover multi-turn episodes yet (their observations are "
                                 "prefilled between turns): set model.routing_replay=false")
            return generate_episodes(self, prompts, options, episodes)
        prep = prepare_prompts(self.model, self.processor or self.tokenizer, prompts, options)
        pad_id, eos_ids, device, ids, mask = prep.pad_id, prep.eos_ids, prep.device, prep.ids, prep.mask  # [n, P]
        G = options.num_generations  # rows i*G+g; tokenized once, expanded here (greedy allows no
        # num_return_sequences > 1 in transformers, and this is the same expansion it would do)
        rows_ids, rows_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
        vision, shared = {}, contextlib.nullcontext()
        if prep.images is not None:  # the rows' image tensors and token types; generate computes the M-RoPE positions
            body, row_images = decoder_body(self.model), prep.images.to(device).repeat_interleave(G)
            vision = image_forward_inputs(body, rows_ids, rows_mask, row_images)
            vision.pop("position_ids", None)
            shared = encode_once(body, row_images, vision.get("pixel_values"))  # the tower once per prompt, not G times
        recorder, processors = self.processors(options)
        if self.placeholders:
            processors.append(BanPlaceholders(self.placeholders))
        cfg = self.generation_config(options, options.max_new_tokens, pad_id,
                                     None if options.ignore_eos else eos_ids, list(options.stop))
        extra = {"tokenizer": self.tokenizer} if options.stop else {}
        log = None if self.routing is None else ForwardLog(self.routing.layers, self.routing.dtype)
        record = recording(unwrap_model(self.model), log) if log is not None else contextlib.nullcontext()
        with self.sampling(options, device), record, shared:
            sync(device)
            tg = time.perf_counter()
            out = self.model.generate(input_ids=rows_ids, attention_mask=rows_mask, generation_config=cfg,
                                      logits_processor=processors, **extra, **vision)
            completion = out[:, ids.shape[1] :]  # [B, S]
            logp = recorder.finish(completion)
            routes = None if log is None else forward_routes(self.routing, log, *completion.shape, ids.shape[1])
            sync(device)
            gen_s = time.perf_counter() - tg
            del out
        B, S = completion.shape
        return build_batch(self.tokenizer, prep, completion, logp, torch.full((B,), S, dtype=torch.long), gen_s,
                           routes)


def forward_routes(routing: MoERouting, log: ForwardLog, B: int, S: int, P: int) -> torch.Tensor:
    """[B, P + S, layers, k] routes of `generate`'s forwards: the prefill of the B rows' P prompt columns, then one
    forward per fed token (S - 1 of them: the last sampled token is never fed, its column keeps the sentinel)."""
    if len(log.forwards) != S:
        raise RuntimeError(f"routing record: generate ran {len(log.forwards)} forwards for {S} sampled tokens")
    routes = routing.empty(B, P + S, device=log.forwards[0].device)
    routes[:, :P] = log.forwards[0].view(B, P, routing.layers, routing.top_k)
    if S > 1:
        routes[:, P : P + S - 1] = torch.stack(log.forwards[1:], 1)
    return routes
