"""The static engine's waves: a wave's rows decoded together until every one has ended, one step at a time
(`eager_steps`: the forward alone compiled, if at all; filters, length buckets and compaction) or through one
captured `DecodeStep` (`graph_steps`). `StaticEngine._decode_wave` sets a wave up and calls one of them; a wave lasts
as long as its longest row (`static_refill.py` refills slots instead where it applies)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from logitless.models.routing import RouteSink

from .sampling import apply_filters, sample_tokens, step_keys
from .static_rows import DecodeCall, DecodeRows
from .step_graph import DecodeStep, is_stop
from .vocab_split import whole_logits


def eager_steps(engine: Any, live: DecodeRows, call: DecodeCall, history: torch.Tensor, out_logp: torch.Tensor,
                 draw: Any, forward: Callable, compiled: bool, buckets: list[int], sink: RouteSink | None,
                 t0: float, limit: torch.Tensor) -> int:
    """The wave's decode one step at a time (the forward alone compiled, if at all); returns the steps decoded.
    `sink`: where the routers write the routes of the token each forward feeds (its rows follow compaction)."""
    prep, options, device = call.prep, call.options, call.prep.device
    P, S = prep.ids.shape[1], options.max_new_tokens
    steps, T, greedy = 0, options.logp_temperature, options.temperature == 0
    for t in range(S):
        if call.filters:  # eager: the compiled pass failed the chi-square test with filters on (see above)
            hist = history.index_select(0, live.index)[:, : P + t]
            logits = live.logits if engine.vocab_shard is None else whole_logits(engine.vocab_shard, live.logits)
            scores = apply_filters(call.filters, hist, logits.float() / T)
            token, logp = sample_tokens(logits, scores, step_keys(live.keys, t), call.codes, T, greedy)
        else:
            token, logp = draw(live.logits, live.keys, t, call.codes, T, greedy)
        token = torch.where(live.done, prep.pad_id, token)
        history[live.index, P + t] = token
        out_logp[live.index, t] = logp
        if call.eos.numel():
            live.done = live.done | is_stop(token, call.eos)
        live.done = live.done | (t + 1 >= limit[live.index])
        t0 = engine._tick("sample", t0, device)
        steps = t + 1
        if t + 1 == S:
            break
        if (t + 1) % engine.check_every == 0:
            if engine._all_done(live, history, P, steps, options):
                break
            if engine.compact_finished:
                live, token = live.compacted(token)
                engine._caches.append(weakref.ref(live.cache))
                if sink is not None:
                    sink.rows = live.index
        t0 = engine._tick("host_checks", t0, device)
        live.show(next(b for b in buckets if b > P + t))  # this step writes slot P + t
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were consumed
        if sink is not None:
            sink.step.fill_(t)  # this forward feeds token t
        live.logits = forward(input_ids=token[:, None], attention_mask=live.visible_mask(),
                              position_ids=live.next_pos, past_key_values=live.cache, use_cache=True,
                              logits_to_keep=1).logits[:, -1]
        live.next_pos = live.next_pos + 1
        t0 = engine._tick("forward", t0, device)
    return steps

def graph_steps(engine: Any, module: Any, call: DecodeCall, live: DecodeRows, history: torch.Tensor, out_logp: torch.Tensor,
                 draw: Any, t0: float, sink: RouteSink | None = None, limit: torch.Tensor | None = None) -> int:
    """The wave's decode through one `DecodeStep` (rows never compacted: row i is row i of the outputs);
    returns the steps decoded. Step 0 is drawn from the prefill's fp32 logits, every later one by the step.
    `sink`: its step becomes the step's own counter (the forward of step t + 1 feeds token t, before the
    counter moves on), read on the device inside the captured step."""
    prep, options, device = call.prep, call.options, call.prep.device
    P, S, Bw = prep.ids.shape[1], options.max_new_tokens, len(live.index)
    if device.type == "cuda" and device not in engine._streams:
        engine._streams[device] = torch.cuda.Stream(device)
    step = DecodeStep(engine._step_forward(module, device, Bw), draw, live.cache, mask=live.mask,
                      next_pos=live.next_pos, done=live.done, keys=live.keys, history=history,
                      out_logp=out_logp, prompt_len=P, pad_id=prep.pad_id, eos=call.eos, codes=call.codes,
                      temperature=options.logp_temperature, greedy=options.temperature == 0,
                      stream=engine._streams.get(device), limit=limit)
    if sink is not None:
        sink.step = step.t
    step.first(live.logits)
    t0 = engine._tick("sample", t0, device)
    steps = 1
    try:
        for t in range(1, S):
            if t % engine.check_every == 0:
                if engine._all_done(live, history, P, t, options):
                    break
                t0 = engine._tick("host_checks", t0, device)
            step.advance()
            steps = t + 1
            t0 = engine._tick("step", t0, device)
    finally:
        step.release()
    return steps

