"""Multi-turn episodes on the static engine with the driver's work overlapped with the decode.

A row whose turn ends is handed to the driver at once (at the next host check, every `check_every` steps) and the
decode goes on for the rows still in their turns; the driver runs the row's tool calls or environment step in its
workers (`episodes.Replies`). At a later host check the rows whose answers came back re-enter the decode: their
[last turn token + observation] is prefilled and they draw the first token of their next turn while the other rows
go on with theirs. A slow environment step thus holds only its own row, not the wave:

    rows:  ─turn─┐ step ┌─turn──┐ step ┌─turn─        (each row at its own turn, its own step of it)
           ───turn────┐ step ┌─turn─┐ step ┌──turn─
    wave:  decode ─ check ─ decode ─ check (re-entry: relayout, prefill, relayout) ─ decode ─ ...

The cache stays laid out as `static_turns` lays it out (each row's real tokens contiguous and right-aligned after
every re-entry, positions = each row's count of real tokens), with one difference: between two relayouts the rows
are at different points of their turns. Every decode step writes one slot of every row; a slot is real for a row
while it is in its turn (the turn's last token is written again with the observation, as in `static_turns`), and
the slots a waiting row wrote are masked out at the next relayout. A row's turn tokens are the last k of its real
slots, so after a relayout ending at E the turn that row is in began at slot E - k.

Determinism: row i draws step t of its turn k with `step_keys(turn_keys(key_i, k), t)` (`TurnStep`, per-row
counters), the keys the turn-by-turn decode uses, so its tokens do not depend on when other rows' answers came
back or when it re-entered; only the layout of the cache (where its slots are) does, which changes sums of zeros
and the order of a few additions in attention (logprobs agree to ~1e-7, tokens are the same).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.profiler import record_function

from .engine import PreparedPrompts, sync, unwrap_model
from .episodes import EpisodeDriver, EpisodeStream, Replies, TurnEnd, finished_records, turn_cap
from .sampling import filtered_draw, rows_step_keys, rows_turn_keys
from .static_rows import DecodeRows
from .static_turns import episode_cache_len, prefill_observations, relayout, turn_length
from .step_graph import DecodeStep, is_stop

DECODE, ENDED, WAIT, DONE = range(4)  # a row in its turn; turn ended, slots not yet masked; waiting; episode over


class TurnStep(DecodeStep):
    """A `DecodeStep` whose rows are each at their own step of their own turn: `t` [b] counts each row's steps
    since its turn began, row i draws with `step_keys(keys[i], t[i])` (`keys`: the rows' turn keys) and writes
    column min(t[i], width) of history / out_logp [b, width + 1] (column `width` takes what rows past their turn
    draw), and a row is done at an end id or once it has drawn `limit[i]` tokens."""

    def __init__(self, forward: Any, draw: Any, cache: Any, *, width: int, **kw: Any) -> None:
        super().__init__(forward, draw, cache, prompt_len=0, **kw)
        self.t = torch.zeros(self.done.shape, dtype=torch.long, device=self.done.device)
        self.width = width

    def _draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draw(logits, rows_step_keys(self.keys, self.t), 0, self.codes, self.T, self.greedy)

    def _emit(self, logits: torch.Tensor) -> None:
        token, logp = self._draw(logits)
        token = torch.where(self.done, self.pad_id, token)
        col = self.t.clamp(max=self.width)[:, None]
        self.history.scatter_(1, col, token[:, None])
        self.out_logp.scatter_(1, col, logp[:, None])
        if self.eos.numel():
            self.done.logical_or_(is_stop(token, self.eos))
        self.done.logical_or_(self.t + 1 >= self.limit)
        self.token.copy_(token)

    def enter(self, logits: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, limits: torch.Tensor) -> None:
        """Rows `rows` [k] begin a turn: their turn keys `keys` [k] and token limits `limits` [k], step 0 drawn from
        `logits` [b, V] (an observation's prefill); the other rows keep their state."""
        self.keys[rows], self.limit[rows], self.t[rows] = keys, limits, 0
        self.history[rows], self.out_logp[rows] = self.pad_id, 0.0
        token, logp = self._draw(logits)
        token, logp = token[rows], logp[rows]
        self.history[rows, 0], self.out_logp[rows, 0], self.token[rows] = token, logp, token
        done = limits <= 1
        if self.eos.numel():
            done = done | is_stop(token, self.eos)
        self.done[rows] = done


def decode_overlapped(engine: Any, module: Any, call: Any, rows: torch.Tensor, prompt_of_row: torch.Tensor,
                      replies: Replies, streams: list[EpisodeStream], draw: Any, t0: float, real: int) -> None:
    """Run the episodes of rows `rows` [w] (one wave; only the first `real` are rows of their own, the others pad
    the wave to the compiled shape) to their end, appending to `streams` (indexed by row), each row's turns
    answered through `replies` while the others decode (see the module doc)."""
    prep, options, device = call.prep, call.options, call.prep.device
    P, S, L, pad = prep.ids.shape[1], options.max_new_tokens, call.cache_len, prep.pad_id
    W = min(turn_cap(replies.driver) or S, S)  # the longest turn
    live = DecodeRows.start(call, prompt_of_row[rows], call.keys[rows], L)
    live.mask[:, P:] = 1
    engine._caches.append(weakref.ref(live.cache))
    t0 = engine._tick("prefill", t0, device)  # the copy into this wave's cache, as in the single-turn decode
    b = len(rows)
    base_keys = live.keys.clone()
    history = torch.full((b, W + 1), pad, dtype=torch.long, device=device)
    out_logp = torch.zeros((b, W + 1), dtype=torch.float32, device=device)
    limit = torch.zeros(b, dtype=torch.long, device=device)
    graph = engine._graph_step(device, call.filters) and device.type == "cuda"
    if call.filters:  # top-k / top-p / min-p, eagerly (they read no earlier tokens)
        draw = filtered_draw(call.filters)
    if graph and device not in engine._streams:
        engine._streams[device] = torch.cuda.Stream(device)
    step = TurnStep(engine._step_forward(module, device, b), draw, live.cache, width=W, mask=live.mask,
                    next_pos=live.next_pos, done=live.done, keys=live.keys, history=history, out_logp=out_logp,
                    pad_id=pad, eos=call.eos, codes=call.codes, temperature=options.logp_temperature,
                    greedy=options.temperature == 0, stream=engine._streams.get(device) if graph else None,
                    limit=limit)
    ends = set(call.eos.tolist())
    stops = list(options.stop) + list(replies.driver.turn_stops)
    row_ids = rows.tolist()
    slot_of = {r: i for i, r in enumerate(row_ids[:real])}
    phase = [DECODE if i < real and not streams[r].done else DONE for i, r in enumerate(row_ids)]
    prompt_len = live.next_pos[:, 0].tolist()
    turn_of, lim, began = [0] * b, [0] * b, [0] * b  # each row's turn, its token limit, the step its turn began
    tb, end_slot = [P] * b, [P] * b  # the slot of the turn's token 0; past the last real slot of a turn that ended
    start = pos = P  # the last relayout's end; the cache's write position
    steps = 0  # decode steps of the wave
    entering: dict[int, list[int]] = {}  # rows whose answers came back: the ids to prefill

    def begin(idx: list[int], logits: torch.Tensor) -> None:
        """Rows `idx` begin their next turn at slot `start`, drawing its first token from `logits`."""
        for i in idx:
            phase[i], lim[i], began[i], tb[i] = DECODE, min(W, S - len(streams[row_ids[i]].ids)), steps, start
        sel = torch.tensor(idx, device=device)
        keys = rows_turn_keys(base_keys[sel], torch.tensor([turn_of[i] for i in idx], device=device))
        step.enter(logits, sel, keys, torch.tensor([lim[i] for i in idx], device=device))

    live.done.fill_(True)
    if DECODE in phase:
        begin([i for i in range(b) if phase[i] == DECODE], live.logits)
    try:
        while True:
            decoding, turns = [i for i in range(b) if phase[i] == DECODE], []
            if decoding:  # to the next host check, or until every decoding row has reached its limit
                most = max(lim[i] - 1 - (steps - began[i]) for i in decoding)
                for _ in range(max(0, min(engine.check_every, most))):
                    step.advance()
                    steps, pos = steps + 1, pos + 1
                t0 = engine._tick("step", t0, device)
                with record_function("episode.turn_host"):
                    turns = _ended_turns(engine, step, decoding, phase, lim, began, steps, streams, row_ids, ends,
                                         stops, W, S)
                for te in turns:
                    i = slot_of[te.row]
                    end_slot[i] = tb[i] + len(te.ids) - 1
                t0 = engine._tick("turn_host", t0, device)
            with record_function("episode.respond"):
                replies.submit(turns)
                idle = DECODE not in phase and not entering and replies.in_flight > 0
                for te, reply in replies.ready(wait=idle):
                    i, s = slot_of[te.row], streams[te.row]
                    if reply is None or te.room <= 0:
                        s.done, phase[i] = True, DONE
                        s.truncated = s.truncated or te.ended == "budget" or (reply is not None and te.room <= 0)
                        continue
                    s.add(reply[: te.room], None, env=True)
                    if len(reply) >= te.room:  # no room left for the model: the episode ends with the observation cut
                        s.done, s.truncated, phase[i] = True, True, DONE
                        continue
                    entering[i] = [te.ids[-1], *reply]
            t0 = engine._tick("respond", t0, device)
            if entering:
                with record_function("episode.observation"):
                    start = _reenter(module, live, phase, tb, end_slot, entering, streams, row_ids, prompt_len,
                                     start, pos, pad)
                    pos = start
                    for i in entering:
                        turn_of[i] += 1
                    begin(list(entering), live.logits)
                    entering.clear()
                t0 = engine._tick("observation", t0, device)
            elif DECODE not in phase and replies.in_flight == 0:
                break
    finally:
        step.release()
    for r in row_ids[:real]:
        streams[r].done = True



def stop_string_done(engine: Any, step: Any, rows: list[int], began: list[int], steps: int,
                     stops: list[str] | None) -> list[bool]:
    """Host check (one sync): `step.done` as a list, with the rows among `rows` whose text since their column
    `began[row]` holds a stop string marked done (on the device too)."""
    done = step.done.tolist()
    if stops:
        going = [i for i in rows if not done[i]]
        if going:
            drawn = step.history[going].tolist()
            texts = engine.tokenizer.batch_decode([drawn[k][: steps - began[i] + 1] for k, i in enumerate(going)],
                                                  skip_special_tokens=False)
            hit = [i for i, text in zip(going, texts) if any(s in text for s in stops)]
            if hit:
                step.done[hit] = True
                for i in hit:
                    done[i] = True
    return done

def _ended_turns(engine: Any, step: TurnStep, decoding: list[int], phase: list[int], lim: list[int],
                 began: list[int], steps: int, streams: list[EpisodeStream], row_ids: list[int], ends: set[int],
                 stops: list[str], W: int, S: int) -> list[TurnEnd]:
    """Host check (one sync): the turns of `decoding` rows that ended (an end id, a stop string in the turn's text,
    the turn's limit), their tokens added to the streams and their rows marked ENDED."""
    done = stop_string_done(engine, step, decoding, began, steps, stops)  # (later draws are cut off below)
    over = [i for i in decoding if done[i]]
    if not over:
        return []
    drawn, logps = step.history[over].tolist(), step.out_logp[over].tolist()
    turns = []
    for k, i in enumerate(over):
        r = row_ids[i]
        n_drawn = min(steps - began[i] + 1, lim[i])
        n, why = turn_length(drawn[k][:n_drawn], ends, stops, n_drawn, engine.tokenizer)
        if why == "length" and lim[i] < W and n == lim[i]:
            why = "budget"
        streams[r].add(drawn[k][:n], logps[k][:n], env=False)
        turns.append(TurnEnd(r, drawn[k][:n], why, S - len(streams[r].ids)))
        phase[i] = ENDED
    return turns


def _reenter(module: Any, live: DecodeRows, phase: list[int], tb: list[int], end_slot: list[int],
             entering: dict[int, list[int]], streams: list[EpisodeStream], row_ids: list[int],
             prompt_len: list[int], start: int, pos: int, pad: int) -> int:
    """Mask every row's slots from `start` to the write position `pos` to its real ones, right-align them, prefill
    `entering`'s ids (their logits into `live.logits`), right-align again; the rows still in their turns get their
    turn's new first slot in `tb`, rows that ended their turns become WAIT. Returns the new end of the layout."""
    device = live.mask.device
    real_end = [pos if p == DECODE else end_slot[i] if p == ENDED else start for i, p in enumerate(phase)]
    span = torch.arange(start, pos, device=device)[None, :]
    live.mask[:, start:pos] = (span < torch.tensor(real_end, device=device)[:, None]).to(live.mask.dtype)
    fed = {i: pos - tb[i] for i, p in enumerate(phase) if p == DECODE}  # each decoding row's turn tokens so far
    for i, p in enumerate(phase):
        if p == ENDED:
            phase[i] = WAIT
    end = relayout(live.cache, live.mask, pos)
    # each entering row's next position is that of its turn's last token, the first of its input
    pos_in = [prompt_len[i] + len(streams[row_ids[i]].ids) - len(v) for i, v in entering.items()]
    live.next_pos[list(entering), 0] = torch.tensor(pos_in, device=device)
    live.logits = prefill_observations(module, live.cache, live.mask, live.next_pos, end, entering, pad)
    new = relayout(live.cache, live.mask, end + max(len(v) for v in entering.values()))
    live.mask[:, new:] = 1
    for i, k in fed.items():
        tb[i] = new - k
    return new


def generate_episodes(engine: Any, prep: PreparedPrompts, options: Any,
                      driver: EpisodeDriver) -> tuple[list[EpisodeStream], list[Any], float]:
    """`StaticEngine.generate` with `episodes=driver`: the B = n·G episodes (see the module doc) as (the rows'
    streams, the driver's records, the decode's seconds), which `episodes.episode_batch` makes a batch of."""
    module, device = engine.weights.module, prep.device
    G, (n, P), S = options.num_generations, prep.ids.shape, options.max_new_tokens
    B = n * G
    driver.begin(B, G)
    streams = [EpisodeStream() for _ in range(B)]
    sync(device)
    tg = time.perf_counter()
    call, prompt_of_row = engine._start_call(module, prep, options, episode_cache_len(P, S, engine.cache_multiple),
                                             extra_eos=list(driver.turn_end_ids))
    wave = engine._wave_size(call, B)
    draw = engine._draw(device)
    replies = Replies(driver, unwrap_model(module).get_input_embeddings().weight.shape[0])
    for r0 in range(0, B, wave):
        rows = torch.arange(r0, min(r0 + wave, B), device=device)
        real = len(rows)
        if engine._use_compile(device) and real < wave:  # every wave one compiled shape: pad with inactive rows
            rows = torch.cat([rows, rows[-1:].expand(wave - real)])
        decode_overlapped(engine, module, call, rows, prompt_of_row, replies, streams, draw, time.perf_counter(), real)
    sync(device)
    gen_s = time.perf_counter() - tg
    del call
    return streams, finished_records(driver, B), gen_s
