"""Multi-turn episodes on backend "hf" (the contract is `episodes.py`).

Each turn is one batched transformers `generate` over the rows whose episode goes on. A row's context is its
prompt and its stream so far (model turns and observations, as token ids, left-padded): token in, token out, no
text in between. transformers keeps no KV cache across `generate` calls, so each turn prefills its rows' whole
context again (the `static` backend keeps it instead).

    turn:   generate(live rows, up to min(max_turn_tokens, room) new tokens each) → model tokens + logprobs
    reply:  driver.respond(the turns) → observation ids (cut to the room) or None
    rows whose episode ended leave the batch; the loop ends when none is left

A driver that answers turns as they end (`submit`/`ready`, the built-in `AgentDriver`) gets each row's turn the
moment it ends inside `generate` (`TurnStops.on_end`), so its tool calls and environment steps run while the other
rows decode; the next turn's `generate` still waits for every answer, since transformers' sampling draws from one
random stream for the whole batch and a batch made of the rows whose answers came first would change the tokens.

With a vision-language model's processor, a row's images (its prompt's, `driver.prompt_images`, and those of its
observations so far, `ImageReply`) go with every turn's `generate`, which recomputes the model's M-RoPE positions
over the whole context: each turn is the forward of the conversation so far, images included, as the trainer's is.

A turn ends at the first token that is an EOS id (unless `ignore_eos`) or one of `driver.turn_end_ids`, that
completes one of `options.stop` / `driver.turn_stops` in the turn's text, or that reaches the row's limit for the
turn (`max_turn_tokens`: "length", the episode budget: "budget"). A turn cut by the budget ends the episode
(truncated); so does an observation longer than the room left, cut to fit, or one that leaves no room for
another turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from logitless.models import decoder_body
from logitless.models.vision import ImageInputs, concat_images, encode_once, image_forward_inputs

from .engine import left_pad, prepare_prompts, sync, unwrap_model
from .episodes import (EpisodeDriver, EpisodeStream, ImageReply, Replies, TurnEnd, TurnEnding, episode_batch,
                       finished_records, turn_cap)
from .types import Prompt, RolloutBatch, SamplingOptions
from .vision import BanPlaceholders


class TurnStops(StoppingCriteria):
    """Ends each row's turn at its first end id, stop string or token limit, and records where and why.

    `start`: the context width (new tokens begin there); `limits` [b]: the most tokens of each row's turn;
    `budget` [b]: whether that limit is the episode's budget (else max_turn_tokens). After `generate`, `ends[k]`
    is the number of tokens of row k's turn and `why[k]` its `TurnEnding`. Having an `eos_token_id` attribute
    makes `generate` write the pad id after a row's end (what it does for EOS)."""

    def __init__(self, start: int, limits: list[int], budget: list[bool], end_ids: list[int], stops: list[str],
                 tokenizer: Any, device: torch.device, on_end: Any = None):
        self.start, self.limits, self.budget, self.stops, self.tokenizer = start, limits, budget, stops, tokenizer
        self.on_end = on_end  # on_end([(k, turn ids, why), ...]) for the rows whose turns ended at this token
        self.eos_token_id = torch.tensor(end_ids, dtype=torch.long, device=device)
        self.ends: list[int | None] = [None] * len(limits)
        self.why: list[TurnEnding | None] = [None] * len(limits)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        n = input_ids.shape[1] - self.start  # tokens of the turn so far
        at_end = torch.isin(input_ids[:, -1], self.eos_token_id).tolist()
        ended = []
        for k, limit in enumerate(self.limits):
            if self.ends[k] is not None:
                continue
            why: TurnEnding | None = None
            if at_end[k]:
                why = "eos"
            elif self.stops and self._stopped(input_ids[k, self.start :]):
                why = "stop"
            elif n >= limit:
                why = "budget" if self.budget[k] else "length"
            if why is not None:
                self.ends[k], self.why[k] = n, why
                ended.append(k)
        if ended and self.on_end is not None:
            turn = input_ids[ended, self.start :].tolist()
            self.on_end([(k, ids, self.why[k]) for k, ids in zip(ended, turn)])
        return torch.tensor([e is not None for e in self.ends], dtype=torch.bool, device=input_ids.device)

    def _stopped(self, turn: torch.Tensor) -> bool:
        """Whether the turn's text contains a stop string. Checked after every token, so the first token for which
        it does is the one completing it (the same cut as `engine._stop_cut`)."""
        text = self.tokenizer.decode(turn.tolist(), skip_special_tokens=False)
        return any(s in text for s in self.stops)


