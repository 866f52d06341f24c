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

A turn ends when the model samples an EOS id or one of `driver.turn_end_ids`, when a stop string appears, when
the turn reaches `max_turn_tokens`, or when the episode's budget is used up. The driver then returns, per row,
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
    reward: float | None = None  # the environment's own reward for the episode (None: it gives none)
    truncated: bool = False  # ended by a budget or max_turns instead of by the model or the environment
    metrics: dict[str, float] = field(default_factory=dict)  # anything else per episode, averaged over the step


@runtime_checkable
class EpisodeDriver(Protocol):
    """Answers the model between turns. One driver per `generate` call, with one episode per row.

    `turn_end_ids`: token ids that end a model turn besides the EOS ids (e.g. Llama 3's `<|eom_id|>`).
    `max_turn_tokens`: the most tokens of one model turn (None: the episode budget alone).
    """

    turn_end_ids: Sequence[int]
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
