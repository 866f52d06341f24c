"""Multi-turn episodes: the contract between a rollout engine and whatever answers the model between turns.

An engine that runs episodes knows nothing of tools, parsers or chat templates. It decodes a *turn* for every
live row, hands the turn's sampled token ids to an `EpisodeDriver`, and appends the token ids the driver
returns (a tool result or an environment observation rendered through the chat template, followed by the
generation prompt of the next assistant turn) to the row's sequence, then decodes the next turn. Token in,
token out: sampled ids are never decoded and re-encoded, so the trainer sees exactly the sampled sequence.

    prompt ids ─► turn 1 (model) ─► observation 1 (driver) ─► turn 2 (model) ─► ... ─► episode ends

One episode per row (row i*G + g is sample g of prompt i). A row's *completion* is every token after its
prompt: model turns and observations, in order. The episode budget `SamplingOptions.max_new_tokens` bounds the
whole completion (model and observation tokens together, as TRL's `max_completion_length`); `max_turn_tokens`
bounds one model turn.

A turn ends when the model samples an EOS id or one of `driver.turn_end_ids`, when one of
`SamplingOptions.stop` or `driver.turn_stops` appears in the turn's text (the token completing it is the turn's
last), when the turn reaches `max_turn_tokens`, or when the episode's budget is used up. The driver then returns, per row,
either the observation's token ids (the episode goes on) or None (the episode is over). The engine ends an
episode by itself only when its budget is used up (the row is then `truncated`); a driver that returns more
observation tokens than `TurnEnd.room` allows has them cut by the engine and the episode ends truncated.

The batch an episode rollout returns (`RolloutBatch`, `types.py`) has `env_mask` [B, T]: 1 on every completion
token the driver wrote (observations, template seams), 0 on the model's. The trainer trains only the model's
tokens: `loss_mask = completion_mask & ~env_mask`; observation tokens stay in the sequence as context (attended
to), out of the loss, every normalizer and every metric, with `sampler_logp` 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

TurnEnding = Literal["eos", "stop", "length", "budget"]


@dataclass
class TurnEnd:
    """One model turn that just ended, as the engine hands it to the driver."""

    row: int  # the batch row (i * G + g)
    ids: list[int]  # the model's tokens of this turn, as sampled (the ending EOS / turn-end id included)
    ended: TurnEnding  # eos: an EOS or turn-end id; stop: a stop string; length: max_turn_tokens; budget: episode budget
    room: int  # completion tokens the episode may still add (observation and later turns) within max_new_tokens


@dataclass
class EpisodeRecord:
    """What the driver reports of one finished episode (one row)."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation after the prompt (assistant/tool/user)
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools, wrong arguments, raising / hanging tools
    # the environment's own reward for the whole episode: its turn_rewards plus any final reward (None: it gives none)
    reward: float | None = None
    truncated: bool = False  # ended by a budget or max_turns instead of by the model or the environment
    metrics: dict[str, float] = field(default_factory=dict)  # anything else per episode, averaged over the step
    # after each model turn, the reward the environment gave for it (None: none, e.g. a turn of tool calls); the
    # final reward() is in `reward` only. One entry per model turn, or none (advantage.credit=turn then puts the
    # whole `reward` on the last turn)
    turn_rewards: list[float | None] = field(default_factory=list)


@runtime_checkable
class EpisodeDriver(Protocol):
    """Answers the model between turns. One driver per `generate` call, with one episode per row.

    `turn_end_ids`: token ids that end a model turn besides the EOS ids (e.g. ChatML's `<|im_end|>`, Llama 3's
    `<|eom_id|>`). `turn_stops`: strings that end a model turn (e.g. `</call>` of a raw-text tool protocol).
    `max_turn_tokens`: the most tokens of one model turn (None: the episode budget alone).
    """

    turn_end_ids: Sequence[int]
    turn_stops: Sequence[str]
    max_turn_tokens: int | None

    def begin(self, num_rows: int, num_generations: int) -> None:
        """Start `num_rows` episodes (rows i*G + g of prompt i), before the first turn."""
        ...

    def respond(self, turns: list[TurnEnd]) -> list[list[int] | None]:
        """For each turn that ended (several rows at once, in any order): the token ids to append before the
        row's next turn, or None to end its episode. Tools of different rows may run concurrently here."""
        ...

    def finish(self) -> list[EpisodeRecord]:
        """After the last turn: one record per row, in row order."""
        ...

    # Optional, for answers that take time (`Replies`): `submit(turns) -> None` starts answering and returns at
    # once; `ready(wait: bool) -> list[tuple[int, list[int] | None]]` gives (row, reply) of the turns answered since
    # its last call (wait: block until one is, while any is in flight). With them the engine hands over each turn as
    # it ends and decodes the other rows meanwhile; `respond` is not called.


