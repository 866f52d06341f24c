"""End-to-end training on CPU with a tiny random model: outputs, exact resume, signals, bad input."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
import textwrap

import pytest
import torch

from logitless.rewards import RewardFunctionError
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from tests.conftest import TINY_LORA_QUIET, sigint_handler, tiny_qwen2
from tests.pngcheck import curve_cells

VOCAB = 50_257  # GPT-2 tokenizer
TIMING = ("time/", "tokens_per_s", "train_tokens_per_s", "memory/")

REWARDS_MODULE = '''
def digits(prompts, completions, **fields):
    """Share of characters that are digits: varies between samples, so advantages are non-zero. (An episode's
    completion is its messages: the text of all of them.)"""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in texts]

CALLS = [0]

def raising(prompts, completions, **fields):
    """Raises on the batch call and on the first one-sample call (sample 0) that follows it."""
    CALLS[0] += 1
    if CALLS[0] <= 2:
        raise KeyError("boom")
    return [0.0] * len(completions)

def wrong_length(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)

def half_constant(prompts, completions, **fields):
    """0 for every sample of a '+' prompt (a zero-variance group), the digits reward otherwise."""
    d = digits(prompts, completions)
    return [0.0 if "+" in e else x for x, e in zip(d, fields["expression"])]

def nan(prompts, completions, **fields):
    return [float("nan")] * len(completions)
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    return "my_rewards"


@pytest.fixture
def tok(gpt2_tokenizer):
    tok = copy.deepcopy(gpt2_tokenizer)  # the session's tokenizer stays as loaded (no pad token) for other tests
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _cfg(run_dir, *overrides):
    base = [
        f"train.output_dir={run_dir}",
        "train.max_steps=4",
        "train.prompts_per_step=2",
        "train.micro_batch_size=3",  # 8 rows -> micro-batches of 3, 3, 2
        "rollout.num_generations=4",
        "rollout.max_completion_length=6",
        "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[numeric_answer, my_rewards:digits]",
        "optim.learning_rate=0.05",
        *TINY_LORA_QUIET,
        "checkpoint.save_steps=2",
        "checkpoint.save_total_limit=null",
    ]
    return load_train_config(None, base + list(overrides))


def _train(cfg, tok, **kw):
    return train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, **kw)


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def _lora(path):
    from safetensors.torch import load_file

    return load_file(str(ckpt.resolve_checkpoint(path) / "model" / "adapter_model.safetensors"))


def test_end_to_end_outputs(tmp_path, tok, rewards_module):
    cfg = _cfg(tmp_path / "run", "train.max_steps=2", "logging.plot=true", "train.num_iterations=2", "objective.beta=0.1",
               "logging.tensorboard=true", "model.gradient_checkpointing=true")
    result = _train(cfg, tok)
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and result.step == 2 and result.interrupted is None
    for r in records:
        # the logged values, not just their keys: rewards add up, group advantages are centred, the entropy of
        # a random tiny model is close to (and at most) ln V, lengths fit the limit, fractions are fractions
        assert r["reward/mean"] == pytest.approx(r["reward/numeric_answer/mean"] + r["reward/digits/mean"])
        assert r["accuracy"] == r["reward/numeric_answer/mean"]  # numeric_answer is 0/1: its mean is the accuracy
        assert abs(r["advantage"]) < 1e-6 and r["advantage/min"] < 0 < r["advantage/max"]
        assert math.log(VOCAB) - 0.1 < r["entropy"] <= math.log(VOCAB) + 1e-4
        assert 1 <= r["completion/length_mean"] <= r["completion/length_max"] <= 6
        assert 0 <= r["completion/truncated"] <= 1 and 0 <= r["clip/fraction"] <= 1
        assert r["learning_rate"] == 0.05 and r["grad_norm"] > 0 and abs(r["ratio"] - 1) < 0.05
        assert r["tokens_per_s"] > 0 and r["memory/peak_gb"] >= 0
        assert all(r[k] > 0 for k in ("time/generate", "time/score", "time/train"))
    # KL to the reference (adapters off): the first of step 1's μ = 2 passes runs at the reference, where
    # every token's k3 is exactly 0; the second runs after one update, where it is > 0
    first = records[0]
    assert first["kl/min"] == 0.0 and 0 < first["kl"] < first["kl/max"]
    # step 2 starts from the updated policy: no token is at the reference any more (a "reference" that
    # follows the policy, e.g. adapters left on, would give exactly 0 again on the first pass)
    assert records[1]["kl/min"] > 0 and records[1]["kl"] > first["kl"]
    # the curves PNG read back: 10 panels (every plotted metric is logged) in 5 rows of 2, each with a curve
    assert curve_cells(run / "curves.png") == [[True, True]] * 5
    assert load_train_config(run / "config.yaml") == cfg
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert ckpt.read_latest(run / "checkpoints").name == "step-000002"
    lora_b = [v for k, v in _lora(run).items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # LoRA B starts at zero: training moved it


def test_resume_after_sigterm_reproduces_uninterrupted_run(tmp_path, tok, rewards_module, capfd):
    full = _train(_cfg(tmp_path / "full"), tok)
    assert full.step == 4

    def hook(event, step):  # a real SIGTERM to this process after the rollout of step 3
        if event == "after_rollout" and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    cut = _train(_cfg(tmp_path / "cut"), tok, hook=hook)
    assert cut.interrupted == signal.SIGTERM and cut.exit_code == 143
    assert (f"SIGTERM: stopping. Step 3 has not begun its update, so it is dropped (a resumed run redoes it) and a "
            f"checkpoint of step 2 is saved. Continue later with: logitless train --resume {tmp_path / 'cut'}. "
            "SIGTERM again stops at once, without saving.") in capfd.readouterr().err
    assert cut.step == 2 and ckpt.read_latest(tmp_path / "cut" / "checkpoints").name == "step-000002"
    resumed = _train(_cfg(tmp_path / "cut"), tok, resume=tmp_path / "cut")
    assert resumed.step == 4
    assert _untimed(cut.records + resumed.records) == _untimed(full.records)
    a, b = _lora(tmp_path / "full"), _lora(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_sigint_during_update_finishes_step_then_checkpoints(tmp_path, tok, rewards_module, capfd):
    def hook(event, step):
        if event == "after_update" and step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with sigint_handler(signal.default_int_handler):  # as in a terminal, however pytest was started
        result = _train(_cfg(tmp_path / "run", "checkpoint.save_steps=0"), tok, hook=hook)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert result.interrupted == signal.SIGINT and result.exit_code == 130 and result.step == 1
    assert ckpt.read_latest(tmp_path / "run" / "checkpoints").name == "step-000001"
    err = capfd.readouterr().err  # the signal's line (written to fd 2 by the handler), then the run's last line
    assert f"Ctrl-C: stopping after step 1: its update finishes, then a checkpoint of step 1 is saved. Continue " \
           f"later with: logitless train --resume {tmp_path / 'run'}. Ctrl-C again stops at once" in err
    assert f"stopped by signal 2 (Ctrl-C) after step 1; the run keeps its checkpoint step-000001; continue it " \
           f"with: logitless train --resume {tmp_path / 'run'}" in err


@pytest.mark.parametrize("cudnn", [False, True])
def test_run_turns_cudnn_attention_off_and_restores_it(tmp_path, tok, rewards_module, cudnn):
    """cuDNN's sdpa builds a graph per new shape: off for the whole step (rollout and update) unless asked for."""
    seen = []
    torch.backends.cuda.enable_cudnn_sdp(True)
    _train(_cfg(tmp_path / "run", "train.max_steps=1", "checkpoint.save_steps=0", f"model.cudnn_attention={cudnn}"),
           tok, hook=lambda event, step: seen.append((event, torch.backends.cuda.cudnn_sdp_enabled())))
    assert [e for e, _ in seen if e in ("step_start", "after_rollout", "after_update")] == [
        "step_start", "after_rollout", "after_update"]  # (the rollout's and micro-batches' events between them)
    assert all(on is cudnn for _, on in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's setting is back


@pytest.mark.parametrize("frozen_before", [False, True])
def test_a_run_keeps_its_long_lived_objects_out_of_the_collector_and_hands_them_back(tmp_path, tok, rewards_module,
                                                                                   frozen_before):
    """The model, data and engine are frozen (gc.freeze) before step 1 and the first step's objects after it, so
    a full collection in step 2 scans only what the steps allocated (not the run's hundreds of thousands of
    objects); everything is unfrozen when the run ends. A process that froze objects itself is left alone."""
    import gc

    seen = {}

    def hook(event, step):
        if event == "step_start":
            seen[step] = (gc.get_freeze_count(), len(gc.get_objects()))  # (get_objects: the unfrozen ones)

    if frozen_before:
        gc.freeze()
    try:
        before = gc.get_freeze_count()
        _train(_cfg(tmp_path / "run", "train.max_steps=2", "checkpoint.save_steps=0"), tok, hook=hook)
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    if frozen_before:
        assert before >= seen[1][0] >= seen[2][0] >= after > 0  # never frozen more (frozen objects still die), kept
        return
    assert before == 0 and after == 0  # handed back
    (frozen1, scanned1), (frozen2, scanned2) = seen[1], seen[2]
    assert frozen1 > 10 * scanned1 and frozen2 > frozen1 and frozen2 > 10 * scanned2


@pytest.mark.parametrize(
    "fn, match",
    [
        ("raising", r"reward function 'raising' raised KeyError: 'boom' on sample 0 \(completion "),
        ("wrong_length", r"'wrong_length' returned 7 values for 8 completions"),
        ("nan", r"'nan' returned NaN for sample 0"),
    ],
)
def test_bad_reward_function_stops_with_its_name(tmp_path, tok, rewards_module, fn, match):
    cfg = _cfg(tmp_path / "run", "train.max_steps=1", f"reward.reward_funcs=[numeric_answer, my_rewards:{fn}]")
    with pytest.raises(RewardFunctionError, match=match):
        _train(cfg, tok)


def test_raising_reward_scored_with_penalty_when_asked(tmp_path, tok, rewards_module):
    cfg = _cfg(
        tmp_path / "run", "train.max_steps=1", "reward.reward_funcs=[numeric_answer, my_rewards:raising]",
        "reward.on_error=penalty", "reward.error_penalty=-1.0",
    )
    result = _train(cfg, tok)
    r = result.records[0]
    assert r["reward/raising/errors"] == 1  # only sample 0 raises when scored alone
    assert r["reward/raising/mean"] == pytest.approx(-1.0 / 8)


def test_prompt_longer_than_context_window(tmp_path, tok, rewards_module):
    long = "What is " + "1 + " * 300 + "1?"
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n"
                                      + json.dumps({"prompt": long, "answer": "301"}) + "\n")
    cfg = _cfg(tmp_path / "run", "data.task=jsonl", f"data.options={{path: '{tmp_path / 'p.jsonl'}', chat: false}}",
               "rollout.max_prompt_length=null")
    with pytest.raises(ValueError, match=r"data.task='jsonl': row 1 has \d+ prompt tokens, over the limit of 506"):
        _train(cfg, tok)  # tiny model: 512 positions - 6 completion tokens


