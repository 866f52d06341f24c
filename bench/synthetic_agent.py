"""The synthetic environment of `bench/bench_e2e.py --turns N`: N-turn episodes of fixed-length turns and
observations, so a multi-turn step can be timed against the single-turn one at the same number of model tokens."""

from __future__ import annotations

import os
from typing import Any


class SyntheticAgent:
    """`--turns N`: every sample is an N-turn episode whose turns end after a fixed number of tokens (the completion
    length split evenly, `rollout.max_completion_length` grown by the observations) and whose environment answers
    each turn but the last with the same `--obs-tokens` tokens. It stands in for `logitless.agents.Agent` in the
    worker process (the trainer builds it from `agent.*`), so the step runs the trainer's real episode path: the
    static engine's multi-turn decode, the loss mask, the rewards over the conversation."""

    def __init__(self, tokenizer: Any, options: Any) -> None:
        self.tok, self.turns, self.turn_tokens = tokenizer, int(os.environ["BENCH_TURNS"]), int(os.environ["BENCH_TURN_TOKENS"])
        text = " The environment observed the last action and reports its state in this fixed-length message." * 8
        self.obs = tokenizer(text, add_special_tokens=False)["input_ids"][: int(os.environ["BENCH_OBS_TOKENS"])]

    def driver(self, rows: list[Any], num_generations: int) -> Any:
        from logitless.rollout.episodes import EpisodeRecord

        agent = self

        class Driver:
            turn_end_ids, turn_stops, max_turn_tokens = [], [], agent.turn_tokens
            prompt_ids = [agent.tok.apply_chat_template(r.prompt, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False) for r in rows]

            def begin(self, num_rows: int, G: int) -> None:
                self.records = [EpisodeRecord() for _ in range(num_rows)]

            def respond(self, turns: list[Any]) -> list[Any]:
                out = []
                for te in turns:
                    rec = self.records[te.row]
                    rec.turns += 1
                    rec.messages.append({"role": "assistant", "content": agent.tok.decode(te.ids)})
                    last = rec.turns >= agent.turns
                    if not last:
                        rec.messages.append({"role": "user", "content": agent.tok.decode(agent.obs)})
                    out.append(None if last else list(agent.obs))
                return out

            def finish(self) -> list[Any]:
                return self.records

        return Driver()