@dataclass
class ImageReply:
    """A driver's reply whose observation holds images: `ids` the observation's token ids (each image's placeholder
    expanded by the processor) and `images` the processor's image tensors of those placeholders, in order
    (`pixel_values`, `image_grid_thw`, ...: first dimension over the reply's patches / images)."""

    ids: list[int]
    images: dict[str, Any]  # name -> tensor, as a vision-language model's processor returns them

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class EpisodeStream:
    """One row's completion as an engine assembles it: every token after the prompt, in order."""

    ids: list[int] = field(default_factory=list)  # model and driver tokens
    logp: list[float] = field(default_factory=list)  # sampler logprob of each model token; 0.0 at driver tokens
    env: list[int] = field(default_factory=list)  # 1 where the driver wrote the token
    done: bool = False  # the episode is over (the driver returned None, or the budget is used up)
    truncated: bool = False  # ended by the episode budget rather than by the driver
    images: list[dict[str, Any]] = field(default_factory=list)  # the image tensors of its observations, in order

    def add(self, ids: Sequence[int] | ImageReply, logp: Sequence[float] | None, env: bool) -> None:
        """Append tokens written by the model (`logp` given) or by the driver (`env=True`, logprob 0); an
        `ImageReply`'s image tensors go with its ids."""
        if isinstance(ids, ImageReply):
            self.images.append(ids.images)
            ids = ids.ids
        self.ids.extend(int(i) for i in ids)
        self.logp.extend([0.0] * len(ids) if logp is None else [float(x) for x in logp])
        self.env.extend([int(env)] * len(ids))


def turn_cap(driver: EpisodeDriver) -> int | None:
    """The driver's `max_turn_tokens`, refused unless a positive int or None."""
    cap = driver.max_turn_tokens
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"the episode driver's max_turn_tokens={cap!r} must be a positive int or None")
    return cap


def checked_replies(replies: Any, turns: Sequence[TurnEnd], vocab: int | None, images: bool = False
                    ) -> list[list[int] | ImageReply | None]:
    """`driver.respond(turns)`'s answer as one list of token ids (or None) per turn, refused (naming the row and
    the fault) when it has another length, a reply is not a sequence of ints, or an id is outside `vocab` (None:
    the ids' range is checked later). `images`: the engine takes `ImageReply`s (else one is refused)."""
    if not isinstance(replies, Sequence) or isinstance(replies, (str, bytes)) or len(replies) != len(turns):
        got = len(replies) if isinstance(replies, Sequence) else repr(replies)
        raise ValueError(f"the episode driver answered {got} replies to {len(turns)} turns; it must return one "
                         "(token ids or None) per turn")
    return [_checked_reply(reply, te.row, vocab, images) for te, reply in zip(turns, replies)]


def _checked_reply(reply: Any, row: int, vocab: int | None, images: bool = False) -> list[int] | ImageReply | None:
    if reply is None:
        return None
    if isinstance(reply, ImageReply):
        if not images:
            raise ValueError(f"the episode driver's reply for row {row} holds images, which this engine cannot "
                             "prefill (a vision-language model's observations with images need rollout.backend=hf)")
        return ImageReply(_checked_reply(reply.ids, row, vocab), reply.images)  # type: ignore[arg-type]
    if hasattr(reply, "tolist"):  # a tensor or an array
        reply = reply.tolist()
    if isinstance(reply, (str, bytes)) or not isinstance(reply, Sequence) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in reply):
        raise TypeError(f"the episode driver's reply for row {row} must be a list of token ids or None, got "
                        f"{reply!r:.80}")
    bad = [] if vocab is None else [i for i in reply if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"the episode driver's reply for row {row} holds token id {bad[0]}, outside the model's "
                         f"vocabulary of {vocab} ids")
    return list(reply)


class Replies:
    """How an engine gets a driver's answers: `submit` turns as they end, collect `(turn, reply)` as each is ready.

    A driver that has `submit(turns)` and `ready(wait) -> [(row, reply)]` (the built-in `AgentDriver`) answers each
    turn as soon as its own tool calls or environment step are done, while the engine decodes other rows; any
    other driver is asked through `respond(turns)` at `submit`, and its replies are ready at once. Every reply is
    checked as `checked_replies` checks it."""

    def __init__(self, driver: EpisodeDriver, vocab: int | None, images: bool = False) -> None:
        """`images`: the engine takes replies with images (`ImageReply`)."""
        self.driver, self.vocab, self.images = driver, vocab, images
        self.overlaps = callable(getattr(driver, "submit", None)) and callable(getattr(driver, "ready", None))
        self._turns: dict[int, TurnEnd] = {}  # row -> its turn in flight
        self._ready: list[tuple[TurnEnd, list[int] | None]] = []

    @property
    def in_flight(self) -> int:
        """Turns submitted whose reply `ready` has not handed back yet."""
        return len(self._turns)

    def submit(self, turns: list[TurnEnd]) -> None:
        """Hand these turns to the driver (one turn per row in flight at a time)."""
        if not turns:
            return
        for te in turns:
            if te.row in self._turns:
                raise RuntimeError(f"row {te.row}'s turn was submitted while its previous one is unanswered")
            self._turns[te.row] = te
        if self.overlaps:
            self.driver.submit(turns)  # type: ignore[attr-defined]
            return
        for te, reply in zip(turns, checked_replies(self.driver.respond(turns), turns, self.vocab,
                                                                   self.images)):
            self._ready.append((te, reply))

    def ready(self, wait: bool = False) -> list[tuple[TurnEnd, list[int] | None]]:
        """(turn, reply) of each submitted turn answered since the last call; wait: block until there is one
        (while any turn is in flight)."""
        if self.overlaps and self._turns:
            got = self.driver.ready(wait=wait and not self._ready)  # type: ignore[attr-defined]
            if not isinstance(got, Sequence) or not all(isinstance(g, tuple) and len(g) == 2 for g in got):
                raise ValueError(f"the episode driver's ready() must return (row, reply) pairs, got {got!r:.80}")
            for row, reply in got:
                if row not in self._turns or any(te.row == row for te, _ in self._ready):
                    raise ValueError(f"the episode driver's ready() answered row {row}, which has no turn in flight")
                self._ready.append((self._turns[row], _checked_reply(reply, row, self.vocab, self.images)))
        out, self._ready = self._ready, []
        for te, _ in out:
            del self._turns[te.row]
        return out


