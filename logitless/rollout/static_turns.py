"""Multi-turn episodes on the static engine: the KV cache lives across turns, observations are prefilled into it.

`StaticEngine.generate(prompts, options, episodes=driver)` runs here (the protocol is `episodes.py`). Per wave of
rows, one decode cache and one `DecodeStep` serve every turn:

    prefill prompts ─► decode turn (the step, replayed; rows end at EOS / turn-end id / stop / budget)
                    ─► driver.respond(turns) ─► relayout ─► prefill [last turn token + observation] ─► relayout
                    ─► decode next turn ─► ...                       (rows whose episode ended stay, as padding)

Nothing is re-prefilled: an observation's tokens are the only new prefill. The layout keeps every row's real
tokens contiguous and right-aligned in the cache slots (left padding only, as after a prompt prefill), so
sliding-window and chunked layers see the distances a full forward of the sequence sees:
- a turn's tokens past a row's end (padding, or tokens drawn after a stop string before the host saw it) are
  masked out, and so is the turn's last token, which the observation's prefill writes again with the
  observation (a row that ended at the turn's last step has not written it yet);
- `relayout` then moves each row's visible slots to the right end of one common length, before the observation
  prefill (rows ended their turns at different steps) and after it (observations have different lengths and
  are right-padded).
Positions are each row's count of real tokens, as in the trainer's forward (`position_ids = cumsum(mask) - 1`).
An episode's cache holds P + 2·S + 1 slots per row (S = `max_new_tokens`, the episode budget): the right-aligned
rows fill at most P + S slots, and a turn or an observation adds at most S more before the next relayout.

The draw of turn k uses the row keys folded with k (`sampling.turn_keys`; turn 0 is the single-turn draw), so a
seed gives the same episodes whatever the wave split. Repetition penalty needs the whole sequence's tokens and is
refused here (use the hf backend); top-k / top-p / min-p are drawn eagerly, without the step graph.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from logitless.models import UnsupportedModelError
from logitless.models.lm_head import decoder_body, lm_head_of

from .engine import PreparedPrompts, _stop_cut, sync, unwrap_model
from .episodes import EpisodeDriver, EpisodeStream, TurnEnd, checked_replies, finished_records, turn_cap
from .kv_cache import set_visible
from .sampling import apply_filters, sample_tokens, step_keys, turn_keys
from .static_rows import DecodeRows, mark_stopped
from .step_graph import DecodeStep


VISIBLE_MULTIPLE = 64  # the slots an observation's prefill reads are rounded up to this


def episode_cache_len(P: int, S: int, multiple: int) -> int:
    """Slots per row of an episode's decode cache: P + 2·S + 1 rounded up to `multiple` (see the module doc)."""
    return -(-(P + 2 * S + 1) // multiple) * multiple


def check_episode_options(engine: Any, options: Any, driver: Any) -> None:
    """Refuse, before anything runs, what the static engine cannot do in episodes."""
    if not isinstance(driver, EpisodeDriver):
        raise TypeError(f"episodes={type(driver).__name__} does not implement logitless.rollout.episodes.EpisodeDriver")
    if options.repetition_penalty != 1.0:
        raise ValueError("rollout.repetition_penalty penalizes every earlier token of the episode, which the static "
                         "engine's multi-turn decode does not track: unset rollout.repetition_penalty, or use "
                         "rollout.backend=hf")
    if engine.length_buckets != 1 or engine.compact_finished:
        raise ValueError("multi-turn episodes on the static engine decode every turn over one cache layout: set "
                         "rollout.length_buckets=1 and rollout.compact_finished=false")
    if engine.step_graph is True and (options.top_k or options.top_p < 1.0 or options.min_p):
        raise ValueError("rollout.step_graph=true draws with the fused sampler, but this call samples with "
                         "top-k/top-p/min-p: unset those sampling options, or unset rollout.step_graph")


@torch.no_grad()
def relayout(cache: Any, mask: torch.Tensor, upto: int) -> int:
    """Move each row's visible slots among the first `upto` (mask 1), in order, to the right end of [0, E), E =
    the most visible slots of any row; mask becomes 1 exactly there below E (slots from E on are left as they
    are); every layer's write position becomes E. Returns E. Where every visible slot is in place already, no
    key or value moves."""
    vis = mask[:, :upto].bool()  # [b, upto]
    n = vis.sum(1)  # [b]
    E = int(n.max())
    order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)  # [b, upto] visible slots first, in order
    slot = torch.arange(E, device=mask.device)[None, :]
    k = slot - (E - n)[:, None]  # [b, E] rank among the row's visible
    src = order.gather(1, k.clamp(min=0))  # [b, E] the slot each destination slot takes
    moves = bool(((src != slot) & (k >= 0)).any())  # else every visible slot is in place (equal turns, observations)
    for layer in cache.layers:
        for buf in (layer.keys, layer.values) if moves else ():  # [b, kv, L, d]
            b, h, _, d = buf.shape
            buf[:, :, :E].copy_(buf.gather(2, src[:, None, :, None].expand(b, h, E, d)))
        layer.cumulative_length.fill_(E)
    mask[:, :E] = (k >= 0).to(mask.dtype)
    return E


