"""Turn-level credit (advantage.credit=turn) in the trainer: how an episode's rewards become per-turn rewards
(step rewards on their turns, episode-level rewards on the last), the driver contract it checks, a short CPU run
whose traced per-turn advantages are the ones computed from its traced rewards, and the settings refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from logitless.configlib import ConfigError
from logitless.rollout.episodes import EpisodeRecord
from logitless.trainer.episodes import ENVIRONMENT_REWARD, turn_rewards
from logitless.trainer.preflight import validate_config
from logitless.trainer.report.traces import TRACES_FILE
from tests.test_trainer import _cfg, _train, rewards_module, tok  # noqa: F401 (fixtures)
from tests.test_trainer_agent import AGENT, env_module  # noqa: F401 (fixture)
from tests.test_turn_credit import oracle


class _Batch:  # the fields of an episode RolloutBatch that `turn_rewards` reads
    def __init__(self, records, completion, env):
        self.episodes, self.completion_mask, self.env_mask = records, torch.tensor(completion), torch.tensor(env)


def test_step_rewards_stay_on_their_turns_and_episode_rewards_go_on_the_last():
    completion = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    env = [[0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    records = [
        EpisodeRecord(turns=3, turn_rewards=[1.0, None, 2.0], reward=3.0 + 0.25),  # 0.25: the final reward()
        EpisodeRecord(turns=2, turn_rewards=[None, 4.0], reward=4.0),
        EpisodeRecord(turns=1),  # a driver that reports no step rewards: its reward goes on its one turn
    ]
    names = ["accuracy", "format", ENVIRONMENT_REWARD]
    cols = torch.tensor([[1.0, 0.5, 3.25], [float("nan"), 0.5, 4.0], [0.0, float("nan"), float("nan")]])
    r, turns, index = turn_rewards(_Batch(records, completion, env), cols, names, (2.0, 1.0, 0.5))
    assert turns.tolist() == [3, 2, 1]
    assert r[0].tolist() == [0.5, 0.0, 1.0 + 2.0 + 0.5 + 0.5 * 0.25]
    assert r[1].tolist() == [0.0, 2.0 + 0.5, 0.0]
    assert r[2].tolist() == [0.0, 0.0, 0.0]
    assert r.sum(1).tolist() == pytest.approx([2.0 + 0.5 + 0.5 * 3.25, 0.5 + 0.5 * 4.0, 0.0])  # the weighted totals
    cols[2] = float("nan")  # every column None: unscorable
    assert torch.isnan(turn_rewards(_Batch(records, completion, env), cols, names, (2.0, 1.0, 0.5))[0][2]).all()


def test_records_that_break_the_driver_contract_are_refused():
    completion, env = [[1, 1, 1]], [[0, 1, 0]]
    cols = torch.tensor([[1.0, 1.0]])
    names = ["accuracy", ENVIRONMENT_REWARD]
    with pytest.raises(ValueError, match=r"2 model turns .* 3 turn_rewards.*advantage.credit=episode"):
        turn_rewards(_Batch([EpisodeRecord(turn_rewards=[1.0, None, 0.0], reward=1.0)], completion, env), cols,
                     names, (1.0, 1.0))
    with pytest.raises(ValueError, match=r"turn_rewards but reward=None"):
        turn_rewards(_Batch([EpisodeRecord(turn_rewards=[1.0, None], reward=None)], completion, env), cols,
                     names, (1.0, 1.0))


def test_a_run_with_turn_credit_trains_each_turn_on_its_own_advantage(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    """2 steps of Countdown (3 turns, a step reward on turns of odd length, environment weight 0.5) with
    credit=turn, γ = 0.9: every episode is traced with its turns' advantages, which equal the direct computation
    from the traced rewards (reward functions' scores on the last turn), and differ from turn to turn."""
    run = tmp_path / "run"
    result = _train(_cfg(run, *AGENT, "train.max_steps=2", "agent.trace_episodes=8", "advantage.credit=turn",
                         "advantage.turn_discount=0.9"), tok)
    assert result.step == 2
    lines = [json.loads(x) for x in (run / TRACES_FILE).read_text().splitlines()]
    assert len(lines) == 2 * 8
    differ = 0
    for step in (1, 2):
        traced = sorted((t for t in lines if t["step"] == step), key=lambda t: t["sample"])
        episodes = []
        for t in traced:
            assert len(t["turn_advantages"]) == t["turns"] == len(t["turn_rewards"])
            steps = [0.5 * (x if x is not None else 0.0) for x in t["turn_rewards"]]
            funcs = [v for k, v in t["rewards"].items() if k != ENVIRONMENT_REWARD and v is not None]
            steps[-1] += sum(funcs)  # Countdown has no final reward(): its episode reward is its step rewards'
            episodes.append(steps)
        want = oracle(episodes, 0.9, "turn", "grpo", "group", group_size=4)
        for t, row in zip(traced, want):
            assert t["turn_advantages"] == pytest.approx(row, rel=1e-4, abs=1e-5)
            differ += len({round(a, 6) for a in t["turn_advantages"]}) > 1
    assert differ > 0  # some episode's turns got different advantages
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["episode/turns_mean"] > 1 and 0 <= r["zero_variance_turns"] <= 1
        assert math.isfinite(r["advantage"]) and math.isfinite(r["advantage/return"])
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0


def test_turn_credit_without_an_agent_or_with_gdpo_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"advantage.credit=turn .* no agent.* set agent.environment .* or "
                                         r"advantage.credit=episode"):
        validate_config(_cfg(tmp_path / "run", "advantage.credit=turn"))
    with pytest.raises(ConfigError, match=r"'advantage'.*normalize_then_sum"):
        _cfg(tmp_path / "run", *AGENT, "advantage.credit=turn", "advantage.multi_reward=normalize_then_sum")
    with pytest.raises(ConfigError, match=r"'advantage'.*turn_discount=0.5 only applies to credit='turn'"):
        _cfg(tmp_path / "run", *AGENT, "advantage.turn_discount=0.5")


def test_dynamic_sampling_keeps_groups_whose_turns_carry_signal(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    """train.dynamic_sampling with credit=turn: groups are informative when some turn advantage is non-zero, and
    the kept groups' turn advantages are computed again over them (the same function as a plain step's)."""
    (r,) = _train(_cfg(tmp_path / "run", *AGENT, "train.max_steps=1", "advantage.credit=turn",
                       "train.dynamic_sampling=true"), tok).records
    assert r["dynamic/kept"] == 2 and math.isfinite(r["advantage"]) and r["grad_norm"] > 0
