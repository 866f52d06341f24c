"""Multi-turn episodes on the static engine: the KV cache lives across turns, observations are prefilled into it.

`StaticEngine.generate(prompts, options, episodes=driver)` runs in `static_overlap.py` (the protocol is
`episodes.py`); this module holds the cache machinery it shares with the turns. Per wave of rows, one decode cache
and one decode step serve every turn:

    prefill prompts ─► decode turns (the step, replayed; rows end at EOS / turn-end id / stop / budget)
                    ─► the driver answers ─► relayout ─► prefill [last turn token + observation] ─► relayout
                    ─► decode next turns ─► ...                      (rows whose episode ended stay, as padding)

Rows do not wait for each other: a row's turn is answered while the others decode, and it re-enters when its
answer is back (`static_overlap.py`).

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

The draw of step t of turn k uses the row keys folded with k (`sampling.turn_keys`; turn 0 is the single-turn
draw), then with t, so a seed gives the same episodes whatever the wave split and whenever answers come back.
Repetition penalty needs the whole sequence's tokens and is refused here (use the hf backend); top-k / top-p /
min-p are drawn eagerly, without the step graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from logitless.models import UnsupportedModelError
from logitless.models.lm_head import decoder_body, lm_head_of

from .engine import _stop_cut
from .episodes import EpisodeDriver
from .kv_cache import set_visible


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