def _body_and_head(module: Any) -> tuple[Any, Any] | None:
    """The decoder body and the lm_head `prefill_observations` applies by hand, or None where the model's own
    forward must give the logits: a model the fused op cannot describe, or a head split over a tensor-parallel
    group (a DTensor weight, whose hooks give this rank's vocabulary columns)."""
    try:
        body, head = decoder_body(module), lm_head_of(module)
    except UnsupportedModelError:
        return None
    return None if hasattr(head.weight, "device_mesh") else (body, head)


def prefill_observations(module: Any, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, start: int,
                         inputs: dict[int, list[int]], pad_id: int) -> torch.Tensor:
    """Write the rows' `inputs` (right-padded to the longest) into slots [start, start + m) of the cache, return
    the fp32 logits [b, V] after each row's last input token (zeros for rows without input); `mask` and
    `next_pos` [b, 1] are updated in place. Attention reads the first start + m slots (rounded up to
    VISIBLE_MULTIPLE), not the whole cache: the later ones are hidden by causality."""
    b, device = mask.shape[0], mask.device
    m = max(len(v) for v in inputs.values())
    ids = torch.full((b, m), pad_id, dtype=torch.long)
    lens = torch.zeros(b, dtype=torch.long)
    for i, v in inputs.items():
        ids[i, : len(v)] = torch.tensor(v, dtype=torch.long)
        lens[i] = len(v)
    ids, lens = ids.to(device), lens.to(device)
    block = (torch.arange(m, device=device)[None, :] < lens[:, None]).to(mask.dtype)  # [b, m]
    mask[:, start : start + m] = block
    mask[:, start + m :] = 1  # later slots: hidden by causality
    positions = next_pos + torch.arange(m, device=device)[None, :]  # [b, m]
    last = (lens - 1).clamp(min=0)
    parts = _body_and_head(module)
    L = mask.shape[1]
    upto = min(L, -(-(start + m) // VISIBLE_MULTIPLE) * VISIBLE_MULTIPLE)  # attention reads the filled slots only
    seen = mask[:, :upto]
    set_visible(cache, upto)
    try:
        if parts is not None:  # the body, then (h Wᵀ + bias) × the logit multiplier at each row's last input token
            body, head = parts
            out = body(input_ids=ids, attention_mask=seen, position_ids=positions, past_key_values=cache,
                       use_cache=True)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [b, m, H]
            last_hidden = hidden[torch.arange(b, device=device), last].to(head.weight.dtype)
            logits = F.linear(last_hidden, head.weight, head.bias).float() * head.logit_multiplier
        else:  # the model's own logits, all positions
            out = module(input_ids=ids, attention_mask=seen, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=m)
            logits = out.logits[torch.arange(b, device=device), last].float()
    finally:
        set_visible(cache, L)  # the decode step reads every slot (its graph was captured so)
    next_pos.add_(lens[:, None])
    return logits * (lens > 0)[:, None]


def turn_length(ids: list[int], ends: set[int], stops: list[str], limit: int, tokenizer: Any) -> tuple[int, str]:
    """How many of a row's drawn turn tokens `ids` the turn keeps, and why it ended: the first EOS / turn-end id
    (kept), the token completing a stop string, else `limit` tokens."""
    n = next((k + 1 for k, t in enumerate(ids[:limit]) if t in ends), None)
    if n is not None:
        return n, "eos"
    cut = _stop_cut(tokenizer, ids[:limit], stops) if stops else None
    if cut is not None:
        return cut, "stop"
    return limit, "length"


def decode_episodes(engine: Any, module: Any, call: Any, rows: torch.Tensor, prompt_of_row: torch.Tensor,
                    driver: EpisodeDriver, streams: list[EpisodeStream], draw: Any, t0: float, real: int) -> None:
    """Run the episodes of rows `rows` [w] (one wave; only the first `real` are rows of their own, the others pad
    the wave to the compiled shape) to their end, appending to `streams` (indexed by row)."""
    prep, options, device = call.prep, call.options, call.prep.device
    P, S, L, pad = prep.ids.shape[1], options.max_new_tokens, call.cache_len, prep.pad_id
    W = min(turn_cap(driver) or S, S)  # the longest turn
    vocab = unwrap_model(module).get_input_embeddings().weight.shape[0]
    src = prompt_of_row[rows]
    live = DecodeRows.start(call, src, call.keys[rows], L)
    live.mask[:, P:] = 1
    engine._caches.append(weakref.ref(live.cache))
    t0 = engine._tick("prefill", t0, device)  # the copy into this wave's cache, as in the single-turn decode
    b = len(rows)
    base_keys = live.keys.clone()
    history = torch.full((b, W), pad, dtype=torch.long, device=device)
    out_logp = torch.zeros((b, W), dtype=torch.float32, device=device)
    limit = torch.zeros(b, dtype=torch.long, device=device)
    graph = engine._graph_step(device, call.filters) and device.type == "cuda"
    if call.filters:  # top-k / top-p / min-p, eagerly (they read no earlier tokens)
        def draw(logits, keys, t, codes, T, greedy, _f=call.filters):  # noqa: F811
            scores = apply_filters(_f, None, logits.float() / T)
            return sample_tokens(logits, scores, step_keys(keys, t), codes, T, greedy)
    if graph and device not in engine._streams:
        engine._streams[device] = torch.cuda.Stream(device)
    step = DecodeStep(engine._step_forward(module, device, b), draw, live.cache, mask=live.mask,
                      next_pos=live.next_pos, done=live.done, keys=live.keys, history=history, out_logp=out_logp,
                      prompt_len=0, pad_id=pad, eos=call.eos, codes=call.codes, temperature=options.logp_temperature,
                      greedy=options.temperature == 0, stream=engine._streams.get(device) if graph else None,
                      limit=limit)
    ends = set(call.eos.tolist())
    stops = list(options.stop) + list(driver.turn_stops)
    row_ids = rows.tolist()
    slot_of = {r: i for i, r in enumerate(row_ids[:real])}
    active = [i < real and not streams[r].done for i, r in enumerate(row_ids)]
    prompt_len = live.next_pos[:, 0].tolist()
    logits, start, turn = live.logits, P, 0
    try:
        while any(active):
            rooms = [S - len(streams[r].ids) for r in row_ids]
            lim = [min(W, room) if a else 0 for a, room in zip(active, rooms)]
            limit.copy_(torch.tensor(lim))
            live.done.copy_(limit == 0)
            history.fill_(pad)
            step.t.zero_()
            live.keys.copy_(turn_keys(base_keys, turn))
            step.first(logits)
            steps = 1
            for t in range(1, max(lim)):
                if t % engine.check_every == 0 and mark_stopped(live, history, 0, t, stops, engine.tokenizer):
                    break
                step.advance()
                steps = t + 1
            t0 = engine._tick("step", t0, device)
            with record_function("episode.turn_host"):  # the turn's tokens into the streams, on the host
                drawn, logps = history[:, :steps].tolist(), out_logp[:, :steps].tolist()
                turns, kept = [], torch.zeros(b, dtype=torch.long)
                for i, r in enumerate(row_ids):
                    if not active[i]:
                        continue
                    n, why = turn_length(drawn[i], ends, stops, min(lim[i], steps), engine.tokenizer)
                    if why == "length" and lim[i] < W and n == lim[i]:
                        why = "budget"
                    streams[r].add(drawn[i][:n], logps[i][:n], env=False)
                    kept[i] = n - 1  # in the cache (the last token is written again with the observation)
                    turns.append(TurnEnd(r, drawn[i][:n], why, S - len(streams[r].ids)))
                slots = torch.arange(L - start, device=device)[None, :] < kept.to(device)[:, None]
                live.mask[:, start:] = slots.to(live.mask.dtype)
            t0 = engine._tick("turn_host", t0, device)
            with record_function("episode.respond"):
                replies = checked_replies(driver.respond(turns), turns, vocab) if turns else []
            t0 = engine._tick("respond", t0, device)
            inputs: dict[int, list[int]] = {}
            for te, reply in zip(turns, replies):
                i, s = slot_of[te.row], streams[te.row]
                if reply is None or te.room <= 0:
                    s.done, active[i] = True, False
                    s.truncated = s.truncated or te.ended == "budget" or (reply is not None and te.room <= 0)
                    continue
                s.add(reply[: te.room], None, env=True)
                if len(reply) >= te.room:  # no room left for the model: the episode ends with the observation cut
                    s.done, s.truncated, active[i] = True, True, False
                    continue
                inputs[i] = [te.ids[-1], *reply]
            if not inputs:
                break
            # each row's next position is that of its turn's last token, the first of its input
            pos = [prompt_len[i] + len(streams[row_ids[i]].ids) - len(v) for i, v in inputs.items()]
            live.next_pos[list(inputs), 0] = torch.tensor(pos, device=device)
            with record_function("episode.observation"):
                end = relayout(live.cache, live.mask, start + steps - 1)
                logits = prefill_observations(module, live.cache, live.mask, live.next_pos, end, inputs, pad)
                start = relayout(live.cache, live.mask, end + max(len(v) for v in inputs.values()))
                live.mask[:, start:] = 1
            t0 = engine._tick("observation", t0, device)
            turn += 1
    finally:
        step.release()
    for r in row_ids[:real]:
        streams[r].done = True


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
    for r0 in range(0, B, wave):
        rows = torch.arange(r0, min(r0 + wave, B), device=device)
        real = len(rows)
        if engine._use_compile(device) and real < wave:  # every wave one compiled shape: pad with inactive rows
            rows = torch.cat([rows, rows[-1:].expand(wave - real)])
        decode_episodes(engine, module, call, rows, prompt_of_row, driver, streams, draw, time.perf_counter(), real)
    sync(device)
    gen_s = time.perf_counter() - tg
    del call
    return streams, finished_records(driver, B), gen_s
