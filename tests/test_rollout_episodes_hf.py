"""Multi-turn episodes on the "hf" backend (rollout/hf_turns.py): each row's stream is its model turns and the
driver's observations in order, the sampler's logprobs of the model tokens equal the trainer's over the whole
conversation, turns end where the contract says, budgets cut and mark episodes, finished rows leave the batch."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions
from logitless.rollout.hf import HFEngine
from tests.episode_driver import ScriptedDriver
from tests.test_rollout_families import PROMPTS, TEMPERATURE, TOK, make_model

FAMILIES = ["llama", "qwen2", "gpt2", "gemma2"]  # gemma2: alternating sliding (window 6) and full attention
TURNS = [3, 1, 4, 2, 3, 2]  # model turns of each row's episode (3 prompts x G=2)
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def obs(b: int, k: int) -> list[int]:
    """Observation after turn k of row b: a few byte ids, different per row and turn."""
    return TOK(f"<o{b}.{k}{'!' * (b % 3)}>", add_special_tokens=False)["input_ids"]


def driver(**kw) -> ScriptedDriver:
    return ScriptedDriver(lambda b: TURNS[b], obs, **kw)


def run(model, drv: ScriptedDriver, seed: int = 3, **opts):
    options = SamplingOptions(**{"num_generations": 2, "temperature": TEMPERATURE, "max_new_tokens": 64,
                                 "seed": seed, **opts})
    return HFEngine(model, TOK).generate(PROMPTS, options, episodes=drv)


def expected_stream(drv: ScriptedDriver, b: int, budget: int) -> tuple[list[int], list[int]]:
    """Row b's completion and env mask rebuilt from what the driver saw and answered (cut to the budget)."""
    ids, env = [], []
    for t, reply in zip(drv.seen[b], drv.replies[b]):
        ids += t.ids
        env += [0] * len(t.ids)
        if reply is not None and t.ended != "budget":
            ids += reply
            env += [1] * len(reply)
    return ids[:budget], env[:budget]


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_model(family)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_logprobs_equal_the_trainers_across_turns(family, models, one_thread):
    model = models(family)
    end_ids = TOK(LETTERS, add_special_tokens=False)["input_ids"]  # turns end early at a letter or a digit
    d1, d2 = driver(turn_end_ids=end_ids, max_turn_tokens=6), driver(turn_end_ids=end_ids, max_turn_tokens=6)
    a, b = run(model, d1, ignore_eos=True), run(model, d2, ignore_eos=True)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert torch.equal(a.env_mask, b.env_mask)
    for r in range(6):  # each row: its own number of turns, its stream as the driver saw it
        assert len(d1.seen[r]) == TURNS[r] and d1.replies[r][-1] is None
        ids, env = expected_stream(d1, r, 64)
        n = len(ids)
        assert a.completion_ids[r, :n].tolist() == ids and a.env_mask[r, :n].tolist() == env
        assert int(a.completion_mask[r].sum()) == n and not a.env_mask[r, n:].any()
    assert {t.ended for ts in d1.seen for t in ts} == {"eos", "length"}  # both endings happen
    assert d1.calls[0] == list(range(6)) and d1.calls[1] == [0, 2, 3, 4, 5] and d1.calls[3] == [2]  # rows leave
    assert not a.truncated.any() and a.finished.all()
    loss = a.loss_mask()
    with torch.no_grad():
        lp, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
                                    temperature=TEMPERATURE)
    assert (a.sampler_logp[a.env_mask.bool()] == 0).all()
    torch.testing.assert_close(a.sampler_logp[loss.bool()], lp[loss.bool()], atol=1e-5, rtol=0)
    assert a.timing.num_tokens == int(loss.sum())  # model tokens


def test_turn_endings_follow_the_contract(models, one_thread):
    """Every turn ends at the first token that is an end id, completes a stop string, or reaches its limit."""
    model = models("llama")
    stops = list(LETTERS[:26]) + ["xq", "t "]  # options.stop: a-m; driver.turn_stops: the rest
    end_ids = TOK(LETTERS[26:], add_special_tokens=False)["input_ids"]  # turn end ids A-Z, EOS ids 0-9
    drv = ScriptedDriver(lambda b: 4, obs, turn_end_ids=end_ids[:26], turn_stops=stops[13:], max_turn_tokens=7)
    batch = run(model, drv, stop=stops[:13], eos_token_ids=end_ids[26:], max_new_tokens=60)
    endings = set()
    for turns in drv.seen:
        for t in turns:
            endings.add(t.ended)
            texts = [TOK.decode(t.ids[:k]) for k in range(len(t.ids) + 1)]
            assert not any(s in x for x in texts[:-1] for s in stops)  # nothing ended it earlier
            assert not any(i in end_ids for i in t.ids[:-1])
            if t.ended == "eos":
                assert t.ids[-1] in end_ids
            elif t.ended == "stop":
                assert any(s in texts[-1] for s in stops)
            elif t.ended == "length":
                assert len(t.ids) == 7
            else:
                assert t.room == 0
    assert {"eos", "stop", "length"} <= endings
    ids, env = batch.completion_ids[0].tolist(), batch.env_mask[0].tolist()
    assert batch.completions[0] == TOK.decode([i for i, e in zip(ids, env) if not e and i != TOK.pad_token_id])


