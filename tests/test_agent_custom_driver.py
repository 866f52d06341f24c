"""Your own episode driver named in the config (`agent.driver: module:Class`): it trains like the built-in driver
(its tokens out of the loss, the sampler's logprobs the trainer's, its records' rewards and metrics logged), and a
bad class or bad options are refused before the weights load, naming agent.driver and the fix."""

from __future__ import annotations

import pytest

from logitless.agents import AgentOptions
from tests.conftest import reward_module, tiny_qwen2
from tests.test_trainer import VOCAB, _cfg, rewards_module, tok  # noqa: F401 (fixtures)

DRIVER_MODULE = '''
from logitless.rollout.episodes import EpisodeRecord

BUILT = []  # every driver made, in order (one per rollout)


class Echo:
    """Answers each model turn with " [<note> <n>]" (n: the turn's token count) until `rounds` model turns, then
    ends the episode; the episode's reward is its number of turns."""

    def __init__(self, tokenizer, rows, num_generations, rounds=2, note="seen"):
        self.tok, self.rounds, self.note = tokenizer, rounds, note
        self.turn_end_ids, self.turn_stops, self.max_turn_tokens = [], [], 3
        BUILT.append(self)

    def begin(self, num_rows, num_generations):
        self.turns = [[] for _ in range(num_rows)]
        self.replies = [[] for _ in range(num_rows)]

    def respond(self, turns):
        out = []
        for t in turns:
            self.turns[t.row].append(list(t.ids))
            if len(self.turns[t.row]) >= self.rounds:
                out.append(None)
                continue
            ids = self.tok(f" [{self.note} {len(t.ids)}]", add_special_tokens=False)["input_ids"]
            self.replies[t.row].append(ids)
            out.append(ids)
        return out

    def finish(self):
        records = []
        for b, turns in enumerate(self.turns):
            messages = []
            for k, ids in enumerate(turns):
                messages.append({"role": "assistant", "content": self.tok.decode(ids, skip_special_tokens=True)})
                if k < len(self.replies[b]):
                    messages.append({"role": "user", "content": self.tok.decode(self.replies[b][k])})
            records.append(EpisodeRecord(messages=messages, turns=len(turns), reward=float(len(turns)),
                                         metrics={"replies": float(len(self.replies[b]))}))
        return records


class NoRespond:
    def __init__(self, tokenizer, rows, num_generations):
        pass

    def begin(self, num_rows, num_generations):
        pass

    def finish(self):
        return []


class NoStops(Echo):
    def __init__(self, tokenizer, rows, num_generations):
        super().__init__(tokenizer, rows, num_generations)
        del self.turn_stops
'''

DRIVER = ["agent.driver=my_driver:Echo", "agent.driver_options={rounds: 3, note: ok}",
          "rollout.max_completion_length=24", "train.max_steps=2"]


@pytest.fixture
def driver_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "my_driver", DRIVER_MODULE)