@pytest.mark.parametrize(
    "content, match",
    [("", "has no rows"), (json.dumps({"question": "hi", "answer": "1"}) + "\n", "row 0 has no field 'prompt'")],
)
def test_empty_dataset_or_missing_field(tmp_path, tok, content, match):
    (tmp_path / "p.jsonl").write_text(content)
    cfg = _cfg(tmp_path / "run", "data.task=jsonl", f"data.options={{path: '{tmp_path / 'p.jsonl'}'}}")
    with pytest.raises(ValueError, match=match):
        train(cfg, model=None, tokenizer=tok)  # data errors come before the model is loaded


def test_all_completions_empty(tmp_path, tok, rewards_module):
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    eos = tok.eos_token_id

    def force_eos(module, args, out):  # the sampler always picks EOS first
        out = out.clone()
        out[..., eos] += 1e4
        return out

    model.lm_head.register_forward_hook(force_eos)
    with pytest.warns(UserWarning, match="every completion is empty"):
        with pytest.raises(ValueError, match="every completion of the last 3 steps is empty"):
            train(_cfg(tmp_path / "run", "train.max_steps=5"), model=model, tokenizer=tok)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["completion/empty"] for r in records] == [1.0, 1.0]  # the third step stops the run


def test_objective_options_reach_the_loss(tmp_path, tok, rewards_module):
    cfg = _cfg(
        tmp_path / "run", "train.max_steps=2", "train.num_iterations=2", "objective.top_entropy_quantile=0.5",
        "objective.use_adaptive_entropy=true", "objective.entropy_target=100.0", "objective.entropy_coef_delta=0.01",
        "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0",
    )
    records = _train(cfg, tok).records
    # adaptive entropy bonus: entropy (~ln V) is below the target of 100, so the coefficient grows by
    # delta after every optimizer step (2 per step with num_iterations=2)
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.02, 0.04])
    # one top-entropy threshold over the step: about half of the tokens are masked
    assert all(0.3 < r["masked/entropy"] < 0.7 for r in records)
    # sampler IS correction: the sampler and the trainer run the same weights, so every token's ratio is 1 up
    # to float32 rounding (a sampler logprob at another temperature or position would be far off)
    for r in records:
        assert 1 - 1e-5 < r["is/ratio/min"] <= r["is/ratio"] <= r["is/ratio/max"] < 1 + 1e-5
        assert 0 <= r["is/logp_diff"] < 1e-5


