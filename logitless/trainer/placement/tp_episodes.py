"""Multi-turn episodes in a tensor-parallel group's rollout (rollout.tensor_parallel with agent.*).

A group decodes the union of its ranks' prompts as one batch on every rank (`tensor_parallel.GroupDecode`), so
every rank's engine needs the observations of every row, but each row's episode (its tools, its environment) lives
on the rank that asked for it. `GroupDriver` stands in for the rank's own `EpisodeDriver`: at each turn it hands
the rank's driver the turns of the rank's own rows (renumbered as its own call would number them), gathers every
rank's replies over the group and returns them in the engine's order; `finish()` gathers the records likewise.
Every rank of the group decodes the same tokens, so every rank reaches each gather at the same turn, and every
rank sees the same gathered replies, so a faulty driver is refused on every rank alike (none is left waiting in a
collective). A call every rank of the group makes alike (an eval's chunk) is decoded once; the group's first rank
answers its episodes, and every rank gets them.

    rank 0 rows [0, n0·G) ─┐                       ┌─ rank 0's driver.respond(its turns)
    rank 1 rows [n0·G, …) ─┴─ union decode, a turn ┴─ rank 1's driver.respond(its turns) ─► all_gather ─► replies
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.distributed as dist

from logitless.rollout.episodes import EpisodeDriver, EpisodeRecord, TurnEnd, checked_replies


def driver_spec(driver: EpisodeDriver | None) -> tuple | None:
    """What every rank's driver of one group call must agree on: how a model turn ends."""
    if driver is None:
        return None
    return tuple(int(i) for i in driver.turn_end_ids), tuple(driver.turn_stops), driver.max_turn_tokens


class GroupDriver:
    """The group's driver for a union decode of `counts[r]` prompts of each rank r (rank r's rows first after
    those of ranks before it, G per prompt); `driver` answers this rank's rows. shared: every rank of the group
    asked for the same prompts (`counts` = [their number]) with a driver made for all of them; the group's first
    rank answers every row, the others' drivers only begin and finish (their tools never run)."""

    def __init__(self, driver: EpisodeDriver, group: Any, rank: int, counts: Sequence[int], shared: bool = False):
        self.driver, self.group, self.rank, self.counts, self.shared = driver, group, rank, list(counts), shared
        self.turn_end_ids, self.turn_stops = list(driver.turn_end_ids), list(driver.turn_stops)
        self.max_turn_tokens = driver.max_turn_tokens
        self.size = dist.get_world_size(group)
        self.G = 0

    def _owner(self, row: int) -> tuple[int, int]:
        """(rank, the row's index in that rank's own call) of a union row."""
        if self.shared:
            return 0, row
        first = 0
        for r, n in enumerate(self.counts):
            if row < first + n * self.G:
                return r, row - first
            first += n * self.G
        raise IndexError(f"row {row} is past the group's {first} rows")

    def _gather(self, what: str, call: Any) -> list[Any]:
        """Every rank's `call()` result, in rank order; a rank whose call raised is named on every rank."""
        try:
            mine, error = call(), None
        except Exception as e:  # noqa: BLE001  (raised below on every rank, after the gather)
            mine, error = None, f"{type(e).__name__}: {e}"
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, (mine, error), group=self.group)
        failed = [(r, err) for r, (_, err) in enumerate(parts) if err is not None]
        if failed:
            r, err = failed[0]
            raise RuntimeError(f"the episode driver of rank {r} of the tensor-parallel group failed in {what}: {err}")
        return [p for p, _ in parts]

    def begin(self, num_rows: int, num_generations: int) -> None:
        self.G = num_generations
        if num_rows != sum(self.counts) * num_generations:
            raise ValueError(f"the group's union decode has {num_rows} rows, its ranks asked for "
                             f"{sum(self.counts)} prompts x {num_generations}")
        own = num_rows if self.shared else self.counts[self.rank] * num_generations
        self._gather("begin()", lambda: self.driver.begin(own, num_generations))

    def respond(self, turns: list[TurnEnd]) -> list[list[int] | None]:
        owners = [self._owner(te.row) for te in turns]
        mine = [dataclasses.replace(te, row=local) for te, (r, local) in zip(turns, owners) if r == self.rank]
        # each rank's replies checked where they are made (the ids' range by the engine, after the gather)
        parts = self._gather("respond()", lambda: checked_replies(self.driver.respond(mine) if mine else [], mine, None))
        taken = [0] * self.size
        out = []
        for r, _ in owners:
            out.append(parts[r][taken[r]])
            taken[r] += 1
        return out

    def finish(self) -> list[EpisodeRecord]:
        parts = self._gather("finish()", lambda: list(self.driver.finish()))
        return parts[0] if self.shared else [record for part in parts for record in part]
