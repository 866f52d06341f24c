"""Refill: the static engine's decode when the KV budget holds fewer rows than the call has.

Waves (`StaticEngine._decode_wave`, `static_waves.py`) decode the rows in groups of as many rows as the budget
holds, and a wave lasts as long as its longest row: with long-tailed completion lengths most of a wave's rows sit
finished while a few run on. Here the budget's rows are decode *slots* instead: a slot whose row ended (EOS, its token limit, a
stop string), seen at a host check every `check_every` steps, takes the next pending row at once, and the call
ends when the last row does:

    waves:   ──row 0──────────┐ idle ┐           refill:  ──row 0──┬──row 3──────────┬─row 5─
             ──row 1─┐ idle   │      │ wave 2             ──row 1──┴─row 4─┬─row 6──┐
             ──row 2────────────────┘├──row 3 ...         ──row 2──────────┴─row 7──┴─ ...

Exactness: a row's tokens and logprobs are those of the waves (on CPU: the same tokens, logprobs to fp32
rounding), because what a row computes depends on nothing but its own slot's state, laid out as in a wave:
- every row draws step t with `step_keys(key, t)` of its own counter-based stream (`RefillStep`, a `TurnStep`:
  per-row step counters inside one step), whatever step of the call it entered at;
- each slot writes its token t's key/value at cache slot P + t of its own row (`kv_cache.RowSlotLayer`: a per-row
  write position), after the prompt's keys/values copied from the call's shared prefill into slots [0, P) when
  the row enters (`kv_cache.load_prompts`), so a row's cache is a wave row's; its attention mask is its prompt's
  and, set by the step before each forward, its own written slots: exactly the slots a wave row sees (the
  slots its slot's earlier rows wrote stay masked).
The step keeps one shape (the slot count), so on CUDA it is one graph captured once per call and replayed for
every step, whichever rows the slots hold.

Refill needs full-attention layers (a sliding window or chunk is measured from one query offset for all rows),
one length bucket, no compaction, no repetition penalty (it reads each row's whole history), no route recording
and no tensor-parallel vocabulary split; `rollout.refill` (None) turns it on wherever it applies and the call's
draw is the fused one (no top-k/top-p/min-p), true asks for it (top-k/top-p/min-p drawn eagerly) and refuses what
rules it out, false keeps the waves.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any

import torch

from .kv_cache import decode_cache, load_prompts
from .sampling import filtered_draw
from .static_overlap import TurnStep, stop_string_done
from .static_rows import DecodeCall
from .step_graph import is_stop


class RefillStep(TurnStep):
    """A `TurnStep` whose rows are single-turn completions of prompts padded to `base` tokens: before each forward
    a row's write slot `slot` [b] becomes base + t[i] (the cache's `RowSlotLayer`s read it; rows past their end
    keep writing their own last slot) and that slot turns visible in its mask row; the position of a finished row
    stops at `max_pos` (it may step on for longer than any completion while others finish)."""

    def __init__(self, *args: Any, base: int, slot: torch.Tensor, max_pos: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.base, self.slot, self.max_pos = base, slot, max_pos

    def body(self) -> None:
        self.slot.copy_((self.t + self.base).clamp(max=self.mask.shape[1] - 1))
        self.mask.scatter_(1, self.slot[:, None], 1)
        self.next_pos.clamp_(max=self.max_pos)
        super().body()

    def enter(self, logits: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, limits: torch.Tensor) -> None:
        """Slots `rows` [k] take new rows: their stream keys `keys` [k] and token limits `limits` [k], step 0 drawn
        from `logits` [k, V] (their prompts' prefill logits)."""
        self.keys[rows], self.limit[rows], self.t[rows] = keys, limits, 0
        self.history[rows], self.out_logp[rows] = self.pad_id, 0.0
        token, logp = self.draw(logits, keys, 0, self.codes, self.T, self.greedy)
        self.history[rows, 0], self.out_logp[rows, 0], self.token[rows] = token, logp, token
        done = limits <= 1
        if self.eos.numel():
            done = done | is_stop(token, self.eos)
        self.done[rows] = done


def refill_blockers(engine: Any, call: DecodeCall | None = None) -> list[str]:
    """What rules refill out for `engine` (and, given, this call), each as the setting to change; [] if nothing."""
    why = []
    if not engine.full_attention_only:
        why.append("a model with sliding-window or chunked attention layers (use rollout.refill=false)")
    if engine.length_buckets != 1:
        why.append("rollout.length_buckets=1")
    if engine.compact_finished:
        why.append("rollout.compact_finished=false")
    if engine.record_routes:
        why.append("model.routing_replay=false (routes are recorded per wave)")
    if engine.vocab_shard is not None:
        why.append("rollout.tensor_parallel=1")
    if call is not None and call.options.repetition_penalty != 1.0:
        why.append("rollout.repetition_penalty=1.0")
    return why


def use_refill(engine: Any, call: DecodeCall, slots: int, B: int) -> bool:
    """Whether this call's B rows decode through `slots` refilled slots rather than waves of `slots` rows (see the
    module doc): never when one wave holds them all; with `engine.refill` None off CUDA wherever nothing rules it out
    and the draw is the fused one; True (on CUDA too): wherever nothing rules it out, raising ValueError naming
    what does."""
    if slots >= B or engine.refill is False:
        return False
    why = refill_blockers(engine, call)
    if engine.refill is True:
        if why:
            raise ValueError(f"rollout.refill=true refills decode slots as rows end, which needs {'; '.join(why)}; "
                             "or unset rollout.refill (waves)")
        return True
    # None on CUDA: waves until the captured refill step has run on a GPU against them (its GPU test,
    # tests/test_rollout_refill.py -m gpu, has not passed yet; bench/LOG.md); rollout.refill=true opts in
    return not why and not call.filters and call.prep.device.type != "cuda"


def decode_refill(engine: Any, module: Any, call: DecodeCall, prompt_of_row: torch.Tensor, slots: int,
                  limits: torch.Tensor, completion: torch.Tensor, logps: torch.Tensor, lens: torch.Tensor) -> int:
    """Decode every row of the call through `slots` decode slots refilled as rows end (see the module doc),
    writing each row's tokens, logprobs and drawn count into `completion` / `logps` [B, S] and `lens` [B] (host)
    as it ends. limits: [B] long, the tokens each row may draw (max_new_tokens, or a planted length). Returns the
    decode steps run."""
    prep, options, device = call.prep, call.options, call.prep.device
    P, S, L, B, pad = prep.ids.shape[1], options.max_new_tokens, call.cache_len, len(prompt_of_row), prep.pad_id
    t0 = time.perf_counter()
    first = torch.arange(slots, device=device)
    src = prompt_of_row[first]
    slot = torch.full((slots,), P, dtype=torch.long, device=device)
    cache = decode_cache(call.prefill, src, L, slot=slot)
    engine._caches.append(weakref.ref(cache))
    mask = torch.zeros((slots, L), dtype=torch.long, device=device)
    mask[:, :P] = prep.mask[src]
    real = call.start_positions()  # [n] each prompt's first completion position (its count of real tokens)
    last = P if call.start is None else int(real.max())  # the latest of them (M-RoPE: after the image positions)
    history = torch.full((slots, S + 1), pad, dtype=torch.long, device=device)
    draw = filtered_draw(call.filters) if call.filters else engine._draw(device)
    graph = not call.filters and engine._graph_step(device, []) and device.type == "cuda"
    if graph and device not in engine._streams:
        engine._streams[device] = torch.cuda.Stream(device)
    step = RefillStep(engine._step_forward(module, device, slots), draw, cache, width=S, mask=mask,
                      next_pos=real[src][:, None].clone(), done=torch.zeros(slots, dtype=torch.bool, device=device),
                      keys=call.keys[first].clone(), history=history,
                      out_logp=torch.zeros((slots, S + 1), dtype=torch.float32, device=device), pad_id=pad,
                      eos=call.eos, codes=call.codes, temperature=options.logp_temperature,
                      greedy=options.temperature == 0, stream=engine._streams.get(device) if graph else None,
                      limit=limits[first].clone(), base=P, slot=slot, max_pos=last + S - 1)
    host_limits = limits.tolist()
    row_of, began = list(range(slots)), [0] * slots  # each slot's row (-1: none), the step it entered at
    pending = deque(range(slots, B))
    step.enter(call.first_logits[src], first, step.keys[first].clone(), step.limit[first].clone())
    t0 = engine._tick("prefill", t0, device)
    steps = 0
    try:
        while True:
            ended = _ended(engine, step, row_of, began, steps, options.stop)
            if ended:  # copy the ended rows out, then give their slots the next pending rows
                idx = torch.tensor(ended, device=device)
                ids, lp = step.history[idx].cpu(), step.out_logp[idx].cpu()
                for k, j in enumerate(ended):
                    r, n = row_of[j], min(steps - began[j] + 1, host_limits[row_of[j]], S)
                    completion[r, :n], logps[r, :n], lens[r] = ids[k, :n], lp[k, :n], n
                    row_of[j] = -1
                take = ended[: len(pending)]
                if take:
                    rows = [pending.popleft() for _ in take]
                    for j, r in zip(take, rows):
                        row_of[j], began[j] = r, steps
                    rows_t = torch.tensor(rows, device=device)
                    _enter(call, step, cache, real, torch.tensor(take, device=device), rows_t, prompt_of_row[rows_t],
                           limits[rows_t], P)
                t0 = engine._tick("refill", t0, device)
            live = [j for j in range(slots) if row_of[j] >= 0]
            if not live:
                break
            # to the next host check, or until every row's limit (a row is done once it has drawn its limit)
            most = max(min(host_limits[row_of[j]], S) - 1 - (steps - began[j]) for j in live)
            for _ in range(max(1, min(engine.check_every, most))):
                step.advance()
                steps += 1
            t0 = engine._tick("step", t0, device)
    finally:
        step.release()
    return steps


def _enter(call: DecodeCall, step: RefillStep, cache: Any, real: torch.Tensor, slots: torch.Tensor,
           rows: torch.Tensor, src: torch.Tensor, limits: torch.Tensor, P: int) -> None:
    """Slots `slots` [k] begin rows `rows` [k] of prompts `src` [k] with token limits `limits` [k]: the prompts'
    keys/values and mask, positions, stream keys and limits, and step 0 drawn from the prompts' prefill logits."""
    load_prompts(cache, call.prefill, slots, src)
    step.mask[slots] = 0
    step.mask[slots, :P] = call.prep.mask[src]
    step.next_pos[slots, 0] = real[src]
    step.enter(call.first_logits[src], slots, call.keys[rows], limits)


def _ended(engine: Any, step: RefillStep, row_of: list[int], began: list[int], steps: int, stops: Any) -> list[int]:
    """Host check (one sync): the slots whose rows ended (done on the device, or a stop string in their text,
    which marks them done)."""
    slots = [j for j, r in enumerate(row_of) if r >= 0]
    done = stop_string_done(engine, step, slots, began, steps, stops)
    return [j for j in slots if done[j]]