def finished_records(driver: EpisodeDriver, num_rows: int) -> list[EpisodeRecord]:
    """`driver.finish()`, refused unless it is one `EpisodeRecord` per row."""
    records = driver.finish()
    if not isinstance(records, Sequence) or len(records) != num_rows:
        got = len(records) if isinstance(records, Sequence) else repr(records)
        raise ValueError(f"the episode driver's finish() returned {got} records for {num_rows} episodes")
    bad = next((i for i, r in enumerate(records) if not isinstance(r, EpisodeRecord)), None)
    if bad is not None:
        raise TypeError(f"the episode driver's finish() record {bad} must be an EpisodeRecord, got "
                        f"{type(records[bad]).__name__}")
    return list(records)


def episode_batch(tokenizer: Any, prep: Any, streams: list[EpisodeStream], records: list[EpisodeRecord],
                  generate_seconds: float) -> Any:
    """The `RolloutBatch` of an episode rollout: completion = each row's stream (right-padded), env_mask from the
    streams, `finished` = the episode ended before its budget, `truncated` = the budget or max_turns ended it
    (a record's `truncated` or the stream's), texts = the model's turns decoded together (special tokens
    skipped; the conversation is in `episodes[b].messages`). `images`: each row's image tensors, the prompt's
    (`prep.images`) then its observations' (`EpisodeStream.images`), in sequence order."""
    import time

    import torch

    from .types import RolloutBatch, RolloutTiming

    G, B = prep.options.num_generations, len(streams)
    T = max(1, max(len(s.ids) for s in streams))
    completion_ids = torch.full((B, T), prep.pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    env = torch.zeros((B, T), dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    for b, s in enumerate(streams):
        n = len(s.ids)
        if n:
            completion_ids[b, :n] = torch.tensor(s.ids, dtype=torch.long)
            mask[b, :n] = 1
            env[b, :n] = torch.tensor(s.env, dtype=torch.long)
            logp[b, :n] = torch.tensor(s.logp, dtype=torch.float32)
    logp = logp * (1 - env)
    truncated = torch.tensor([s.truncated or r.truncated for s, r in zip(streams, records)], dtype=torch.bool)
    model_ids = [[i for i, e in zip(s.ids, s.env) if not e] for s in streams]
    texts = tokenizer.batch_decode(model_ids, skip_special_tokens=True)
    num_tokens = int((mask * (1 - env)).sum())
    seconds = time.perf_counter() - prep.t_start
    return RolloutBatch(
        prompt_ids=prep.ids.detach().cpu().repeat_interleave(G, 0),
        prompt_mask=prep.mask.detach().cpu().repeat_interleave(G, 0),
        completion_ids=completion_ids,
        completion_mask=mask,
        sampler_logp=logp,
        finished=~truncated,
        truncated=truncated,
        prompt_index=torch.arange(prep.ids.shape[0]).repeat_interleave(G),
        completions=texts,
        timing=RolloutTiming(seconds=seconds, num_tokens=num_tokens, tokens_per_s=num_tokens / max(seconds, 1e-9),
                             generate_seconds=generate_seconds),
        env_mask=env,
        episodes=records,
        images=row_images(prep, streams),
    )


def row_images(prep: Any, streams: list[EpisodeStream]) -> Any:
    """`ImageInputs` of the rows (row b = i * G + g): prompt i's image tensors (`prep.images`), then row b's
    observations' in order; None where no row has images."""
    from logitless.models.vision import ImageInputs, concat_images

    G = prep.options.num_generations
    prompt = [None] * len(prep.encoded) if prep.images is None else prep.images.rows
    rows = [concat_images([prompt[b // G], *s.images]) for b, s in enumerate(streams)]
    return ImageInputs(rows) if any(rows) else None
