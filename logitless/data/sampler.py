"""Seeded, epoch-based prompt sampler whose position can be saved and restored exactly."""

from __future__ import annotations

import random
from typing import Any, Generic, Sequence, TypeVar

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Endless stream of rows: each epoch is a permutation of all rows (seeded by `(seed, epoch)`).

    `next_batch(k)` returns the next `k` rows, continuing into the next epoch when one runs out (a batch may
    span two epochs). The position is `(epoch, index)`, so `state_dict()` / `load_state_dict()` make a resumed
    run see exactly the same prompts as an uninterrupted one.
    """

    def __init__(self, rows: Sequence[T], seed: int = 0, shuffle: bool = True):
        if len(rows) == 0:
            raise ValueError("PromptSampler needs at least one row, got an empty dataset")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"PromptSampler seed must be an int, got {seed!r}")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # position inside the current epoch's order
        self._order: list[int] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices in the order of `epoch` (a pure function of seed and epoch)."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"logitless-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        """Indices of the next `k` rows."""
        if not isinstance(k, int) or k <= 0:
            raise ValueError(f"PromptSampler.next_indices: k must be a positive int, got {k!r}")
        out: list[int] = []
        while len(out) < k:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = min(k - len(out), len(self._order) - self.index)
            out.extend(self._order[self.index : self.index + take])
            self.index += take
            if self.index == len(self._order):
                self.epoch, self.index, self._order = self.epoch + 1, 0, None
        return out

    def next_batch(self, k: int) -> list[T]:
        """The next `k` rows."""
        return [self.rows[i] for i in self.next_indices(k)]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index, "num_rows": len(self.rows),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict()`; refuses a state of another dataset size/seed/shuffle."""
        for key in ("seed", "epoch", "index", "num_rows", "shuffle"):
            if key not in state:
                raise ValueError(f"PromptSampler state is missing '{key}'; got keys {sorted(state)}")
        if state["num_rows"] != len(self.rows):
            raise ValueError(
                f"PromptSampler state was saved for {state['num_rows']} rows but the dataset has {len(self.rows)}; "
                "resume with the same dataset"
            )
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise ValueError(
                f"PromptSampler state has seed={state['seed']}, shuffle={state['shuffle']} but this sampler has "
                f"seed={self.seed}, shuffle={self.shuffle}; resume with the same data seed"
            )
        if not 0 <= state["index"] < len(self.rows) or state["epoch"] < 0:
            raise ValueError(
                f"PromptSampler state has an invalid position epoch={state['epoch']}, index={state['index']}"
            )
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), None
