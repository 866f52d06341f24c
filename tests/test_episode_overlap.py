"""Slow environments: a row's environment step runs while the other rows decode (static engine: and the row re-enters
when its step is done, the others going on), and the same seed gives the same tokens however long the steps take
(static: per-row random streams keyed by turn and step; hf: every turn's batch is the same)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from logitless.agents import Agent, AgentOptions
from logitless.data.prompts import PromptRow
from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from tests.agent_fixtures import HANG
from tests.test_rollout_families import TOK, make_model

ROWS, TURNS = 6, 3
TURN_END = list(range(40, 110))  # about a quarter of the byte vocabulary ends a turn: turns of a few tokens


class Shared:
    """What the episodes of one rollout share: the steps each row has run, a hold on row 0's first step, a count of
    the model's forwards, and each step's delay (seconds) by row."""

    def __init__(self, hold: bool = False, delay=lambda row, turn: 0.0):
        self.cond = threading.Condition()
        self.steps = [0] * ROWS
        self.hold, self.delay = hold, delay
        self.forwards = 0
        self.held: tuple[int, int] | None = None  # forwards when row 0's step began waiting and when it was released
        self.in_flight, self.most_in_flight = 0, 0
        self.wait_decode = False  # each step waits until two more forwards ran or its turn's generate returned
        self.generated = 0  # generate calls returned (backend hf)
        self.decoded_meanwhile: list[int] = []  # forwards seen while each step waited (wait_decode)
        self.hang = False  # row 0's first step hangs on agent_fixtures.HANG (released after the test)


class Game:
    """Answers each turn with "turn k done."; done after TURNS turns. Row 0's first step is held (with
    `Shared.hold`) until every other row's episode has ended: only an engine that decodes other rows while a step
    is pending can get there (a guard of 60 s ends the wait otherwise, and the test fails)."""

    shared: Shared

    def reset(self, row: dict) -> str | None:
        self.row, self.turns = row["id"], 0
        return None

    def step(self, text: str):
        sh = self.shared
        with sh.cond:
            sh.in_flight += 1
            sh.most_in_flight = max(sh.most_in_flight, sh.in_flight)
        time.sleep(sh.delay(self.row, self.turns))  # emulated latency only, never synchronisation
        if sh.hold and self.row == 0 and self.turns == 0:
            with sh.cond:
                start = sh.forwards
                ok = sh.cond.wait_for(lambda: all(n == TURNS for n in sh.steps[1:]), timeout=60)
                sh.held = (start, sh.forwards) if ok else None
        if sh.hang and self.row == 0 and self.turns == 0:
            HANG.wait()
        if sh.wait_decode:
            with sh.cond:  # (hf: every live row is in the same turn, so turn k ends within generate call k + 1)
                start = sh.forwards
                sh.cond.wait_for(lambda: sh.forwards >= start + 2 or sh.generated > self.turns, timeout=60)
                sh.decoded_meanwhile.append(sh.forwards - start)
        self.turns += 1
        with sh.cond:
            sh.steps[self.row] += 1
            sh.in_flight -= 1
            sh.cond.notify_all()
        return f" turn {self.turns} done.", float(self.turns), self.turns >= TURNS


def rollout(model, shared: Shared, seed: int = 4, backend: str = "static", timeout_s: float = 120):
    Game.shared = shared
    agent = Agent(TOK, AgentOptions(environment=Game, format="raw", max_turns=TURNS, max_parallel_tools=ROWS,
                                    tool_timeout_s=timeout_s, max_turn_tokens=20))
    driver = agent.driver([PromptRow(f"Game {i}:", {"id": i}) for i in range(ROWS)], 1)
    driver.turn_end_ids = TURN_END
    def forward(*_):
        with shared.cond:
            shared.forwards += 1
            shared.cond.notify_all()

    hook = model.register_forward_pre_hook(forward)
    generate = model.generate

    def counted(*a, **k):
        try:
            return generate(*a, **k)
        finally:
            with shared.cond:
                shared.generated += 1
                shared.cond.notify_all()

    model.generate = counted
    try:
        engine = make_engine(backend, model, TOK, **({"check_every": 2} if backend == "static" else {}))
        batch = engine.generate(driver.prompt_ids, SamplingOptions(num_generations=1, temperature=1.0, seed=seed,
                                                                   max_new_tokens=110, ignore_eos=True),
                                episodes=driver)
    finally:
        hook.remove()
        del model.generate
    return batch


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def test_a_pending_step_holds_only_its_own_row(model, one_thread):
    """Row 0's first step waits until every other row has played its whole episode: decode steps (the model's
    forwards) ran while it was pending, several steps were in flight at once, and every episode still ran its turns."""
    shared = Shared(hold=True)
    b = rollout(model, shared)
    assert shared.held is not None, "row 0's step was never released: the other rows did not decode meanwhile"
    start, end = shared.held
    assert end - start >= 2 * (TURNS - 1)  # the other rows' later turns were decoded while row 0 waited
    assert shared.most_in_flight >= 2
    assert [r.turns for r in b.episodes] == [TURNS] * ROWS and shared.steps == [TURNS] * ROWS
    assert [r.reward for r in b.episodes] == [6.0] * ROWS and not b.truncated.any()
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)
    assert (lp - b.sampler_logp)[b.loss_mask().bool()].abs().max() < 1e-5


def test_a_step_past_the_timeout_ends_its_episode_while_the_others_play_on(model, one_thread):
    """Row 0's first step hangs: it is abandoned at agent.tool_timeout_s while the other rows decode, its episode
    ends there (env_errors, warned), and the others play their turns with the tokens of a run without the hang."""
    shared = Shared()
    shared.hang = True
    with pytest.warns(UserWarning, match=r"Game.step\(\) did not return within 0.5 s"):
        b = rollout(model, shared, timeout_s=0.5)
    assert [r.turns for r in b.episodes] == [1] + [TURNS] * (ROWS - 1)
    assert b.episodes[0].metrics["env_errors"] == 1 and b.episodes[1].metrics["env_errors"] == 0
    ref = rollout(model, Shared())
    assert torch.equal(b.completion_ids[1:], ref.completion_ids[1:])
    first = int(b.completion_mask[0].sum())  # row 0: its first turn, as without the hang
    assert torch.equal(b.completion_ids[0, :first], ref.completion_ids[0, :first])


def test_the_same_seed_gives_the_same_tokens_with_a_slow_or_a_fast_environment(model, one_thread):
    """Fast (no delay), slow (0-60 ms per step, different by row and turn) and held (row 0 re-enters after every
    other row ended): the rows re-enter the decode at different steps, their tokens are the same."""
    fast = rollout(model, Shared())
    slow = rollout(model, Shared(delay=lambda row, turn: 0.015 * ((3 * row + turn) % 5)))
    held = rollout(model, Shared(hold=True))
    assert [r.turns for r in fast.episodes] == [TURNS] * ROWS
    for other in (slow, held):
        assert torch.equal(fast.completion_ids, other.completion_ids)
        assert torch.equal(fast.completion_mask, other.completion_mask)
        assert torch.equal(fast.env_mask, other.env_mask)
        # the layout of the cache differs (where each row's slots are), which reorders a few additions
        assert torch.allclose(fast.sampler_logp, other.sampler_logp, atol=1e-6, rtol=0)
        assert [r.messages for r in fast.episodes] == [r.messages for r in other.episodes]


def test_on_the_hf_engine_steps_run_while_the_turn_still_decodes_and_the_tokens_stay(model, one_thread):
    """hf: each row's step is submitted when its turn ends inside `generate`; a step that waits for two more forwards
    sees them (other rows were still decoding) unless its turn was the last to end. The tokens equal a fast run's."""
    shared = Shared(delay=lambda row, turn: 0.01 * ((row + turn) % 3))
    shared.wait_decode = True
    slow = rollout(model, shared, backend="hf")
    fast = rollout(model, Shared(), backend="hf")
    assert max(shared.decoded_meanwhile) >= 2 and len(shared.decoded_meanwhile) == sum(shared.steps)
    assert torch.equal(fast.completion_ids, slow.completion_ids) and torch.equal(fast.env_mask, slow.env_mask)
    assert torch.equal(fast.sampler_logp, slow.sampler_logp)
    assert [r.messages for r in fast.episodes] == [r.messages for r in slow.episodes]