def test_a_driver_named_in_the_config_trains_like_the_built_in_one(tmp_path, tok, rewards_module,  # noqa: F811
                                                                    driver_module, monkeypatch):
    """2 steps on CPU (fp32, hf engine): the driver's tokens are exactly the env-masked ones and out of the loss,
    the sampler's logprob of every model token is the trainer's, and its records' rewards and metrics are logged."""
    from logitless.trainer import loop

    rollouts = []
    sample_step = loop.sample_step

    def keep(*args, **kwargs):
        out = sample_step(*args, **kwargs)
        rollouts.append(out[0])
        return out

    monkeypatch.setattr(loop, "sample_step", keep)
    cfg = _cfg(tmp_path / "run", *DRIVER)
    result = loop.train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok)
    import my_driver

    assert result.step == 2 and len(rollouts) == 2 and len(my_driver.BUILT) == 2  # one driver per rollout
    for ro, driver in zip(rollouts, my_driver.BUILT):
        batch = ro.batch.to("cpu")
        assert driver.rounds == 3 and driver.note == "ok"  # built with agent.driver_options
        for b in range(batch.completion_ids.shape[0]):
            env = batch.env_mask[b].bool() & batch.completion_mask[b].bool()
            written = batch.completion_ids[b][env].tolist()
            assert written == [i for ids in driver.replies[b] for i in ids]  # the driver's tokens, and only them
            assert not batch.loss_mask()[b][env].any()  # out of the loss
            assert (batch.sampler_logp[b][env] == 0).all()
        assert batch.env_mask.sum() > 0 and any(len(r) == 2 for r in driver.replies)  # 3-turn episodes happened
    for r in result.records:
        assert r["rollout/mismatch_max"] < 1e-5  # over the model's tokens: an env token would be off by nats
        assert 1 < r["episode/turns_mean"] <= 3 and r["tokens/env_mean"] > 0
        assert r["episode/truncated"] == 0  # the driver ended every episode (3 turns of <= 3 tokens fit 24)
        assert r["reward/environment/mean"] == pytest.approx(r["episode/turns_mean"])  # the records' rewards
        assert 0 < r["episode/replies"] <= r["episode/turns_mean"]  # the records' metrics


@pytest.mark.parametrize("overrides, match", [
    (["agent.driver=no_such_module:Echo"], r"agent.driver 'no_such_module:Echo': no module 'no_such_module'"),
    (["agent.driver=my_driver:Ecko"], r"agent.driver: module 'my_driver' has no class 'Ecko'; did you mean "
                                      r"'my_driver:Echo'\?"),
    (["agent.driver=my_driver:NoRespond"], r"agent.driver: NoRespond has no method respond\(\); an episode driver "
                                           r"implements begin"),
    (["agent.driver=my_driver:Echo", "agent.driver_options={colour: red}"],
     r"agent.driver_options: Echo\(tokenizer=..., rows=..., num_generations=..., colour=...\) cannot be called"),
    (["agent.driver=my_driver:Echo", "agent.driver_options={rows: 3}"], r"agent.driver_options: \['rows'\] are "
                                                                       r"given to every driver"),
])
def test_a_bad_driver_fails_before_the_weights_load(tmp_path, tok, rewards_module, driver_module,  # noqa: F811
                                                    overrides, match):
    from logitless.trainer.loop import train

    run = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        train(_cfg(run, *overrides), model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok)
    assert not run.exists()  # refused before the run folder was claimed


def test_a_driver_without_the_protocols_attributes_is_named(tmp_path, tok, rewards_module, driver_module):  # noqa: F811
    """What an instance must set (turn_stops here) is checked when the rollout builds it, naming the class."""
    from logitless.trainer.loop import train

    with pytest.raises(TypeError, match=r"agent.driver: NoStops.turn_stops must be a list of non-empty strings .*set "
                                        r"it in NoStops.__init__"):
        train(_cfg(tmp_path / "run", "agent.driver=my_driver:NoStops", "train.max_steps=1"),
              model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok)


@pytest.mark.parametrize("kwargs, match", [
    ({"driver": "Echo"}, r"agent.driver='Echo' is invalid: give the class as 'module:Class'"),
    ({"driver": "m:Echo", "tools": ["calculator"]}, r"agent.driver='m:Echo' is invalid: your driver replaces the "
                                                    r"built-in one"),
    ({"driver_options": {"a": 1}}, r"agent.driver_options=.* agent.driver is null"),
])
def test_driver_options_are_checked_when_the_section_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AgentOptions(**kwargs)
    assert AgentOptions(driver="m:Echo").enabled  # a driver alone runs episodes


def test_an_episode_reward_of_the_driver_alone_needs_no_reward_function(tmp_path, driver_module):
    from logitless.trainer.preflight import validate_config

    validate_config(_cfg(tmp_path / "run", "agent.driver=my_driver:Echo", "reward.reward_funcs=[]"))
    with pytest.raises(ValueError, match=r"reward.reward_funcs is empty"):
        validate_config(_cfg(tmp_path / "run", "reward.reward_funcs=[]"))