def test_budgets_cut_turns_and_observations_and_mark_truncation(models, one_thread):
    model = models("qwen2")
    long_obs = lambda b, k: [ord("z")] * (30 if b == 0 else 3)  # noqa: E731
    drv = ScriptedDriver(lambda b: 10, long_obs, max_turn_tokens=8)
    batch = run(model, drv, max_new_tokens=23, ignore_eos=True)
    assert (batch.completion_mask.sum(1) == 23).all() and batch.truncated.all() and not batch.finished.any()
    # row 0: turn (8) + observation cut from 30 to the 15 tokens left; its episode ends there
    assert [len(t.ids) for t in drv.seen[0]] == [8] and batch.env_mask[0].tolist() == [0] * 8 + [1] * 15
    # the others: 8 + 3 + 8 + 3 + 1, the last turn cut by the episode budget (room 1 < max_turn_tokens)
    for r in range(1, 6):
        assert [(len(t.ids), t.ended, t.room) for t in drv.seen[r]] == [(8, "length", 15), (8, "length", 4),
                                                                        (1, "budget", 0)]
        assert batch.env_mask[r].tolist() == [0] * 8 + [1] * 3 + [0] * 8 + [1] * 3 + [0]
    # an observation that fills the room exactly leaves none for a turn: truncated too
    drv = ScriptedDriver(lambda b: 10, lambda b, k: [ord("z")] * 12, max_turn_tokens=8)
    batch = run(model, drv, max_new_tokens=20, ignore_eos=True)
    assert batch.truncated.all() and all(len(s) == 1 for s in drv.seen)


def test_driver_mistakes_are_named(models, one_thread):
    model = models("llama")

    class Short(ScriptedDriver):
        def respond(self, turns):
            return super().respond(turns)[:-1]

    with pytest.raises(ValueError, match="answered 5 replies to 6 turns"):
        run(model, Short(lambda b: 2, obs), max_new_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match="row 0 holds token id 999, outside the model's vocabulary of 258"):
        run(model, ScriptedDriver(lambda b: 2, lambda b, k: [999]), max_new_tokens=8, ignore_eos=True)

    class Text(ScriptedDriver):
        def respond(self, turns):
            return ["text" for _ in turns]

    with pytest.raises(TypeError, match="reply for row 0 must be a list of token ids or None, got 'text'"):
        run(model, Text(lambda b: 2, obs), max_new_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match="max_turn_tokens=0 must be a positive int or None"):
        run(model, ScriptedDriver(lambda b: 2, obs, max_turn_tokens=0), max_new_tokens=8)


def test_turn_stops_cut_at_the_token_completing_a_multi_token_stop():
    """A stop string spanning tokens ("é" is two bytes here, "ab" two letters) ends the turn at the token that
    completes it; the context before the turn never counts; end ids and limits by row."""
    from logitless.rollout.hf_turns import TurnStops

    context = TOK("xxé a", add_special_tokens=False)["input_ids"]  # a stop string inside the context: ignored
    rows = [TOK(t, add_special_tokens=False)["input_ids"] for t in ("zzéq", "zabq", "zzzz", "z!zz")]
    stop = TurnStops(len(context), limits=[4, 4, 3, 4], budget=[False, False, True, False],
                     end_ids=TOK("!", add_special_tokens=False)["input_ids"], stops=["é", "ab"], tokenizer=TOK,
                     device=torch.device("cpu"))
    done = []
    for n in range(1, 5):
        ids = torch.tensor([context + r[:n] for r in rows])
        done.append(stop(ids, None).tolist())
    assert [len(r) for r in rows] == [5, 4, 4, 4]  # "é" is 2 of row 0's tokens
    assert stop.ends == [4, 3, 3, 2] and stop.why == ["stop", "stop", "budget", "eos"]
    assert done[1] == [False, False, False, True] and done[3] == [True] * 4
