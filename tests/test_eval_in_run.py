"""Held-out eval during training (eval.every_steps, eval.on_start): on schedule, equal to evaluating the saved
policy afterwards, invisible to training, and kept by an exact resume."""

from __future__ import annotations

import json

import pytest

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import load_rows
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.evaluate import evaluate
from logitless.trainer.loop import train
from logitless.trainer.policy.modeling import prepare_for_training
from logitless.trainer.report.plot import plot_run
from logitless.trainer.preflight import validate_config
from tests.conftest import TINY_LORA_QUIET, reward_module, tiny_qwen2
from tests.pngcheck import curve_cells
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

VOCAB = 50_257
TIMING = ("time/", "tokens_per_s", "train_tokens_per_s", "memory/")


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "eval_rewards", '''
        def even_length(prompts, completions, **fields):
            """1 for a completion of an even number of characters: a random model gets about half "right"."""
            return [float(len(c) % 2 == 0) for c in completions]

        def digits(prompts, completions, **fields):
            return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in completions]
    ''')


def _cfg(run_dir, *overrides):
    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=4", "train.prompts_per_step=2", "train.micro_batch_size=8",
        "rollout.num_generations=4", "rollout.max_completion_length=5", "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[eval_rewards:even_length, eval_rewards:digits]", "optim.learning_rate=0.05",
        "reward.accuracy_reward=eval_rewards:even_length",  # (a function of one's own logs an accuracy when named)
        *TINY_LORA_QUIET, "checkpoint.save_steps=2", "checkpoint.save_total_limit=null",
        "eval.every_steps=3", "eval.on_start=true", "eval.num_prompts=8", "eval.batch_size=5",
        "data.eval_options={n: 8}", *overrides,
    ])


def _model():
    return tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def _eval_keys(record):
    return {k: v for k, v in record.items() if k.startswith("eval/")}


def test_eval_on_schedule_equals_evaluating_the_policy_of_that_step(tmp_path, tok, rewards_module, one_thread):
    cfg = _cfg(tmp_path / "run", "logging.plot=true", "checkpoint.save_steps=1")
    result = train(cfg, model=_model(), tokenizer=tok)
    evals = {r["step"]: _eval_keys(r) for r in result.records if _eval_keys(r)}
    assert sorted(evals) == [0, 3, 4]  # on_start, every 3 steps, and the last step
    assert all(sorted(e) == ["eval/accuracy", "eval/completion_length", "eval/reward"] for e in evals.values())
    assert all(0 <= e["eval/accuracy"] <= 1 for e in evals.values())
    assert len({e["eval/reward"] for e in evals.values()}) == 3  # values that tell the policies apart
    rows = load_rows(cfg.data, "test", eval=True)
    for step in (0, 3):  # the oracle: the policy of that step, loaded from its checkpoint, evaluated alone
        model = prepare_for_training(_model(), cfg.model)
        if step:
            ckpt.load_model_weights(model, tmp_path / "run" / "checkpoints" / ckpt.step_dirname(step) / "model")
        want = evaluate(model.eval(), tok, rows, cfg, split="test").metrics()
        assert evals[step] == pytest.approx(want, rel=1e-12), step
    assert evals[3] != evals[0]  # training changed the held-out completions
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4]
    assert all(r["time/eval"] > 0 for r in lines if _eval_keys(r))
    # the curves: the held-out eval is one more panel than the same metrics without eval/* draw
    with_eval = sum(map(sum, curve_cells(tmp_path / "run" / "curves.png")))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if not k.startswith("eval/")}) + "\n" for r in lines))
    assert with_eval == sum(map(sum, curve_cells(plot_run(tmp_path / "bare")))) + 1 == 10


def test_eval_changes_nothing_in_training_and_resume_keeps_its_schedule(tmp_path, tok, rewards_module, one_thread):
    plain = train(_cfg(tmp_path / "plain", "eval.every_steps=0", "eval.on_start=false"), model=_model(), tokenizer=tok)
    full = train(_cfg(tmp_path / "full"), model=_model(), tokenizer=tok)
    trained = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in _untimed(full.records) if r["step"]]
    assert trained == _untimed(plain.records)  # the eval draws nothing from the training's RNG or data

    def crash(event, step):
        if event == "after_rollout" and step == 3:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train(_cfg(tmp_path / "cut"), model=_model(), tokenizer=tok, hook=crash)
    resumed = train(_cfg(tmp_path / "cut"), model=_model(), tokenizer=tok, resume=tmp_path / "cut")
    assert _untimed(resumed.records) == _untimed(full.records[3:])  # steps 3 (eval), 4 (eval)
    assert [r["step"] for r in resumed.records if _eval_keys(r)] == [3, 4]
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert _untimed(lines) == _untimed(json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())


def test_sampled_eval_logs_pass_at_k(tmp_path, tok, rewards_module, one_thread):
    cfg = _cfg(tmp_path / "run", "train.max_steps=1", "eval.on_start=false", "eval.pass_k=3", "rollout.temperature=1.0")
    rec = train(cfg, model=_model(), tokenizer=tok).records[0]
    assert rec["eval/accuracy"] <= rec["eval/pass@3"] <= 1 and rec["eval/pass@3"] > 0
    assert plot_run(tmp_path / "run").is_file()


@pytest.mark.parametrize("overrides, match", [
    (["eval.every_steps=-1"], r"eval.every_steps must be >= 0"),
    (["eval.pass_k=4", "eval.temperature=0"], r"eval.temperature=0.0: use a temperature > 0 for pass_k=4"),
    (["train.async_rollout=true", "rollout.backend=static"], r"train.async_rollout=true keeps busy"),
])
def test_bad_eval_settings_are_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(tmp_path / "run", *overrides))
