"""Backend "static": our own decode loop over the transformers model with a static KV cache.

- Prefill once per prompt (n rows, not n*G), then copy the prompt's KV into a [B, heads, L, d] static cache per
  row (`kv_cache.py`: full-length in every layer, so sliding-window and chunked layers are masked by the model's
  own mask functions exactly as in a full forward; layouts it cannot decode exactly are refused at construction).
- KV budget: a call decodes at most as many rows at once as `max_kv_gib` holds (automatic: AUTO_KV_FRACTION of
  the device memory free at the call, each row also counting SAMPLING_BUFFERS [V] fp32 buffers; no cap on CPU).
  With more rows than that, each of those decode slots takes the next pending row as soon as its row ends
  (`static_refill.py`, `refill`: the same tokens and logprobs, one graph per call), or, where refill does not
  apply, the rows decode in equal waves (on the compiled path a short last wave is padded, so every wave replays
  one graph), each as long as its longest row. A budget too small for one row is refused, naming
  rollout.max_kv_gib and the smallest value that works.
- Each decode step is the model's forward on [B, 1] tokens, then the token draw and the step's writes. On CUDA
  the whole step is one CUDA graph (`step_graph.py`: the forward compiled without CUDA graphs, captured with the
  draw once per wave, a counter on the device for the step), so a step costs one replay and almost no host time.
  With top-k/top-p/min-p, a repetition penalty, length buckets or compaction (or `step_graph=False`) the forward
  alone is compiled with CUDA graphs (`get_compiled_call`, mode "reduce-overhead") and the rest runs eagerly.
  A mixture of experts whose experts sync with the host on this device (`experts.graph_capturable`: eager, or
  grouped_mm outside bf16 on SM90+) decodes compiled without CUDA graphs, with a warning naming the fix.
  With "sdpa" attention, decode attention runs without expanding the KV cache to all query heads
  (`attention.gqa_decode_attention`). With `length_buckets` > 1 attention reads only the filled part of the
  cache rounded up to a bucket; with `compact_finished` ended rows leave the decode batch.
- Sampling (`sampling.py`): one fused pass (two Triton kernels on CUDA, `rollout.sampler_kernel`; torch,
  compiled on CUDA, otherwise) computes log_softmax(logits / T) of the drawn token and draws it by the
  Gumbel-max trick from each row's own counter-based random stream keyed by (seed, prompt index, sample index,
  step), so the samples do not depend on the wave split, compaction or batch size (exactly on CPU). Repetition
  penalty, top-k, top-p and min-p are transformers' processors; finished rows emit the pad id. A model whose
  logits are a shard of the vocabulary (`vocab_shard`: a tensor-parallel lm_head) draws the same tokens by a
  reduction over its group (`vocab_split.py`), and gathers the rows only for those processors. Stop strings are
  checked on the host every `check_every` steps, which is also when the loop exits early once every row is done.
- Weights come from a `WeightSource` (`weights.py`), synced at the start of every call and released at its end:
  the model itself, or a merged-LoRA inference copy that decodes at plain-model speed (and, sleeping, frees its
  memory between calls), or an FP8 copy of either (`fp8.py`, rollout.fp8: e4m3 projections, `torch._scaled_mm`).
- The recorded logprob is log_softmax(raw_logits / T)[token], as documented in `types.py`.
- Prompts with images (a vision-language model given with its processor, `static_rows.py`): the prefill runs the
  model's own forward with each prompt's images (the vision encoder once per prompt, its keys/values shared by the
  G rows), then every step decodes text at explicit positions: for M-RoPE (Qwen-VL) each row's continue after its
  prompt's 3-D positions (the model's `rope_deltas`, per prompt); Gemma 3 decodes as text. The draw never picks an
  image placeholder (the logprob stays the raw one). Not with multi-turn episodes or a vocabulary split yet.
- With `record_routes` (a mixture-of-experts model, `models/routing.py`) the routers' chosen experts are recorded
  too: each prompt's at its prefill (once, shared by its G rows), each row's decode step's into a [b, S, layers, k]
  device buffer at the column the step counter names (inside the step, no host sync), copied to the host with the
  tokens. The last sampled token is never fed forward and keeps the sentinel route.

The KV cache lives only for one `generate` call; its length is rounded up to `cache_multiple` tokens and never
shrinks across calls, so calls with different prompt lengths reuse the compiled graph. A new row count (wave
size, compacted size) or length bucket compiles a new graph (~25 s for a 1.5B model on an H200; the engine raises
dynamo's recompile limit to the number its settings can reach, `allow_recompiles`); the CUDA-graph
memory pool of the compiled step stays allocated while the model lives (it holds the step's activations, not
the KV cache, which is allocated outside the graph). Parameters are graph inputs read in place (CUDA graphs read
them by address), so in-place updates between rollouts (optimizer steps, a merged copy's sync) are seen without
recompiling.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.logits_process import TemperatureLogitsWarper

from logitless.models.compiled import inductor_options
from logitless.models.experts import graph_capturable
from logitless.models.routing import RouteSink, no_route, recording, require_routing, routing_of

from .attention import gqa_decode, resolve_decode_attention
from .engine import PreparedPrompts, build_batch, generation_mode, model_device, prepare_prompts, sync, unwrap_model
from .episodes import episode_batch
from .hf import sampling_processors
from .kv_cache import (
    STATIC_LAYER_TYPES,
    auto_kv_budget,
    kv_bytes_per_token,
    length_buckets,
    prefill_cache,
    wave_rows,
)
from .layouts import FULL, check_layout, text_config
from .sampling import (resolve_sampler_kernel, step_sampler,
                       vocab_codes)
from .static_rows import (DecodeCall, DecodeRows, allow_recompiles, ban_placeholders, compiled_variants, mark_stopped,
                          placeholder_ban, prefill_inputs, refuse_split_vocabulary, refuse_vision_episodes,
                          stream_keys)
from .static_overlap import generate_episodes
from .static_refill import decode_refill, refill_blockers, use_refill
from .static_turns import check_episode_options
from .static_waves import eager_steps, graph_steps
from .vision import BanPlaceholders, is_processor, text_tokenizer
from .types import Prompt, RolloutBatch, SamplingOptions
from .vocab_split import VocabShard, shard_codes, split_sampler
from .weights import LiveWeights, WeightSource

AUTO_KV_FRACTION = 0.85  # share of the free device memory the decode cache may take when max_kv_gib is unset
SAMPLING_BUFFERS = 8  # [V] fp32 buffers per row that sampling keeps live (logits, scaled, noise, scores, ...)


class StaticEngine:
    """Fast sampler with a static KV cache and a CUDA-graph-compiled decode step.

    compile: compile the decode step and the sampler (default: on CUDA only). check_every: host-side stop-string /
    all-finished checks every that many steps. cache_multiple: round the cache length up to this.
    max_kv_gib: cap of the decode KV cache in GiB (rows beyond it are decoded in later waves); None: automatic,
    AUTO_KV_FRACTION of the device memory free at the call (no cap on CPU). weights: where the decode weights come
    from (`weights.py`; default: the model itself). profile: synchronize around each part of the decode step and
    report its seconds in `RolloutTiming.parts` (slower; for benchmarks). length_buckets: decode attention reads
    only the filled part of the cache rounded up to one of this many lengths (`kv_cache.length_buckets`; each is
    one more compiled graph per row count; 1 = the whole cache). compact_finished: when at most half of a wave's
    rows are unfinished at a host check, decode on with fewer rows (`DecodeRows.compacted`; each row count is one more
    compiled graph). decode_attention: "auto", "matmul" or "triton" (`resolve_decode_attention`).
    sampler_kernel: how an unfiltered token is drawn, "auto", "torch" or "triton" (`sampling.resolve_sampler_kernel`).
    step_graph: run each decode step (forward, draw, writes) as one CUDA graph (`step_graph.py`). None: on the
    compiled CUDA path wherever it applies (no top-k/top-p/min-p/repetition penalty in the call, one length bucket,
    no compaction); True: as None, refused where it does not apply (off CUDA the same step runs eagerly, not
    captured); False: never (the forward alone is a CUDA graph). `capture_eager` (an attribute, False): with None,
    capture the eager step too where the forward is not compiled (a tensor-parallel group's decode on CUDA).
    record_routes: record the experts every token was routed to (`RolloutBatch.prompt_routes`/`completion_routes`;
    a mixture-of-experts model with a supported router family, `models/routing.py`; not with episodes).
    refill: when the budget holds fewer rows than the call has, refill decode slots as rows end instead of waves
    (`static_refill.use_refill`; None: wherever it applies, True: an error where it does not, False: waves).
    `row_limits` (an attribute, None): [B] tokens each row may draw, for benchmarks' planted lengths.
    tokenizer: a tokenizer, or a vision-language model's processor (chat prompts with images: `static_rows.py`;
    `RolloutBatch.images` carries their tensors to the trainer).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        compile: bool | None = None,
        check_every: int = 32,
        cache_multiple: int = 128,
        max_kv_gib: float | None = None,
        weights: WeightSource | None = None,
        profile: bool = False,
        length_buckets: int = 1,
        compact_finished: bool = False,
        decode_attention: str = "auto",
        sampler_kernel: str = "auto",
        step_graph: bool | None = None,
        record_routes: bool = False,
        refill: bool | None = None,
    ):
        if check_every < 1 or cache_multiple < 1:
            raise ValueError(
                f"StaticEngine: check_every={check_every} and cache_multiple={cache_multiple} must both be >= 1"
            )
        if not isinstance(length_buckets, int) or length_buckets < 1:
            raise ValueError(f"rollout.length_buckets={length_buckets!r} must be an int >= 1 (1 = attend over the "
                             "whole cache)")
        if step_graph is True and (length_buckets != 1 or compact_finished):
            set_ = ", ".join(n for n, on in (("rollout.length_buckets=1", length_buckets != 1),
                                             ("rollout.compact_finished=false", compact_finished)) if on)
            raise ValueError(f"rollout.step_graph=true captures one decode step for a whole wave, but "
                             f"{'length buckets' if length_buckets != 1 else 'compaction'} change its shapes "
                             f"between steps: set {set_}, or unset rollout.step_graph")
        if max_kv_gib is not None and not max_kv_gib > 0:
            raise ValueError(f"rollout.max_kv_gib={max_kv_gib!r} must be > 0 (GiB), or unset for the automatic budget")
        self.weights = weights if weights is not None else LiveWeights(model)
        types = check_layout(unwrap_model(self.weights.module), "static", STATIC_LAYER_TYPES)
        self.full_attention_only = all(kind == FULL for kind in types)  # what refill needs
        if record_routes:
            require_routing(unwrap_model(self.weights.module), "model.routing_replay")
        self.record_routes = record_routes
        self.refill = refill
        where = model_device(self.weights.module)
        dtype = getattr(unwrap_model(self.weights.module), "dtype", torch.float32)
        has_triton = importlib.util.find_spec("triton") is not None
        capability = torch.cuda.get_device_capability(where) if where.type == "cuda" else (0, 0)
        decode_attention = resolve_decode_attention(decode_attention, where, dtype, has_triton, capability)
        sampler_kernel = resolve_sampler_kernel(sampler_kernel, where, has_triton)
        self.model = model
        self.processor = tokenizer if is_processor(tokenizer) else None  # a vision-language model's (images)
        self.tokenizer = text_tokenizer(tokenizer)
        self.ban = placeholder_ban(self.weights.module, where)  # image placeholders the draw never picks (or None)
        self.compile = compile
        self.check_every = check_every
        self.cache_multiple = cache_multiple
        self.max_kv_gib = max_kv_gib
        self.profile = profile
        self.length_buckets = length_buckets
        self.compact_finished = compact_finished
        self.decode_attention = decode_attention
        self.sampler_kernel = sampler_kernel
        self.step_graph = step_graph
        self.capture_eager = False  # step_graph None: capture the step where it runs eagerly too (see above)
        self.graphs, why = graph_capturable(unwrap_model(self.weights.module), where)  # (a MoE's experts may sync)
        if not self.graphs and (step_graph or (compile is not False and step_graph is None)):
            fix = ("set model.experts_implementation=batched_mm (no host sync; memory grows with rows x k x one "
                   "expert's weights) or run in bfloat16 on an H100/H200 (grouped_mm)")
            if step_graph:
                raise ValueError(f"rollout.step_graph=true captures the decode step, but {why}: {fix}, or unset "
                                 "rollout.step_graph")
            warnings.warn(f"rollout: the decode step runs without CUDA graphs (slower): {why}. To capture it, "
                          f"{fix}", stacklevel=2)
        self._streams: dict[torch.device, Any] = {}  # the side stream the step graphs warm up and capture on
        self.auto_sync = True  # sync the weights at the start of each generate (off: the caller syncs)
        # processes that decode one batch together (tensor parallelism) must agree on its waves: this maps this
        # process's automatic KV budget (bytes, None = no cap) to the one they all use (their smallest)
        self.shared_budget: Callable[[float | None], float | None] | None = None
        # a model whose logits are this process's columns of the vocabulary (a tensor-parallel lm_head): the draw
        # reduces over the group (`vocab_split.py`); with top-k/top-p/min-p/repetition penalty the rows are gathered
        self.vocab_shard: VocabShard | None = None
        # [B] long or None: row b ends once it has drawn row_limits[b] tokens (at most max_new_tokens), as at that
        # limit; benchmarks plant a length distribution with it on a random-init model, whose rows never draw EOS
        self.row_limits: torch.Tensor | None = None
        if refill is True and refill_blockers(self):
            raise ValueError(f"rollout.refill=true refills decode slots as rows end, which needs "
                             f"{'; '.join(refill_blockers(self))}; or unset rollout.refill (waves)")
        self._max_len = 0
        self._last_parts: dict[str, float] = {}
        self._caches: list[weakref.ref] = []  # weak references to the KV caches of the call in progress

    @property
    def cache_length(self) -> int:
        """Slots per row of the longest decode cache so far (0 before the first call); no later call uses fewer."""
        return self._max_len

    def _caches_alive(self) -> bool:
        """Whether a KV cache of the last call is still alive (only a reference cycle keeps one once it returns)."""
        return any(ref() is not None for ref in self._caches)

    def _use_compile(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else bool(self.compile)

    def _forward(self, module: Any, device: torch.device, rows: int):
        base = unwrap_model(module)
        if self._use_compile(device):
            allow_recompiles(compiled_variants(rows, self.length_buckets, self.compact_finished))
            config = CompileConfig(fullgraph=False, mode=None, dynamic=False,
                                   options=inductor_options(cudagraphs=self.graphs))
            return base.get_compiled_call(config), True
        return base.__call__, False

    def _graph_step(self, device: torch.device, filters: list) -> bool:
        """Whether this call's waves decode through `DecodeStep` (see `step_graph` in the class docstring)."""
        if self.step_graph is False:
            return False
        fits = not filters and self.length_buckets == 1 and not self.compact_finished
        if self.step_graph is None:
            return fits and device.type == "cuda" and self.graphs and (self._use_compile(device) or self.capture_eager)
        if not fits:
            raise ValueError("rollout.step_graph=true draws with the fused sampler, but this call samples with "
                             "top-k/top-p/min-p or a repetition penalty (transformers' processors run eagerly): "
                             "unset those sampling options, or unset rollout.step_graph")
        return True

    def _step_forward(self, module: Any, device: torch.device, rows: int):
        """The forward a `DecodeStep` runs: compiled without CUDA graphs on the compiled path (the step graph
        captures it), else the model itself."""
        base = unwrap_model(module)
        if self._use_compile(device):
            allow_recompiles(compiled_variants(rows, self.length_buckets, self.compact_finished))
            return base.get_compiled_call(CompileConfig(fullgraph=False, mode=None, dynamic=False,
                                                        options=inductor_options(cudagraphs=False)))
        return base.__call__

    def _cache_len(self, P: int, S: int, ctx: int | None) -> int:
        """Slots per row: P + S rounded up to cache_multiple, and never below an earlier call's (so calls with
        different prompt lengths reuse the compiled graph), within the context window."""
        L = max(-(-(P + S) // self.cache_multiple) * self.cache_multiple, self._max_len)
        if ctx is not None:
            L = max(min(L, ctx), P + S)
        self._max_len = L
        return L

    def _wave_size(self, call: DecodeCall, B: int) -> int:
        per_token = kv_bytes_per_token(call.prefill)
        if self.max_kv_gib is not None:
            return wave_rows(B, call.cache_len * per_token, self.max_kv_gib * 2**30, "rollout.max_kv_gib")
        V = call.codes.shape[0]  # the columns the draw reads (a vocabulary shard's, or the whole rows gathered)
        row = call.cache_len * per_token + SAMPLING_BUFFERS * 4 * V
        budget = auto_kv_budget(call.prep.device, AUTO_KV_FRACTION)
        if self.shared_budget is not None:
            budget = self.shared_budget(budget)
        return wave_rows(B, row, budget, "rollout.max_kv_gib (unset: automatic, from free device memory)")

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions, episodes: Any = None) -> RolloutBatch:
        """G samples of each prompt; with `episodes` (an `episodes.EpisodeDriver`) multi-turn episodes
        (`static_turns.py`)."""
        module = self.weights.module
        t_call = time.perf_counter()
        if self.vocab_shard is not None:
            refuse_split_vocabulary(module)
        if episodes is not None:
            refuse_vision_episodes(module)
        prep = prepare_prompts(module, self.processor or self.tokenizer, prompts, options)
        if episodes is not None:
            check_episode_options(self, options, episodes)
            if self.record_routes:
                raise ValueError("routing replay does not cover multi-turn episodes yet (their observations are "
                                 "prefilled between turns): set model.routing_replay=false")
        outside = {"prepare": time.perf_counter() - t_call}  # with profile: the parts around the decode
        device = prep.device
        # the decode's GPU is the current one for the call: an eagerly launched Triton kernel runs on the current
        # device, which on another thread or with rollout.device is not the model's
        here = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        self._caches = []  # every KV cache of the call: a full gc only if one outlives it
        release_parts = outside if self.profile else None
        with here, generation_mode(module, release_parts, self._caches_alive), \
                gqa_decode(text_config(unwrap_model(module)), self.decode_attention, device):
            if self.auto_sync:
                t0 = time.perf_counter()
                self.weights.sync()
                self._tick("weights_sync", t0, device, outside)
            try:
                if episodes is not None:
                    raw = generate_episodes(self, prep, options, episodes)
                else:
                    raw = self._generate_rows(module, prep, options)
            finally:
                if self.auto_sync:
                    t0 = time.perf_counter()
                    self.weights.release()  # a sleeping weight copy frees its memory until the next sync
                    self._tick("weights_release", t0, device, outside)
        t0 = time.perf_counter()
        batch = build_batch(self.tokenizer, prep, *raw) if episodes is None else episode_batch(self.tokenizer, prep, *raw)
        outside["batch"] = time.perf_counter() - t0  # EOS and stop strings, detokenization (host only)
        batch.timing.parts = {**self._last_parts, **outside} if self.profile else {}
        return batch

    def _generate_rows(self, module: Any, prep: PreparedPrompts, options: SamplingOptions):
        """The single-turn decode of every row: (tokens [B, S], logps [B, S], lengths [B], seconds, routes
        [B, P + S, layers, k] or None), on the host."""
        G, (n, P), S = options.num_generations, prep.ids.shape, options.max_new_tokens
        B, device = n * G, prep.device
        completion = torch.full((B, S), prep.pad_id, dtype=torch.long)
        logps = torch.zeros((B, S), dtype=torch.float32)
        lens = torch.zeros(B, dtype=torch.long)
        sync(device)
        tg = time.perf_counter()
        call, prompt_of_row = self._start_call(module, prep, options, self._cache_len(P, S, prep.context))
        routes = None if call.routing is None else call.routing.empty(B, P + S)
        wave = self._wave_size(call, B)
        if use_refill(self, call, wave, B):  # slots refilled as rows end (`static_refill.py`)
            decode_refill(self, module, call, prompt_of_row, wave, call.limits, completion, logps, lens)
            sync(device)
            return completion, logps, lens, time.perf_counter() - tg, routes
        for r0 in range(0, B, wave):
            rows = torch.arange(r0, min(r0 + wave, B), device=device)
            ids, lp, steps, wave_routes = self._decode_wave(module, call, rows, prompt_of_row, pad_to=wave)
            completion[r0 : r0 + len(rows), :steps] = ids.cpu()
            logps[r0 : r0 + len(rows), :steps] = lp.cpu()
            lens[r0 : r0 + len(rows)] = call.limits[r0 : r0 + len(rows)].cpu().clamp(max=steps)
            if routes is not None:
                routes[r0 : r0 + len(rows), :P] = call.prompt_routes[prompt_of_row[rows]].cpu()
                routes[r0 : r0 + len(rows), P : P + steps] = wave_routes.cpu()
        sync(device)
        return completion, logps, lens, time.perf_counter() - tg, routes

    def _start_call(self, module: Any, prep: PreparedPrompts, options: SamplingOptions, cache_len: int,
                    extra_eos: Sequence[int] = ()) -> tuple[DecodeCall, torch.Tensor]:
        """Prefill the prompts and set up what every wave shares: (the call, the prompt of each row [B]).
        extra_eos: more ids that end a row's decode (an episode's turn-end ids)."""
        G, n, device = options.num_generations, prep.ids.shape[0], prep.device
        seed = options.seed if options.seed is not None else int(torch.randint(0, 2**62, ()).item())
        prompt_of_row = torch.arange(n, device=device).repeat_interleave(G)  # [B]
        filters = [p for p in sampling_processors(options) if not isinstance(p, TemperatureLogitsWarper)]
        if filters and self.ban is not None:  # (unfiltered draws ban them in `_draw`)
            filters.append(BanPlaceholders(self.ban.tolist()))
        eos = sorted({*(prep.eos_ids if not options.ignore_eos else []), *extra_eos})
        keys = stream_keys(options.streams or [(seed, n)], n, G, device)  # (a bad streams list fails here, early)
        call = self._prefill(module, prep, options, cache_len)
        call.keys = keys
        shard = self.vocab_shard
        call.codes = vocab_codes(call.first_logits.shape[-1], device) if shard is None else \
            vocab_codes(shard.vocab, device) if filters else shard_codes(shard.start, shard.size, device)
        call.filters = filters
        call.eos = torch.tensor(eos, dtype=torch.long, device=device)
        call.limits = torch.full((n * G,), options.max_new_tokens, dtype=torch.long, device=device)
        if self.row_limits is not None:
            if self.row_limits.shape != (n * G,):
                raise ValueError(f"StaticEngine.row_limits has shape {tuple(self.row_limits.shape)}, the call has "
                                 f"{n * G} rows")
            call.limits = call.limits.clamp(max=self.row_limits.to(device).clamp(min=1))
        return call, prompt_of_row

    def _draw(self, device: torch.device):
        """The unfiltered token draw of this engine's decode steps (`sampling.step_sampler`, over this process's
        columns of the vocabulary with a `vocab_shard`); a vision-language model's never draws an image placeholder
        (`static_rows.ban_placeholders`)."""
        if self.vocab_shard is not None:
            return split_sampler(self.vocab_shard, device, self.sampler_kernel, self._use_compile(device))
        draw = step_sampler(device, self.sampler_kernel, self._use_compile(device))
        return draw if self.ban is None else ban_placeholders(draw, self.ban.to(device))

    def _prefill(self, module: Any, prep: PreparedPrompts, options: SamplingOptions, cache_len: int) -> DecodeCall:
        """Prefill the n distinct prompts once (a vision-language model's with their images: `static_rows.py`);
        every wave copies its rows' prompt keys/values from this (and, with record_routes, the prompts' routes)."""
        t0 = time.perf_counter()
        pos, vision, start = prefill_inputs(module, prep)  # (a vision-language model's images, M-RoPE positions)
        pre_cache = prefill_cache()
        self._caches.append(weakref.ref(pre_cache))
        routing = routing_of(unwrap_model(module)) if self.record_routes else None
        sink = None
        if routing is not None:  # each prompt token's routes, once per prompt
            sink = RouteSink(routing.empty(prep.ids.numel(), 1, device=prep.device),
                             torch.zeros((), dtype=torch.long, device=prep.device))
        with recording(unwrap_model(module), sink) if sink is not None else contextlib.nullcontext():
            out = module(input_ids=prep.ids, attention_mask=prep.mask, position_ids=pos, past_key_values=pre_cache,
                         use_cache=True, logits_to_keep=1, **vision)
        first = out.logits[:, -1].float()  # [n, V]
        del out
        call = DecodeCall(prep, options, cache_len, pre_cache, first, keys=None, codes=None, filters=[], eos=None,
                          start=start)
        if sink is not None:
            prompt_routes = sink.buffer.view(*prep.ids.shape, routing.layers, routing.top_k)
            call.routing = routing
            call.prompt_routes = prompt_routes.masked_fill(~prep.mask.bool()[..., None, None], no_route(routing.dtype))
        self._last_parts = {}
        self._tick("prefill", t0, prep.device)
        return call

    def _tick(self, part: str, t0: float, device: torch.device, parts: dict[str, float] | None = None) -> float:
        """With profile=True: synchronize and add the seconds since t0 to `part` (of the decode's parts, or of
        `parts`); returns the new start time."""
        if not self.profile:
            return t0
        sync(device)
        now = time.perf_counter()
        parts = self._last_parts if parts is None else parts
        parts[part] = parts.get(part, 0.0) + now - t0
        return now

    def _decode_wave(
        self, module: Any, call: DecodeCall, rows: torch.Tensor, prompt_of_row: torch.Tensor, pad_to: int
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """Decode rows `rows` [w] of the call together: (tokens [w, steps], logps [w, steps], steps, routes
        [w, steps, layers, k] or None). On the compiled path a short last wave is padded with copies of its last row
        so every wave has one shape."""
        prep, options, device = call.prep, call.options, call.prep.device
        w = len(rows)
        if self._use_compile(device) and w < pad_to:
            rows = torch.cat([rows, rows[-1:].expand(pad_to - w)])
        t0 = time.perf_counter()
        P, S, L, Bw = prep.ids.shape[1], options.max_new_tokens, call.cache_len, len(rows)
        src = prompt_of_row[rows]  # [Bw] prompt of each row
        history = torch.full((Bw, P + S), prep.pad_id, dtype=torch.long, device=device)
        history[:, :P] = prep.ids[src]
        out_logp = torch.zeros((Bw, S), dtype=torch.float32, device=device)
        live = DecodeRows.start(call, src, call.keys[rows], L)
        limit = call.limits[rows]  # [Bw] tokens each row may draw
        self._caches.append(weakref.ref(live.cache))
        # the routes of the token each step feeds, at its column (the step counter); None without record_routes
        sink = None if call.routing is None else RouteSink(
            call.routing.empty(Bw, S, device=device), torch.zeros((), dtype=torch.long, device=device), live.index)
        record = recording(unwrap_model(module), sink) if sink is not None else contextlib.nullcontext()
        # With top-k/top-p/min-p or a repetition penalty the draw runs eagerly in torch: the compiled pass failed
        # the chi-square test of tests/test_sampling_stats.py on CUDA with filters on (and passed without them).
        # The logits stay in the model's dtype (the draw upcasts them as it reads them; the forward's output
        # buffer is read before the next step's replay overwrites it).
        draw = self._draw(device)  # unfiltered draws
        buckets = length_buckets(P, L, self.length_buckets, self.cache_multiple)
        t0 = self._tick("prefill", t0, device)  # the copy into this wave's cache
        with record:
            if self._graph_step(device, call.filters):
                steps = graph_steps(self, module, call, live, history, out_logp, draw, t0, sink, limit)
            else:
                forward, compiled = self._forward(module, device, Bw)
                steps = eager_steps(self, live, call, history, out_logp, draw, forward, compiled, buckets, sink, t0,
                                    limit)
        routes = None if sink is None else sink.buffer[:w, :steps]
        return history[:w, P : P + steps], out_logp[:w, :steps], steps, routes

    def _all_done(self, live: DecodeRows, history: torch.Tensor, P: int, steps: int, options: SamplingOptions) -> bool:
        """Host check (one sync): mark rows whose text contains a stop string as done; True if all rows are."""
        return mark_stopped(live, history, P, steps, options.stop, self.tokenizer)
