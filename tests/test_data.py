from __future__ import annotations

import io
import json
import sys

import pytest

from logitless.data import (
    ARITH_LEVELS,
    GSM8K_SAMPLE,
    PromptRow,
    PromptSampler,
    load_hf_prompts,
    load_jsonl_prompts,
    load_task,
)
from logitless.data.tasks import arithmetic_split_of, gsm8k_answer


def write_jsonl(tmp_path, records, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(p)


RECS = [{"q": "What is 2 + 3?", "sol": "5", "id": 1}, {"q": "What is 4 + 4?", "sol": "8", "id": 2}]


def test_jsonl_chat_prompts_with_system_and_field_map(tmp_path):
    rows = load_jsonl_prompts(write_jsonl(tmp_path, RECS), prompt_field="q", answer_field="sol", system_prompt="Be brief.")
    assert rows[0] == PromptRow(
        prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
        fields={"sol": "5", "id": 1, "answer": "5"},
    )
    rows = load_jsonl_prompts(write_jsonl(tmp_path, RECS), prompt_field="q", field_map={"gold": "sol"}, chat=False)
    assert rows[1].prompt == "What is 4 + 4?" and rows[1].fields["gold"] == "8" and "answer" not in rows[1].fields


def test_jsonl_template_and_raw_text(tmp_path):
    rows = load_jsonl_prompts(
        write_jsonl(tmp_path, RECS), prompt_field="q", template="Q{id}: {q}\nA:", system_prompt="Sys", chat=False,
    )
    assert rows[1].prompt == "Sys\n\nQ2: What is 4 + 4?\nA:"
    assert rows[1].fields["q"] == "What is 4 + 4?"  # with a template every record field stays a row field


def test_jsonl_existing_chat_messages(tmp_path):
    recs = [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}]
    rows = load_jsonl_prompts(write_jsonl(tmp_path, recs), prompt_field="messages", system_prompt="S")
    assert rows[0].prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    bad = [{"messages": [{"text": "hi"}]}]
    with pytest.raises(ValueError, match="list of {'role', 'content'} dicts"):
        load_jsonl_prompts(write_jsonl(tmp_path, bad), prompt_field="messages")


def test_missing_field_names_field_and_available_fields(tmp_path):
    path = write_jsonl(tmp_path, RECS)
    with pytest.raises(ValueError, match=r"row 0 has no field 'question' \(needed as prompt_field\); "
                                         r"available fields: \['id', 'q', 'sol'\]"):
        load_jsonl_prompts(path, prompt_field="question")
    with pytest.raises(ValueError, match=r"no field 'answer' \(needed as field_map/answer_field source\)"):
        load_jsonl_prompts(path, prompt_field="q", answer_field="answer")
    with pytest.raises(ValueError, match=r"no field 'topic' \(needed as template placeholder\)"):
        load_jsonl_prompts(path, prompt_field="q", template="{topic}: {q}")


def test_empty_and_malformed_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_jsonl_prompts(str(empty))
    with pytest.raises(ValueError, match="does not exist"):
        load_jsonl_prompts(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_jsonl_prompts(str(bad))


def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_offset(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    lines = [json.dumps({"prompt": "a"}).encode() + b"\n", json.dumps({"prompt": "b"}).encode() + b"\n",
             '{"prompt": "caf\u00e9"}\n'.encode("latin-1")]
    bad.write_bytes(b"".join(lines))
    offset = len(lines[0]) + len(lines[1]) + lines[2].index(b"\xe9")
    with pytest.raises(ValueError) as e:
        load_jsonl_prompts(str(bad))
    msg = str(e.value)
    assert f"prompt file '{bad}' line 3 is not UTF-8: byte 0xe9 at byte offset {offset} of the file" in msg
    assert "Save the file as UTF-8" in msg and "iconv" in msg
    assert load_jsonl_prompts(str(bad), limit=2)[1].prompt[-1]["content"] == "b"  # reading stops before it


def test_a_leading_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a", "answer": "1"}).encode() + b"\n")
    assert load_jsonl_prompts(str(path), chat=False)[0] == PromptRow(prompt="a", fields={"answer": "1"})


def test_a_file_is_read_as_a_stream_with_progress(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)])
    calls = []
    rows = load_jsonl_prompts(path, chat=False, progress=lambda done, total, n: calls.append((done, total, n)))
    size = (tmp_path / "d.jsonl").stat().st_size
    assert len(rows) == 10 and calls[-1] == (size, size, 10)
    first = [next(iter(r.fields)) for r in rows]  # one string per field name, whatever the row count
    assert all(name is first[0] for name in first)