def test_skipping_zero_advantage_rows_does_not_change_training(tmp_path, tok, rewards_module, one_thread):
    over = ["train.max_steps=3", "reward.reward_funcs=[numeric_answer, my_rewards:half_constant]",
            "reward.reward_weights=[1.0, 1.0]", "train.num_iterations=2"]
    skip = _train(_cfg(tmp_path / "skip", *over), tok)
    full = _train(_cfg(tmp_path / "full", *over, "train.skip_zero_advantage=false"), tok)
    trained = [r["trained_rows"] for r in skip.records]
    assert [r["trained_rows"] for r in full.records] == [8.0] * 3 and 0 < sum(trained) < 24, trained
    assert [r["loss"] for r in skip.records] == pytest.approx([r["loss"] for r in full.records], rel=1e-5, abs=1e-7)
    a, b = _lora(tmp_path / "skip"), _lora(tmp_path / "full")
    for k in a:  # the same updates up to fp32 summation order (other micro-batches), over 6 Adam steps at lr 0.05:
        # within 2e-5 of each tensor's own scale (2.2e-6 absolute was seen on a 2-core machine; a wrong skip
        # moves the weights by the learning rate, ~1e-2)
        assert (a[k] - b[k]).abs().max() <= 2e-5 * a[k].abs().max() + 1e-7, k