def generate_episodes(engine: Any, prompts: Sequence[Prompt], options: SamplingOptions,
                      driver: EpisodeDriver) -> RolloutBatch:
    """One episode per row (G per prompt), turn by turn, assembled by `episode_batch`. `engine`: the `HFEngine`
    (its model, tokenizer, `generation_config`, `processors` and `sampling` context)."""
    prep = prepare_prompts(engine.model, engine.tokenizer, prompts, options)
    prompt_images = getattr(driver, "prompt_images", None)  # each prompt's image tensors (or None), as ids are
    if prompt_images is not None and any(prompt_images):
        if engine.processor is None or len(prompt_images) != len(prep.encoded):
            raise ValueError("the episode driver's prompt_images need a vision-language model's processor and one "
                             f"entry per prompt ({len(prep.encoded)})")
        prep = dataclasses.replace(prep, images=ImageInputs(list(prompt_images)))
    G, budget, cap = options.num_generations, options.max_new_tokens, turn_cap(driver)
    B = len(prep.encoded) * G
    end_ids = sorted({*([] if options.ignore_eos else prep.eos_ids), *(int(i) for i in driver.turn_end_ids)})
    stops = list(dict.fromkeys([*options.stop, *driver.turn_stops]))
    vocab = unwrap_model(engine.model).get_input_embeddings().weight.shape[0]
    streams = [EpisodeStream() for _ in range(B)]
    driver.begin(B, G)
    replies = Replies(driver, vocab, images=engine.processor is not None)
    body = decoder_body(engine.model) if engine.processor is not None else None
    gen_s = 0.0
    with engine.sampling(options, prep.device):
        while live := [b for b, s in enumerate(streams) if not s.done]:
            rooms = [budget - len(streams[b].ids) for b in live]  # each >= 1 for a live row
            limits = [room if cap is None else min(cap, room) for room in rooms]
            ids, mask = left_pad([prep.encoded[b // G] + streams[b].ids for b in live], prep.pad_id, prep.device)
            # a driver that answers turns as they end gets each at once, its steps running while the others decode
            submit = None if not replies.overlaps else lambda ended, live=live, rooms=rooms: replies.submit(
                [TurnEnd(live[k], turn_ids, why, rooms[k] - len(turn_ids)) for k, turn_ids, why in ended])
            stopper = TurnStops(ids.shape[1], limits, [lim == room for lim, room in zip(limits, rooms)], end_ids,
                                stops, engine.tokenizer, prep.device, on_end=submit)
            recorder, processors = engine.processors(options)
            vision, shared = {}, contextlib.nullcontext()
            if body is not None:  # every image of each row's context so far: the prompt's, then its observations'
                prompt = [None] * len(prep.encoded) if prep.images is None else prep.images.rows
                rows = ImageInputs([concat_images([prompt[b // G], *streams[b].images]) for b in live])
                if rows.any:
                    vision = image_forward_inputs(body, ids, mask, rows.to(prep.device))
                    vision.pop("position_ids", None)  # generate computes the model's own (M-RoPE) positions
                    shared = encode_once(body, rows, vision.get("pixel_values"))
            if engine.placeholders:
                processors.append(BanPlaceholders(engine.placeholders))
            cfg = engine.generation_config(options, max(limits), prep.pad_id, None, None)
            sync(prep.device)
            t0 = time.perf_counter()
            with shared:
                out = engine.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                                            logits_processor=processors,
                                            stopping_criteria=StoppingCriteriaList([stopper]), **vision)
            turn = out[:, ids.shape[1]:]  # [b, S]
            logp = recorder.finish(turn).cpu()
            sync(prep.device)
            gen_s += time.perf_counter() - t0
            turn = turn.cpu()
            ends = []
            for k, b in enumerate(live):
                n = stopper.ends[k]
                streams[b].add(turn[k, :n].tolist(), logp[k, :n].tolist(), env=False)
                ends.append(TurnEnd(row=b, ids=turn[k, :n].tolist(), ended=stopper.why[k],
                                    room=budget - len(streams[b].ids)))
            if not replies.overlaps:
                replies.submit(ends)
            got = {}
            while replies.in_flight:
                got.update((te.row, reply) for te, reply in replies.ready(wait=True))
            for end in ends:
                s, reply = streams[end.row], got[end.row]
                if end.ended == "budget":  # the model was cut: the episode is over whatever the driver says
                    s.done = s.truncated = True
                elif reply is None:
                    s.done = True
                elif len(reply) >= end.room and isinstance(reply, ImageReply):  # cutting would cut an image
                    s.done = s.truncated = True
                elif len(reply) >= end.room:  # no room left for another turn after the observation
                    s.add(reply[: end.room], None, env=True)
                    s.done = s.truncated = True
                else:
                    s.add(reply, None, env=True)
    return episode_batch(engine.tokenizer, prep, streams, finished_records(driver, B), gen_s)
