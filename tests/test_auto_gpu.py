"""GPU: a run that leaves every speed and memory setting "auto" takes the fast path (static engine, packed
micro-batches), plans within train.memory_budget_gib, logs predicted beside measured peaks, and a step that runs
out of memory is retried. Run with `python -m pytest -m gpu tests/test_auto_gpu.py`."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import transformers as tf

from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from tests.test_rollout_families import byte_tokenizer

pytestmark = pytest.mark.gpu

TOK = byte_tokenizer()
# Qwen2.5-1.5B layer widths, 4 layers, the byte tokenizer's vocabulary
CFG = dict(vocab_size=len(TOK), hidden_size=1536, intermediate_size=8960, num_hidden_layers=4, num_attention_heads=12,
           num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=TOK.pad_token_id, bos_token_id=None,
           eos_token_id=TOK.eos_token_id)
BUDGET = 6.0


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "gpu_rewards.py").write_text(textwrap.dedent('''
        def distinct(prompts, completions, **fields):
            return [len(set(c)) / 100 for c in completions]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))


def _model():
    from logitless.models.varlen import NAME, register

    register()  # varlen attention: what a run loads for packed micro-batches
    torch.manual_seed(0)
    with torch.device("cuda"):
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**CFG, attn_implementation=NAME)).to(torch.bfloat16)


def _cfg(run_dir, *over):
    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=3", "train.prompts_per_step=4", "rollout.num_generations=4",
        "rollout.max_completion_length=256", "rollout.max_prompt_length=128", "data.options={n: 40, chat: false}",
        "reward.reward_funcs=[gpu_rewards:distinct]", "train.skip_zero_advantage=false", "checkpoint.save_steps=0",
        "checkpoint.save_at_end=false", "logging.tensorboard=false", "logging.progress=false", "logging.plot=false",
        "logging.log_completions=false", f"train.memory_budget_gib={BUDGET}", *over])


def test_auto_run_takes_the_fast_path_within_its_budget(tmp_path, rewards):
    result = train(_cfg(tmp_path / "run"), model=_model(), tokenizer=TOK)
    choices = {c["key"]: c["value"] for c in json.loads((tmp_path / "run" / "resolved.json").read_text())["choices"]}
    assert choices["rollout.backend"] == "static" and choices["train.packed"] is True
    assert choices["model.compile_layers"] is False  # 3 steps do not repay a compile
    assert isinstance(choices["train.micro_batch_tokens"], int) and choices["rollout.max_kv_gib"] > 0
    for r in result.records:
        for phase in ("generate", "train"):
            assert 0 < r[f"memory/predicted_gb/{phase}"] <= BUDGET
            assert r[f"memory/peak_gb/{phase}"] <= BUDGET
        assert r["memory/oom_retries"] == 0


def test_out_of_memory_step_is_retried_on_cuda(tmp_path, rewards):
    calls = []

    def hook(event, step):
        if event == "micro_batch" and step == 2:
            calls.append(step)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (a test's fault)")

    over = ["model.gradient_checkpointing=false", "model.activation_offload=false", "train.micro_batch_tokens=null",
            "train.micro_batch_size=1"]
    with pytest.warns(UserWarning, match="step 2 ran out of device memory in its train phase"):
        result = train(_cfg(tmp_path / "run", *over), model=_model(), tokenizer=TOK, hook=hook)
    assert [r["memory/oom_retries"] for r in result.records] == [0.0, 1.0, 0.0]
    assert result.step == 3 and all(r["grad_norm"] > 0 for r in result.records)
