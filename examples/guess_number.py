"""A toy environment for `agent.environment` (docs/agents.md): the model guesses a secret number from 1 to `high`
and is told "Higher." or "Lower." after each wrong guess; it may also ask the `hint` tool. The episode's reward is 1
for a right guess, less for each extra turn. Used by examples/guess_number.yaml."""

from __future__ import annotations

import random
import re


class GuessNumber:
    tools = ["hint"]  # methods the model may call as tools

    def __init__(self, high: int = 100, turn_penalty: float = 0.1):
        self.high, self.turn_penalty = high, turn_penalty

    def reset(self, row: dict) -> str:
        """The first observation. The secret is seeded by the row, so the G episodes of a prompt share it."""
        self.secret = random.Random(f"guess:{row['id']}").randint(1, self.high)
        self.turns, self.solved = 0, False
        return f"I picked a whole number from 1 to {self.high}. Guess it: answer with the number only."

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        """After each model turn without a tool call: (observation, reward, done)."""
        self.turns += 1
        numbers = re.findall(r"-?\d+", text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            self.solved = True
            return None, max(0.0, 1.0 - self.turn_penalty * (self.turns - 1)), True
        if guess is None:
            return "Answer with a number.", None, False
        return ("Higher." if guess < self.secret else "Lower."), None, False

    def hint(self, above: int) -> str:
        """Whether the secret number is above a value.

        Args:
            above: The value to compare the secret with.
        """
        return "yes" if self.secret > above else "no"

    def reward(self) -> float | None:
        """0 for an episode that never guessed right (a right guess gave its reward in `step`)."""
        return None if self.solved else 0.0
