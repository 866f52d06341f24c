"""Every agent setting that imports user code (agent.tools, agent.environment, agent.driver) is imported and checked
from the command line before the weights load and before the run folder is claimed: by `--dry-run` of `train` and
`eval`, and by the runs themselves."""

from __future__ import annotations

import pytest

from tests.conftest import reward_module, tiny_qwen2
from tests.test_rundir import _cli, no_model_load  # noqa: F401 (fixture)

VOCAB = 50_257

MODULE = '''
from logitless.rollout.episodes import EpisodeRecord


def search(query: str) -> str:
    """Look a word up.

    Args:
        query: the word
    """
    return query


class Game:
    def reset(self, row):
        return "start"

    def step(self, text):
        return None, 0.0, True


class Driver:
    def __init__(self, tokenizer, rows, num_generations, rounds=2):
        self.turn_end_ids, self.turn_stops, self.max_turn_tokens = [], [], None

    def begin(self, num_rows, num_generations):
        self.n = num_rows

    def respond(self, turns):
        return [None] * len(turns)

    def finish(self):
        return [EpisodeRecord() for _ in range(self.n)]


class HalfDriver:
    def __init__(self, tokenizer, rows, num_generations):
        pass

    def begin(self, num_rows, num_generations):
        pass
'''

MISTAKES = [
    ("agent.environment=dry_tools:Gmae", "agent.environment: module 'dry_tools' has no class 'Gmae'; did you mean "
                                         "'dry_tools:Game'?"),
    ("agent.environment=dry_tool:Game", "agent.environment 'dry_tool:Game': no module 'dry_tool'"),
    ("agent.tools=[dry_tools:serch]", "agent.tools: module 'dry_tools' has no attribute 'serch'; did you mean "
                                      "'dry_tools:search'?"),
    ("agent.tools=[calculater]", "agent.tools: 'calculater' is neither a built-in tool"),
    ("agent.driver=dry_tools:Drver", "agent.driver: module 'dry_tools' has no class 'Drver'; did you mean "
                                     "'dry_tools:Driver'?"),
    ("agent.driver=dry_tools:HalfDriver", "agent.driver: HalfDriver has no method respond(), finish()"),
    ("agent.driver=dry_tools:search", "agent.driver: 'dry_tools:search' is a function, not a class"),
]


@pytest.fixture
def model_dir(tmp_path, monkeypatch, gpt2_tokenizer):
    """A model folder with a config and a tokenizer (no weights: nothing here may load them), and the module of
    tools, environment and drivers importable."""
    reward_module(tmp_path, monkeypatch, "dry_tools", MODULE)
    model = tmp_path / "model"
    model.mkdir()
    tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1).config.to_json_file(model / "config.json")
    gpt2_tokenizer.save_pretrained(model)
    return model


def _args(model, run):
    return [f"model.name_or_path={model}", "data.options={difficulty: 1, n: 20, chat: false}",
            f"train.output_dir={run}"]


ONE_EACH = [MISTAKES[0], MISTAKES[2], MISTAKES[4]]  # a misspelt environment, tool and driver
CASES = [(["train", "--dry-run"], *m) for m in MISTAKES] + [
    (command, *m) for command in (["eval", "--dry-run"], ["train"], ["eval"]) for m in ONE_EACH]


@pytest.mark.parametrize("command, setting, message", CASES, ids=[" ".join(c[0]) + " " + c[1] for c in CASES])
def test_a_misspelt_agent_setting_fails_before_the_weights_load(tmp_path, model_dir, capsys, no_model_load,  # noqa: F811
                                                                command, setting, message):
    """`--dry-run` and the runs themselves (train, eval) refuse it naming the key, without loading the weights
    (no_model_load) or claiming the run folder."""
    run = tmp_path / "run"
    code, err = _cli(capsys, *command, *_args(model_dir, run), setting)
    assert code == 1 and message in err, err
    assert "the model was loaded" not in err
    assert not run.exists()  # the run folder was never claimed


@pytest.mark.parametrize("command", [["train", "--dry-run"], ["eval", "--dry-run"]])
def test_dry_run_passes_a_good_driver_and_names_it(tmp_path, model_dir, capsys, no_model_load, command):  # noqa: F811
    code, err = _cli(capsys, *command, *_args(model_dir, tmp_path / "run"), "agent.driver=dry_tools:Driver",
                     "agent.driver_options={rounds: 3}")
    assert code == 0 and "checked: agent: the driver dry_tools:Driver imports and takes agent.driver_options" in err
    code, err = _cli(capsys, *command, *_args(model_dir, tmp_path / "run"), "agent.driver=dry_tools:Driver",
                     "agent.driver_options={round: 3}")
    assert code == 1 and "agent.driver_options: Driver(tokenizer=..., rows=..., num_generations=..., round=...) " \
                         "cannot be called" in err
    assert not (tmp_path / "run").exists()
