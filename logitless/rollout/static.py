"""Backend "static": our own decode loop over the transformers model with a static KV cache.

- Prefill once per prompt (n rows, not n*G), then copy the prompt's KV into a [B, heads, L, d] static cache per
  row (`kv_cache.py`: full-length in every layer, so sliding-window and chunked layers are masked by the model's
  own mask functions exactly as in a full forward; layouts it cannot decode exactly are refused at construction).
- KV budget: rows are decoded in waves of as many rows as `max_kv_gib` holds (automatic: AUTO_KV_FRACTION of the
  device memory free at the call, each row also counting SAMPLING_BUFFERS [V] fp32 buffers; no cap on CPU). Waves
  are equal-sized; on the compiled path a short last wave is padded, so every wave replays one graph. A budget
  too small for one row is refused, naming rollout.max_kv_gib and the smallest value that works.
- Each decode step is the model's forward on [B, 1] tokens; on CUDA it is compiled with CUDA graphs
  (`get_compiled_call`, mode "reduce-overhead"), so a step costs one graph replay instead of ~1000 launches.
  With "sdpa" attention, decode attention runs without expanding the KV cache to all query heads
  (`attention.gqa_decode_attention`). With `length_buckets` > 1 attention reads only the filled part of the
  cache rounded up to a bucket; with `compact_finished` ended rows leave the decode batch.
- Sampling (`sampling.py`): one fused pass (compiled on CUDA) computes log_softmax(logits / T) of the drawn
  token and draws it by the Gumbel-max trick from each row's own counter-based random stream keyed by (seed,
  prompt index, sample index, step), so the samples do not depend on the wave split, compaction or batch size
  (exactly on CPU). Repetition penalty, top-k, top-p and min-p are transformers' processors; finished rows emit
  the pad id. Stop strings are checked on the host every `check_every` steps, which is also when the loop exits
  early once every row is done.
- Weights come from a `WeightSource` (`weights.py`), synced at the start of every call and released at its end:
  the model itself, or a merged-LoRA inference copy that decodes at plain-model speed (and, sleeping, frees its
  memory between calls).
- The recorded logprob is log_softmax(raw_logits / T)[token], as documented in `types.py`.

The KV cache lives only for one `generate` call; its length is rounded up to `cache_multiple` tokens and never
shrinks across calls, so calls with different prompt lengths reuse the compiled graph. A new row count (wave
size, compacted size) or length bucket compiles a new graph (~25 s for a 1.5B model on an H200). Step graphs
are captured again for every wave (its cache is new) into a memory pool of their own, freed with the wave; the
"reduce-overhead" graph's pool stays allocated while the model lives (both hold a step's activations, not the
KV cache, which is allocated outside the graphs). Parameters are graph inputs read in place (CUDA graphs read
them by address), so in-place updates between rollouts (optimizer steps, a merged copy's sync) are seen without
recompiling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.logits_process import TemperatureLogitsWarper

from .attention import gqa_decode
from .engine import PreparedPrompts, build_batch, generation_mode, prepare_prompts, sync, unwrap_model
from .hf import sampling_processors
from .kv_cache import (
    STATIC_LAYER_TYPES,
    auto_kv_budget,
    decode_cache,
    kv_bytes_per_token,
    length_buckets,
    prefill_cache,
    select_rows,
    set_visible,
    wave_rows,
)
from .graphs import StepGraphs
from .layouts import check_layout
from .sampling import apply_filters, fused_sampler, row_keys, step_keys, vocab_codes
from .types import Prompt, RolloutBatch, SamplingOptions
from .weights import LiveWeights, WeightSource

AUTO_KV_FRACTION = 0.85  # share of the free device memory the decode cache may take when max_kv_gib is unset
SAMPLING_BUFFERS = 8  # [V] fp32 buffers per row that sampling keeps live (logits, scaled, noise, scores, ...)
MIN_COMPACT_ROWS = 8  # compact_finished never shrinks a wave below this many rows


@dataclass
class _Call:
    """What every wave of one `generate` call shares."""

    prep: PreparedPrompts
    options: SamplingOptions
    cache_len: int  # L, slots per row in the decode cache
    prefill: Any  # DynamicCache of the n distinct prompts
    first_logits: torch.Tensor  # [n, V] fp32 logits of each prompt's first completion token
    keys: torch.Tensor  # [B] int64 random-stream key of each row
    codes: torch.Tensor  # [V] int64 hashed vocabulary indices
    filters: list  # repetition penalty / top-k / top-p / min-p processors (no temperature)
    eos: torch.Tensor  # [E] long EOS ids (empty with ignore_eos)
    parts: dict[str, float] = field(default_factory=dict)  # seconds per part of the step (profile=True)


@dataclass
class _Rows:
    """The rows a wave is decoding and their decode state; row i writes row `index[i]` of the wave's outputs."""

    index: torch.Tensor  # [b] long
    cache: Any  # static decode cache, b rows
    mask: torch.Tensor  # [b, L] attention mask over the cache slots
    next_pos: torch.Tensor  # [b, 1] position of the next token
    done: torch.Tensor  # [b] bool
    keys: torch.Tensor  # [b] random-stream keys
    logits: torch.Tensor  # [b, V] fp32 logits of the next token
    visible: int  # cache slots attention reads (a length bucket)

    @staticmethod
    def start(call: _Call, src: torch.Tensor, keys: torch.Tensor, L: int) -> _Rows:
        """Rows whose prompts are `src` [b], with the prompts' keys/values copied into a fresh cache."""
        prep, S = call.prep, call.options.max_new_tokens
        P, device = prep.ids.shape[1], prep.device
        mask = torch.zeros((len(src), L), dtype=torch.long, device=device)
        mask[:, :P] = prep.mask[src]
        mask[:, P : P + S] = 1  # future slots are hidden by causality (query offset = cache length)
        return _Rows(torch.arange(len(src), device=device), decode_cache(call.prefill, src, L), mask,
                     prep.mask.sum(1)[src][:, None], torch.zeros(len(src), dtype=torch.bool, device=device), keys,
                     call.first_logits[src], L)

    def show(self, visible: int) -> None:
        if visible != self.visible:
            self.visible = visible
            set_visible(self.cache, visible)

    def visible_mask(self) -> torch.Tensor:
        return self.mask if self.visible == self.mask.shape[1] else self.mask[:, : self.visible]

    def compacted(self) -> _Rows:
        """When at most half the rows are unfinished, the same decode over fewer rows: the unfinished ones, topped
        up with finished ones to a power of two (>= MIN_COMPACT_ROWS), so only a few row counts get a compiled
        graph; else self. Results do not change: finished rows only emit padding, and every row keeps its own
        random stream."""
        b = len(self.index)
        active = int((~self.done).sum())
        if b <= MIN_COMPACT_ROWS or active > b // 2:
            return self
        target = max(MIN_COMPACT_ROWS, 1 << max(active - 1, 0).bit_length())
        sel = torch.argsort(self.done.to(torch.int8), stable=True)[:target]  # unfinished rows first
        cache = select_rows(self.cache, sel)
        picked = _Rows(self.index[sel], cache, self.mask[sel], self.next_pos[sel], self.done[sel], self.keys[sel],
                       self.logits[sel], self.visible)
        return picked