def test_max_minutes_stops_after_the_current_step_with_a_checkpoint(tmp_path, tok, rewards_module):
    result = _train(_cfg(tmp_path / "run", "train.max_minutes=1e-6", "checkpoint.save_steps=0"), tok)
    assert result.step == 1 and result.interrupted is None and result.exit_code == 0
    assert ckpt.read_latest(tmp_path / "run" / "checkpoints").name == "step-000001"


def test_full_fine_tuning_with_a_frozen_reference_copy(tmp_path, tok, rewards_module):
    cfg = _cfg(tmp_path / "run", "train.max_steps=1", "model.lora=false", "objective.beta=0.1",
               "optim.learning_rate=1e-3", "objective.kl_estimator=k1")
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(cfg, model=model, tokenizer=tok)
    # one on-policy step (μ = 1): the policy is still the frozen copy, so k1 = logp - ref_logp is exactly 0 on
    # every token (k1, not k3: k3 = exp(d) - d - 1 rounds to 0 in fp32 for |d| below ~1e-4 and would hide a
    # slightly wrong reference)
    assert result.records[0]["kl/min"] == 0.0 and result.records[0]["kl/max"] == 0.0
    saved = ckpt.resolve_checkpoint(tmp_path / "run") / "model"
    assert (saved / "model.safetensors").is_file() and not (saved / "adapter_model.safetensors").exists()
    fresh = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)  # same init as `model` before training
    ckpt.load_model_weights(fresh, saved)
    after = fresh.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # trained weights were loaded
    for k, v in model.state_dict().items():
        assert torch.equal(v, after[k]), k
