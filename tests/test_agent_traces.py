"""Episode traces (agent.trace_episodes): a sample of each step's episodes in the run folder's episodes.jsonl, the
same for `logitless eval --output`, none with 0; a resumed run drops the lines of the steps it redoes."""

from __future__ import annotations

import json

import pytest

from logitless.rollout.episodes import EpisodeRecord
from logitless.trainer.report.traces import TRACES_FILE, EpisodeTraces, batch_traces, traced_rows
from logitless.trainer.rundir import write_atomic
from tests.conftest import tiny_qwen2
from tests.test_trainer import VOCAB, _cfg, _train, rewards_module, tok  # noqa: F401 (fixtures)
from tests.test_trainer_agent import AGENT, env_module  # noqa: F401 (fixture)

FIELDS = {"step", "sample", "prompt", "answer", "messages", "turns", "tool_calls", "tool_errors", "truncated",
          "episode_reward", "turn_rewards", "rewards", "reward", "metrics", "advantage"}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_traces_n_episodes_per_step(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    run = tmp_path / "run"
    _train(_cfg(run, *AGENT, "train.max_steps=2", "agent.trace_episodes=3"), tok)
    lines = _lines(run / TRACES_FILE)
    assert len(lines) == 3 * 2 and [t["step"] for t in lines] == [1, 1, 1, 2, 2, 2]
    for t in lines:
        assert set(t) == FIELDS
        assert t["sample"] in (0, 2, 5)  # 3 of the step's 8 episodes, spread over its 2 prompts
        roles = [m["role"] for m in t["messages"]]
        assert roles[0] == "assistant" and roles.count("assistant") == t["turns"] > 1
        assert "user" in roles and any("left]" in m["content"] for m in t["messages"])  # the observations
        assert set(t["rewards"]) == {"numeric_answer", "digits", "environment"}
        assert len(t["turn_rewards"]) == t["turns"]  # Countdown's step rewards, turn by turn
        given = [r for r in t["turn_rewards"] if r is not None]
        assert t["episode_reward"] == (pytest.approx(sum(given)) if given else None)
        assert t["rewards"]["environment"] == t["episode_reward"]
        assert isinstance(t["advantage"], float) and "observation_tokens" in t["metrics"]
    metrics = _lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]


def test_trace_episodes_0_writes_no_file(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    run = tmp_path / "run"
    _train(_cfg(run, *AGENT, "train.max_steps=1", "agent.trace_episodes=0"), tok)
    assert (run / "metrics.jsonl").is_file() and not (run / TRACES_FILE).exists()


def test_eval_writes_its_traces_beside_its_output(tmp_path, tok, rewards_module, env_module):  # noqa: F811
    from logitless.trainer.builders import load_rows
    from logitless.trainer.evaluate import evaluate, traces_path, write_eval

    def run_eval(n):
        cfg = _cfg(tmp_path / "run", *AGENT, "eval.num_prompts=3", "eval.pass_k=2", f"agent.trace_episodes={n}",
                   "data.eval_options={unique: false}", "eval.batch_size=2")
        model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
        return evaluate(model, tok, load_rows(cfg.data, eval=True)[:3], cfg, split="test")

    out = tmp_path / "eval.json"
    write_eval(run_eval(4), out, step=7)
    assert traces_path(out) == tmp_path / "eval.episodes.jsonl"
    lines = _lines(traces_path(out))
    assert [t["sample"] for t in lines] == [0, 1, 3, 4]  # 4 of 6 samples, over both chunks of 2 prompts
    assert all(t["step"] == 7 and t["turns"] > 1 and set(t) == FIELDS - {"advantage"} for t in lines)
    assert "traces" not in json.loads(out.read_text())
    write_eval(run_eval(0), tmp_path / "none.json")
    assert not traces_path(tmp_path / "none.json").exists()


def test_traces_keep_tool_calls_and_a_resumed_run_drops_later_steps(tmp_path):
    from logitless.data import PromptRow

    call = {"type": "function", "id": "000000000", "function": {"name": "calculator", "arguments": {"x": {1, 2}}}}
    record = EpisodeRecord(messages=[{"role": "assistant", "content": "", "tool_calls": [call]},
                                     {"role": "tool", "name": "calculator", "content": "3", "tool_call_id": "000000000"},
                                     {"role": "assistant", "content": "3"}], turns=2, tool_calls=1)
    rows = [PromptRow(prompt="1+2?", fields={"answer": "3"})] * 4
    traces = EpisodeTraces(tmp_path, 2, 0, write_atomic)
    for step in (1, 2, 3):
        traces.write(step, batch_traces(traced_rows(4, 2), rows, [record] * 4, ["r"], [[1.0]] * 4, [1.0] * 4))
    lines = _lines(tmp_path / TRACES_FILE)
    assert [t["step"] for t in lines] == [1, 1, 2, 2, 3, 3] and [t["sample"] for t in lines[:2]] == [0, 2]
    assert lines[0]["messages"][0]["tool_calls"][0]["function"]["arguments"] == {"x": "{1, 2}"}  # not JSON: as text
    assert lines[0]["messages"][1] == {"role": "tool", "name": "calculator", "content": "3",
                                       "tool_call_id": "000000000"}
    EpisodeTraces(tmp_path, 2, 2, write_atomic)  # a run resumed from step 2 writes step 3 again
    assert [t["step"] for t in _lines(tmp_path / TRACES_FILE)] == [1, 1, 2, 2]
    EpisodeTraces(tmp_path, 2, 0, write_atomic)  # a new run in the folder
    assert (tmp_path / TRACES_FILE).read_text() == ""
    assert traced_rows(3, 5) == [0, 1, 2] and traced_rows(8, 0) == [] and traced_rows(10, 4) == [0, 2, 5, 7]