def test_a_large_file_shows_progress_through_the_trainer_console(tmp_path, monkeypatch):
    from rich.console import Console

    from logitless.trainer import builders
    from logitless.trainer.config.schema import DataConfig

    path = write_jsonl(tmp_path, [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)])
    monkeypatch.setattr(builders, "BIG_FILE", 1)  # every file counts as large
    out = io.StringIO()
    rows = builders.load_rows(DataConfig(task="jsonl", options={"path": path}), console=Console(file=out, width=200))
    assert len(rows) == 5
    lines = out.getvalue().splitlines()  # not a terminal: a line before and one after, no bar
    assert lines[0].startswith(f"reading {path}") and lines[-1].startswith(f"read 5 rows of {path}")
    # the callback is the trainer's: data.options cannot name it
    with pytest.raises(ValueError, match="data.options.progress: data.task='jsonl' has no option 'progress'"):
        from logitless.trainer.preflight import check_task_options

        check_task_options("jsonl", {"path": path, "progress": 1}, "data.options")


def test_hf_prompts_via_datasets_json_builder(tmp_path):
    pytest.importorskip("datasets")
    path = write_jsonl(tmp_path, RECS)
    rows = load_hf_prompts("json", "train", prompt_field="q", answer_field="sol", data_files=path,
                           cache_dir=str(tmp_path / "cache"))
    assert [r.prompt[-1]["content"] for r in rows] == ["What is 2 + 3?", "What is 4 + 4?"]
    assert [r.fields["answer"] for r in rows] == ["5", "8"]
    with pytest.raises(ValueError, match=r"no field 'prompt'.*available fields: \['id', 'q', 'sol'\]"):
        load_hf_prompts("json", "train", data_files=path, cache_dir=str(tmp_path / "cache"))


def test_hf_prompts_without_datasets_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        load_hf_prompts("openai/gsm8k", "test")


# sha256 of the first 50 lines of test.jsonl in github.com/openai/grade-school-math (grade_school_math/data)
GSM8K_TEST_HEAD_SHA256 = "4718cc77e7d7b11c3fc2a049d7a0dbda483fc4bd37e5432488c9f9d0f2cf181a"


