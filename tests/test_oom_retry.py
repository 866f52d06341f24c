"""A step that runs out of memory is retried once with leaner settings from the same state (trainer/memory/oom.py), and
the run ends exactly as a run without the fault (CPU, tiny model; the fault is a hook raising
torch.OutOfMemoryError where the device would)."""

from __future__ import annotations

import json

import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.loop import train
from tests.conftest import TINY_LORA_QUIET, reward_module, tiny_qwen2
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

VOCAB = 50_257  # GPT-2 tokenizer
UNTIMED = ("time/", "tokens_per_s", "train_tokens_per_s", "memory/")


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    reward_module(tmp_path, monkeypatch, "oom_rewards", '''
        def digits(prompts, completions, **fields):
            return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in completions]
    ''')


def _cfg(run_dir, *over):
    return load_train_config(None, [
        # one row per micro-batch: the retry's leaner settings (checkpointing, activation offload) then keep the
        # micro-batches, so its results are the clean run's bit for bit (a smaller micro-batch would change the
        # order of the gradient's float sums)
        f"train.output_dir={run_dir}", "train.max_steps=3", "train.prompts_per_step=2", "train.micro_batch_size=1",
        "rollout.num_generations=4", "rollout.max_completion_length=6", "rollout.backend=static",
        "data.options={difficulty: 1, n: 40, chat: false}", "reward.reward_funcs=[numeric_answer, oom_rewards:digits]",
        "optim.learning_rate=0.05", "checkpoint.save_steps=0", "model.gradient_checkpointing=false",
        "model.activation_offload=false", *TINY_LORA_QUIET, *over])


def _run(cfg, tok, faults=(), model=None, **kw):
    """Train (the tiny model, or `model`); `faults`: (event, step, call) of the hook at which an out-of-memory error
    is raised."""
    calls: dict[tuple[str, int], int] = {}

    def hook(event, step):
        calls[event, step] = calls.get((event, step), 0) + 1
        if (event, step, calls[event, step]) in faults:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)")

    model = model if model is not None else tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    return train(cfg, model=model, tokenizer=tok, hook=hook, **kw)


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED)} for r in records]


def _adapters(run_dir):
    from safetensors.torch import load_file

    return load_file(str(ckpt.resolve_checkpoint(run_dir) / "model" / "adapter_model.safetensors"))


def test_out_of_memory_in_rollout_and_update_is_retried_with_identical_results(tmp_path, tok, rewards):
    clean = _run(_cfg(tmp_path / "clean"), tok)
    # step 2: the rollout fails as it starts; step 3: the update's first micro-batch fails
    with pytest.warns(UserWarning, match=r"step \d ran out of device memory in its (generate|train) phase") as caught:
        faulted = _run(_cfg(tmp_path / "faulted"), tok, faults={("generate", 2, 1), ("micro_batch", 3, 1)})
    messages = [str(w.message) for w in caught if "ran out of device memory" in str(w.message)]
    assert len(messages) == 2
    assert "step 2" in messages[0] and "rollout.max_kv_gib=" in messages[0]  # fewer rows per wave
    assert "step 3" in messages[1] and "model.gradient_checkpointing=True" in messages[1]
    assert "model.activation_offload=True" in messages[1] and "micro_batch_size" not in messages[1]
    assert _untimed(faulted.records) == _untimed(clean.records)
    assert [r["memory/oom_retries"] for r in faulted.records] == [0.0, 1.0, 1.0]
    assert [r["memory/oom_retries"] for r in clean.records] == [0.0, 0.0, 0.0]
    a, b = _adapters(tmp_path / "clean"), _adapters(tmp_path / "faulted")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the run folder: the config as given ("auto" kept) and what the run decided
    assert "compile_layers: auto" in (tmp_path / "faulted" / "config.yaml").read_text()
    resolved = json.loads((tmp_path / "faulted" / "resolved.json").read_text())
    choices = {c["key"]: c for c in resolved["choices"]}
    assert choices["model.compile_layers"]["value"] is False and choices["model.compile_layers"]["auto"]
    assert choices["rollout.backend"] == {"key": "rollout.backend", "value": "static", "reason": "set in the config",
                                          "auto": False}


def test_a_second_failure_or_one_after_an_optimizer_step_ends_the_run(tmp_path, tok, rewards):
    with pytest.warns(UserWarning, match="ran out of device memory"), \
            pytest.raises(torch.OutOfMemoryError, match="no retry: the step was retried once already"):
        _run(_cfg(tmp_path / "twice", "train.max_steps=1"), tok, faults={("micro_batch", 1, 1), ("micro_batch", 1, 2)})
    # num_iterations=2: the second pass over the micro-batches (8 rows, 8 of them) comes after an optimizer step
    with pytest.raises(torch.OutOfMemoryError, match="no retry: an optimizer step of it was already taken"):
        _run(_cfg(tmp_path / "stepped", "train.max_steps=1", "train.num_iterations=2",
                  "train.skip_zero_advantage=false"), tok, faults={("micro_batch", 1, 9)})


def test_a_retry_past_the_smallest_micro_batch_tiles_the_mlp(tmp_path, tok, rewards):
    """Checkpointing, activation offload and one row per micro-batch already: the retry tiles the MLPs
    (model.mlp_chunk_tokens), kept for the rest of the run; the tiny rows are under one chunk, so the results are the
    clean run's bit for bit."""
    from logitless.models.tiled_mlp import mlp_chunk_tokens
    from logitless.trainer.memory import plan as mp

    lean = ("train.max_steps=2", "model.gradient_checkpointing=true", "model.activation_offload=true")
    clean = _run(_cfg(tmp_path / "clean", *lean), tok)
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1)
    with pytest.warns(UserWarning, match=r"step 2 ran out of device memory in its train phase .* retrying it with "
                                         rf"model\.mlp_chunk_tokens={mp.MLP_CHUNK_TOKENS} \(kept"):
        faulted = _run(_cfg(tmp_path / "faulted", *lean), tok, faults={("micro_batch", 2, 1)}, model=model)
    assert mlp_chunk_tokens(model) == mp.MLP_CHUNK_TOKENS
    assert _untimed(faulted.records) == _untimed(clean.records)
    assert [r["memory/oom_retries"] for r in faulted.records] == [0.0, 1.0]