@dataclass
class _Wave:
    """One wave's decode state: what a step reads and writes in place (fixed addresses, for the step graphs)."""

    call: _Call
    live: _Rows
    history: torch.Tensor  # [Bw, P + S] long: prompt and sampled tokens of each row
    out_logp: torch.Tensor  # [Bw, S] fp32 sampler logprobs
    t: torch.Tensor  # [] long: the step being sampled
    P: int  # prompt slots
    forward: Any
    compiled: bool  # forward is a CUDA-graph-compiled call ("reduce-overhead")
    sampler: Any
    graphs: StepGraphs | None  # None: steps launched one by one


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
    rows are unfinished at a host check, decode on with fewer rows (`_Rows.compacted`; each row count is one more
    compiled graph). step_graphs: on CUDA with compile, run `check_every` decode steps (sampling included) per
    CUDA graph launch (`graphs.StepGraphs`; not with filters or profile, which launch step by step).
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
        step_graphs: bool = True,
    ):
        if check_every < 1 or cache_multiple < 1:
            raise ValueError(
                f"StaticEngine: check_every={check_every} and cache_multiple={cache_multiple} must both be >= 1"
            )
        if not isinstance(length_buckets, int) or length_buckets < 1:
            raise ValueError(f"rollout.length_buckets={length_buckets!r} must be an int >= 1 (1 = attend over the "
                             "whole cache)")
        if max_kv_gib is not None and not max_kv_gib > 0:
            raise ValueError(f"rollout.max_kv_gib={max_kv_gib!r} must be > 0 (GiB), or unset for the automatic budget")
        self.weights = weights if weights is not None else LiveWeights(model)
        check_layout(unwrap_model(self.weights.module), "static", STATIC_LAYER_TYPES)
        self.model = model
        self.tokenizer = tokenizer
        self.compile = compile
        self.check_every = check_every
        self.cache_multiple = cache_multiple
        self.max_kv_gib = max_kv_gib
        self.profile = profile
        self.length_buckets = length_buckets
        self.compact_finished = compact_finished
        self.auto_sync = True  # sync the weights at the start of each generate (off: the caller syncs)
        self.step_graphs = step_graphs
        self._max_len = 0
        self._last_parts: dict[str, float] = {}
        self._compiled_forward: tuple[Any, Any] | None = None  # (model, its forward compiled for step graphs)
        self._warm: set[tuple[int, int]] = set()  # (rows, visible) shapes the compiled forward has run

    def _use_compile(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else bool(self.compile)

    def _forward(self, module: Any, device: torch.device, graphs: bool) -> tuple[Any, bool]:
        """(the decode step's forward, whether it is a CUDA-graph-compiled call). With step graphs: compiled
        without CUDA graphs of its own (the step graph captures it); else torch.compile's "reduce-overhead"."""
        base = unwrap_model(module)
        if graphs:
            if self._compiled_forward is None or self._compiled_forward[0] is not base:
                self._compiled_forward = (base, torch.compile(base.__call__, fullgraph=False, dynamic=False))
                self._warm.clear()
            return self._compiled_forward[1], False
        if self._use_compile(device):
            return base.get_compiled_call(CompileConfig(fullgraph=False, mode="reduce-overhead", dynamic=False)), True
        return base.__call__, False

    def _cache_len(self, P: int, S: int, ctx: int | None) -> int:
        """Slots per row: P + S rounded up to cache_multiple, and never below an earlier call's (so calls with
        different prompt lengths reuse the compiled graph), within the context window."""
        L = max(-(-(P + S) // self.cache_multiple) * self.cache_multiple, self._max_len)
        if ctx is not None:
            L = max(min(L, ctx), P + S)
        self._max_len = L
        return L

    def _wave_size(self, call: _Call, B: int) -> int:
        per_token = kv_bytes_per_token(call.prefill)
        if self.max_kv_gib is not None:
            return wave_rows(B, call.cache_len * per_token, self.max_kv_gib * 2**30, "rollout.max_kv_gib")
        V = call.first_logits.shape[-1]
        row = call.cache_len * per_token + SAMPLING_BUFFERS * 4 * V
        budget = auto_kv_budget(call.prep.device, AUTO_KV_FRACTION)
        return wave_rows(B, row, budget, "rollout.max_kv_gib (unset: automatic, from free device memory)")

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions) -> RolloutBatch:
        module = self.weights.module
        prep = prepare_prompts(module, self.tokenizer, prompts, options)
        G, (n, P), S = options.num_generations, prep.ids.shape, options.max_new_tokens
        B, device = n * G, prep.device
        seed = options.seed if options.seed is not None else int(torch.randint(0, 2**62, ()).item())
        prompt_of_row = torch.arange(n, device=device).repeat_interleave(G)  # [B]
        filters = [p for p in sampling_processors(options) if not isinstance(p, TemperatureLogitsWarper)]
        eos = torch.tensor(prep.eos_ids if not options.ignore_eos else [], dtype=torch.long, device=device)
        completion = torch.full((B, S), prep.pad_id, dtype=torch.long)
        logps = torch.zeros((B, S), dtype=torch.float32)
        lens = torch.zeros(B, dtype=torch.long)
        with generation_mode(module), gqa_decode(unwrap_model(module).config):
            if self.auto_sync:
                self.weights.sync()
            try:
                sync(device)
                tg = time.perf_counter()
                call = self._prefill(module, prep, options, P, S)
                call.keys = row_keys(seed, prompt_of_row, torch.arange(B, device=device) % G)
                call.codes, call.filters, call.eos = vocab_codes(call.first_logits.shape[-1], device), filters, eos
                wave = self._wave_size(call, B)
                for r0 in range(0, B, wave):
                    rows = torch.arange(r0, min(r0 + wave, B), device=device)
                    ids, lp, steps = self._decode_wave(module, call, rows, prompt_of_row, pad_to=wave)
                    completion[r0 : r0 + len(rows), :steps] = ids.cpu()
                    logps[r0 : r0 + len(rows), :steps] = lp.cpu()
                    lens[r0 : r0 + len(rows)] = steps
                sync(device)
                gen_s = time.perf_counter() - tg
                del call
            finally:
                if self.auto_sync:
                    self.weights.release()  # a sleeping weight copy frees its memory until the next sync
        batch = build_batch(self.tokenizer, prep, completion, logps, lens, gen_s)
        batch.timing.parts = dict(self._last_parts) if self.profile else {}
        return batch

    def _prefill(self, module: Any, prep: PreparedPrompts, options: SamplingOptions, P: int, S: int) -> _Call:
        """Prefill the n distinct prompts once; every wave copies its rows' prompt keys/values from this."""
        t0 = time.perf_counter()
        pos = (prep.mask.cumsum(1) - 1).clamp(min=0)
        pre_cache = prefill_cache()
        out = module(input_ids=prep.ids, attention_mask=prep.mask, position_ids=pos, past_key_values=pre_cache,
                     use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].float()  # [n, V]
        del out
        L = self._cache_len(P, S, prep.context)
        call = _Call(prep, options, L, pre_cache, first, keys=None, codes=None, filters=[], eos=None)
        self._last_parts = {}
        self._tick("prefill", t0, prep.device)
        return call

    def _tick(self, part: str, t0: float, device: torch.device) -> float:
        """With profile=True: synchronize and add the seconds since t0 to `part`; returns the new start time."""
        if not self.profile:
            return t0
        sync(device)
        now = time.perf_counter()
        self._last_parts[part] = self._last_parts.get(part, 0.0) + now - t0
        return now

    def _decode_wave(
        self, module: Any, call: _Call, rows: torch.Tensor, prompt_of_row: torch.Tensor, pad_to: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Decode rows `rows` [w] of the call together: (tokens [w, steps], logps [w, steps], steps). On the
        compiled path a short last wave is padded with copies of its last row so every wave has one shape.

        Step t samples token t from the rows' logits, records it and runs the forward that writes cache slot
        P + t and gives the logits of token t + 1; the last step samples only. Between host checks (every
        `check_every` steps) the steps run back to back: on the step-graph path as replays of a graph of
        `check_every` steps (`graphs.StepGraphs`), a bucket's last few steps one-step graphs."""
        prep, options, device = call.prep, call.options, call.prep.device
        w = len(rows)
        if self._use_compile(device) and w < pad_to:
            rows = torch.cat([rows, rows[-1:].expand(pad_to - w)])
        t0 = time.perf_counter()
        P, S, L, Bw = prep.ids.shape[1], options.max_new_tokens, call.cache_len, len(rows)
        src = prompt_of_row[rows]  # [Bw] prompt of each row
        history = torch.full((Bw, P + S), prep.pad_id, dtype=torch.long, device=device)
        history[:, :P] = prep.ids[src]
        live = _Rows.start(call, src, call.keys[rows], L)
        graphs = self._use_step_graphs(device, call)
        forward, compiled = self._forward(module, device, graphs)
        # With top-k/top-p/min-p or a repetition penalty the draw runs eagerly: the compiled pass failed the
        # chi-square test of tests/test_sampling_stats.py on CUDA with filters on (and passed without them).
        sampler = fused_sampler(device, self._use_compile(device) and not call.filters)
        wave = _Wave(call, live, history, torch.zeros((Bw, S), dtype=torch.float32, device=device),
                     torch.zeros((), dtype=torch.long, device=device), P, forward, compiled, sampler,
                     StepGraphs(device) if graphs else None)
        buckets = length_buckets(P, L, self.length_buckets, self.cache_multiple)
        k, t, steps = self.check_every, 0, S
        t0 = self._tick("prefill", t0, device)  # the copy into this wave's cache
        while t < S - 1:
            visible = next(b for b in buckets if b > P + t)  # step t writes slot P + t
            end = min((t // k + 1) * k, S - 1, visible - P)  # the next host check, the last forward, the bucket's end
            wave.live.show(visible)
            t0 = self._steps(wave, t, end - t, t0)
            t = end
            if t % k == 0:
                if self._all_done(wave.live, history, P, t, options):
                    steps = t
                    break
                if self.compact_finished and (fewer := wave.live.compacted()) is not wave.live:
                    wave.live = fewer
                    wave.graphs = StepGraphs(device) if graphs else None  # the old graphs read the old rows
            t0 = self._tick("host_checks", t0, device)
        if t == S - 1:
            self._sample(wave, t)
            self._tick("sample", t0, device)
        return history[:w, P : P + steps], wave.out_logp[:w, :steps], steps

    def _use_step_graphs(self, device: torch.device, call: _Call) -> bool:
        """Whether steps run as step-graph replays: compiled, on CUDA, no filters (they run eagerly), no profile
        (it times each part of a step)."""
        return self.step_graphs and self._use_compile(device) and device.type == "cuda" and not call.filters \
            and not self.profile

    def _steps(self, wave: _Wave, t: int, n: int, t0: float) -> float:
        """Run steps t .. t + n - 1 (each samples and runs the forward); returns the profile clock."""
        device = wave.out_logp.device
        if wave.graphs is None:
            for i in range(n):
                token = self._sample(wave, t + i)
                t0 = self._tick("sample", t0, device)
                self._forward_step(wave, token)
                t0 = self._tick("forward", t0, device)
            return t0
        live = wave.live
        shape = (len(live.index), live.visible)
        if shape not in self._warm:  # compile this shape (and initialize lazily) outside a capture: a real step
            self._forward_step(wave, self._sample(wave, t))
            self._warm.add(shape)
            n -= 1
        step = lambda: self._forward_step(wave, self._sample(wave, None))  # noqa: E731
        if n == self.check_every:
            wave.graphs.run((live.visible,), n, step)
        else:
            for _ in range(n):
                wave.graphs.run((live.visible,), 1, step)
        return t0

    @staticmethod
    def _sample(wave: _Wave, t: int | None) -> torch.Tensor:
        """Sample step `wave.t`'s token of every row, record it and its logprob, mark rows that drew an EOS;
        advances `wave.t`. `t`: the same step on the host (the filters' history; None inside a step graph)."""
        call, live, options = wave.call, wave.live, wave.call.options
        T = options.logp_temperature
        scores = None
        if call.filters:
            hist = wave.history.index_select(0, live.index)[:, : wave.P + t]
            scores = apply_filters(call.filters, hist, live.logits / T)
        token, logp = wave.sampler(live.logits, scores, step_keys(live.keys, wave.t), call.codes, T,
                                   options.temperature == 0)
        token = torch.where(live.done, call.prep.pad_id, token)
        step = wave.t.expand(len(live.index))
        wave.history.index_put_((live.index, step + wave.P), token)
        wave.out_logp.index_put_((live.index, step), logp)
        if call.eos.numel():
            live.done.logical_or_((token[:, None] == call.eos[None, :]).any(1))
        wave.t.add_(1)
        return token

    @staticmethod
    def _forward_step(wave: _Wave, token: torch.Tensor) -> None:
        """The model's forward on the rows' last tokens: writes their keys/values into the cache and the next
        logits into `live.logits`, in place."""
        live = wave.live
        if wave.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were consumed
        out = wave.forward(input_ids=token[:, None], attention_mask=live.visible_mask(), position_ids=live.next_pos,
                           past_key_values=live.cache, use_cache=True, logits_to_keep=1)
        live.logits.copy_(out.logits[:, -1])
        live.next_pos.add_(1)

    def _all_done(self, live: _Rows, history: torch.Tensor, P: int, steps: int, options: SamplingOptions) -> bool:
        """Host check (one sync): mark rows whose text contains a stop string as done; True if all rows are."""
        if options.stop:
            pending = (~live.done).nonzero().flatten().tolist()
            if pending:
                rows = history[live.index[pending], P : P + steps].tolist()
                texts = self.tokenizer.batch_decode(rows, skip_special_tokens=False)
                hit = [b for b, text in zip(pending, texts) if any(s in text for s in options.stop)]
                if hit:
                    live.done[hit] = True
        return bool(live.done.all())