def test_gsm8k_sample_matches_real_test_rows():
    import hashlib

    assert hashlib.sha256(GSM8K_SAMPLE.read_bytes()).hexdigest() == GSM8K_TEST_HEAD_SHA256  # the real rows, unchanged
    real = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]
    rows = load_task("gsm8k", "sample")
    assert len(rows) == 50 == len(real)
    for row, rec in zip(rows, real):
        assert row.fields["solution"] == rec["answer"]
        assert row.fields["answer"] == rec["answer"].split("####")[-1].strip().replace(",", "")
        assert rec["question"] in row.prompt[-1]["content"]
    # a local path gives the same rows; answers with thousands separators lose their commas
    from_path = load_task("gsm8k", "test", path=str(GSM8K_SAMPLE), limit=50)
    assert from_path == rows
    assert gsm8k_answer("so 1,000 + 200\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_answer("no final answer")


def test_gsm8k_prompt_format_is_configurable():
    rows = load_task("gsm8k", "sample", template="Q: {question}\nA:", system_prompt=None, chat=False, limit=2)
    assert len(rows) == 2 and rows[0].prompt.startswith("Q: Janet") and rows[0].prompt.endswith("\nA:")


@pytest.mark.parametrize("difficulty", sorted(ARITH_LEVELS))
def test_arithmetic_answers_are_correct(difficulty):
    rows = load_task("arithmetic", "train", n=200, difficulty=difficulty, seed=3)
    for r in rows:
        expr = r.fields["expression"]
        assert set(expr) <= set("0123456789 +-*()")
        assert int(r.fields["answer"]) == eval(expr)  # ground truth: Python's own arithmetic on our digits
        assert r.prompt == [
            {"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": f"What is {expr}? Answer with the number only."},
        ]
    operands = [int(t) for r in rows for t in r.fields["expression"].replace("(", "").replace(")", "").split()
                if t.isdigit()]
    if difficulty == 1:
        assert max(operands) <= 9 and min(int(r.fields["answer"]) for r in rows) >= 0
    if difficulty == 2:
        assert min(operands) >= 10 and max(operands) <= 99
    if difficulty == 3:
        assert max(operands) >= 100 and any("*" in r.fields["expression"] for r in rows)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_arithmetic_train_and_test_never_overlap(difficulty):
    n_test = 20 if difficulty == 1 else 300
    test = load_task("arithmetic", "test", n=n_test, difficulty=difficulty, seed=0)
    test_exprs = {r.fields["expression"] for r in test}
    assert len(test_exprs) == n_test  # the test split has no repeats
    for seed in (0, 1):
        train = {r.fields["expression"] for r in load_task("arithmetic", "train", n=2000, difficulty=difficulty, seed=seed)}
        assert train.isdisjoint(test_exprs)
    assert all(arithmetic_split_of(e, 0.2) == "test" for e in test_exprs)


def test_arithmetic_seeded_reproducibility():
    a = load_task("arithmetic", "train", n=50, difficulty=2, seed=5)
    b = load_task("arithmetic", "train", n=50, difficulty=2, seed=5)
    c = load_task("arithmetic", "train", n=50, difficulty=2, seed=6)
    assert a == b and a != c


def test_arithmetic_bad_options():
    with pytest.raises(ValueError, match="difficulty must be one of"):
        load_task("arithmetic", "train", difficulty=9)
    with pytest.raises(ValueError, match="too few distinct test problems"):
        load_task("arithmetic", "test", n=500, difficulty=1)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        load_task("arithmetic", "validation")
    with pytest.raises(ValueError, match=r"task 'arithmetic' has no option 'difficultly'; did you mean 'difficulty'\?"):
        load_task("arithmetic", "train", difficultly=2)
    with pytest.raises(ValueError, match=r"unknown task 'gsm9k'; did you mean 'gsm8k'\?"):
        load_task("gsm9k", "test")


def test_sampler_epochs_are_permutations_and_seeded():
    rows = list(range(10))
    s = PromptSampler(rows, seed=1)
    first, second = s.next_batch(10), s.next_batch(10)
    assert sorted(first) == rows and sorted(second) == rows and first != second and first != rows
    assert PromptSampler(rows, seed=1).next_batch(20) == first + second
    assert PromptSampler(rows, seed=2).next_batch(10) != first
    assert PromptSampler(rows, shuffle=False).next_batch(13) == rows + rows[:3]


def test_sampler_resume_sees_the_same_prompts():
    rows = [f"p{i}" for i in range(7)]
    ref = PromptSampler(rows, seed=3)
    uninterrupted = [ref.next_batch(3) for _ in range(10)]  # batches cross epoch boundaries (7 rows)
    s = PromptSampler(rows, seed=3)
    got = [s.next_batch(3) for _ in range(4)]
    state = json.loads(json.dumps(s.state_dict()))  # survives serialization
    resumed = PromptSampler(rows, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(3) for _ in range(6)]
    assert got == uninterrupted
    assert state["epoch"] == 1 and state["index"] == 5


def test_sampler_bad_inputs():
    with pytest.raises(ValueError, match="empty dataset"):
        PromptSampler([])
    s = PromptSampler([1, 2, 3], seed=0)
    with pytest.raises(ValueError, match="positive int"):
        s.next_batch(0)
    with pytest.raises(ValueError, match="saved for 3 rows but the dataset has 4"):
        PromptSampler([1, 2, 3, 4]).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed=0.*this sampler has seed=1"):
        PromptSampler([1, 2, 3], seed=1).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="missing 'index'"):
        s.load_state_dict({"seed": 0, "epoch": 0})
