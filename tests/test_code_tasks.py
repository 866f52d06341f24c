"""Code and MATH-500 tasks shipped in the package, the example config, and a tiny training run on code_tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from logitless.data import load_task
from logitless.rewards import code_tests, math_verify
from logitless.trainer.config.schema import load_train_config

REPO = Path(__file__).resolve().parents[1]


def test_shipped_code_tasks_have_passing_reference_solutions_and_failing_stubs():
    train, test = load_task("code", "train"), load_task("code", "test")
    assert len(train) == 30 and len(test) == 10
    assert not {r.fields["task_id"] for r in train} & {r.fields["task_id"] for r in test}
    rows = train + test
    solutions = [f"```python\n{r.fields['solution']}```" for r in rows]
    tests = [r.fields["tests"] for r in rows]
    assert code_tests([""] * len(rows), solutions, tests=tests, timeout_seconds=5.0, num_workers=2) == [1.0] * len(rows)
    stubs = [f"def {r.fields['entry_point']}(*args):\n    return None\n" for r in rows]
    assert max(code_tests([""] * len(rows), stubs, tests=tests, num_workers=2)) < 0.5  # the tests test something
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        load_task("code", "validation")


def test_code_task_from_a_jsonl_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "Write f()", "tests": ["assert f() == 1"]}) + "\n")
    rows = load_task("code", path=str(path), chat=False)
    assert rows[0].fields["tests"] == ["assert f() == 1"] and "Write f()" in rows[0].prompt
    path.write_text(json.dumps({"prompt": "Write f()"}) + "\n")
    with pytest.raises(ValueError, match="row 0 needs a non-empty 'tests' field"):
        load_task("code", path=str(path))


def test_math500_answers_verify_against_themselves_and_not_against_others():
    rows = load_task("math500", "test")
    assert len(rows) == 500 and {"answer", "solution", "subject", "level"} <= set(rows[0].fields)
    some = rows[:60]
    answers = [r.fields["answer"] for r in some]
    right = math_verify([""] * 60, [f"The answer is $\\boxed{{{a}}}$." for a in answers], answer=answers)
    assert right == [1.0] * 60
    wrong = math_verify([""] * 60, [f"The answer is $\\boxed{{{a}}}$." for a in answers[1:] + answers[:1]],
                        answer=answers)
    assert sum(w == 1.0 for w in wrong) <= 3  # neighbours rarely share an answer
    with pytest.raises(ValueError, match="only the 'test' split"):
        load_task("math500", "train")


def test_example_configs_load():
    cfg = load_train_config(str(REPO / "examples" / "code.yaml"), [])
    assert cfg.data.task == "code" and cfg.reward.reward_funcs == ["code_tests"]
    cfg = load_train_config(str(REPO / "examples" / "gsm8k.yaml"), [])
    assert cfg.data.task == "gsm8k" and cfg.train.packed == "auto" and cfg.rollout.backend == "auto"
    # on a 24 GiB GPU, auto gives the measured fast settings of bench/LOG.md (the model's shape: no weights read)
    from bench.bench_plan import skeleton
    from logitless.trainer.memory.auto import resolve

    fast = resolve(cfg, device=torch.device("cuda"), skeleton=skeleton("1.5b"), free_gib=24.0).cfg
    assert fast.rollout.backend == "static" and fast.train.packed is True and fast.model.compile_layers is True
    assert fast.model.gradient_checkpointing is True and fast.train.micro_batch_tokens >= 16384


def test_tiny_end_to_end_run_with_code_tests(tmp_path, gpt2_tokenizer, monkeypatch):
    from logitless.trainer.loop import train
    from tests.conftest import tiny_qwen2

    tok = copy.deepcopy(gpt2_tokenizer)  # the fixture is shared by the whole session: leave it as it is
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    (tmp_path / "len_reward.py").write_text(
        "def length(prompts, completions, **fields):\n    return [0.01 * len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write f{i}()", "tests": ["assert True", "x = 1\nassert x"]}) + "\n"
                            for i in range(4)))
    cfg = load_train_config(None, [
        f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2", "train.prompts_per_step=2",
        "train.micro_batch_size=4", "rollout.num_generations=4", "rollout.max_completion_length=4",
        "data.task=code", f"data.options={{path: {data}, chat: false}}",
        "reward.reward_funcs=[code_tests, len_reward:length]",
        "reward.reward_options={code_tests: {timeout_seconds: 2.0, num_workers: 2}}",
        "optim.learning_rate=0.05", "model.lora_r=4", "model.lora_alpha=8", "logging.tensorboard=false",
        "logging.progress=false", "logging.log_completions=false", "logging.plot=false", "checkpoint.save_steps=2",
    ])
    result = train(cfg, model=tiny_qwen2(vocab_size=50_257, hidden=32, layers=1), tokenizer=tok)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.step == 2 and len(records) == 2
    assert all(0.0 <= r["reward/code_tests/mean"] <= 1.0 for r in records)
    assert records[-1]["grad_norm"] > 0
