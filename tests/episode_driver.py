"""A scripted episode driver for engine and trainer tests: fixed observation ids, episodes that end after a set
number of model turns per row, and a log of every call, so a test can rebuild each row's stream by hand."""

from __future__ import annotations

from typing import Callable, Sequence

from logitless.rollout.episodes import EpisodeRecord, TurnEnd


class ScriptedDriver:
    """Row b's episode ends after `turns(b)` model turns (the driver returns None then); before that, the
    observation after turn k (1-based) of row b is `observation(b, k)`. Records: `messages` hold each turn's ids
    and observation, `reward` is `reward(b)` (None: no environment reward), `metrics` a per-row value."""

    def __init__(self, turns: Callable[[int], int], observation: Callable[[int, int], list[int]], *,
                 turn_end_ids: Sequence[int] = (), turn_stops: Sequence[str] = (), max_turn_tokens: int | None = None,
                 reward: Callable[[int], float | None] = lambda b: None):
        self.turns, self.observation, self.reward = turns, observation, reward
        self.turn_end_ids, self.turn_stops, self.max_turn_tokens = list(turn_end_ids), list(turn_stops), max_turn_tokens
        self.calls: list[list[int]] = []  # the rows of each respond() call
        self.seen: list[list[TurnEnd]] = []  # every turn of each row, in order
        self.replies: list[list[list[int] | None]] = []  # every reply to each row, in order

    def begin(self, num_rows: int, num_generations: int) -> None:
        self.num_generations = num_generations
        self.calls, self.seen, self.replies = [], [[] for _ in range(num_rows)], [[] for _ in range(num_rows)]

    def respond(self, turns: list[TurnEnd]) -> list[list[int] | None]:
        self.calls.append([t.row for t in turns])
        out = []
        for t in turns:
            self.seen[t.row].append(t)
            k = len(self.seen[t.row])
            reply = None if k >= self.turns(t.row) else list(self.observation(t.row, k))
            self.replies[t.row].append(reply)
            out.append(reply)
        return out

    def finish(self) -> list[EpisodeRecord]:
        records = []
        for b, turns in enumerate(self.seen):
            messages = []
            for t, reply in zip(turns, self.replies[b]):
                messages.append({"role": "assistant", "content": f"turn of {len(t.ids)} tokens"})
                if reply is not None:
                    messages.append({"role": "tool", "content": f"observation of {len(reply)} tokens"})
            records.append(EpisodeRecord(messages=messages, turns=len(turns), tool_calls=len(turns) - 1,
                                         tool_errors=b % 2, reward=self.reward(b), metrics={"row": float(b)}))
        return records
