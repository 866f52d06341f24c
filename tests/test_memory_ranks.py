"""The per-GPU memory model on N ranks (trainer/memory_ranks.py): what shrinks with the rank count and what does
not, and the unit sizes it reads off a model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitless.trainer import memory_plan as mp
from logitless.trainer import memory_ranks as mr
from logitless.trainer.auto import model_memory
from logitless.trainer.config import load_train_config
from tests.conftest import tiny_qwen2

def _model(lora: bool, tie: bool, *over: str):
    """A small untied (or tied) Qwen2 of odd sizes: 3 layers, vocab 1,000, hidden 48."""
    model = tiny_qwen2(vocab_size=1000, hidden=48, layers=3, tie=tie).to(torch.bfloat16)
    cfg = load_train_config(None, [f"model.lora={str(lora).lower()}", "model.lora_r=4", *over])
    return model, model_memory(model, cfg.model, torch.bfloat16), cfg


@pytest.mark.parametrize("tie", [True, False])
def test_units_are_the_root_and_one_layer(tie):
    model, _, _ = _model(False, tie)
    u = mr.units_of(model)
    V, H = 1000, 48
    assert u.root_params == V * H * (1 if tie else 2) + H  # embeddings (and lm_head), final norm
    total = sum(p.numel() for p in model.parameters())
    assert u.root_params + 3 * u.layer_params == total


def test_one_rank_is_the_single_process_plan():
    _, m, _ = _model(True, False)
    step = mp.StepShape(prompts=6, rows=24, prompt_len=37, completion_len=50)
    facts, knobs = mp.RunFacts(backend="static"), mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True)
    assert mr.predict(m, step, facts, knobs, mr.Ranks(1)) == mp.predict(m, step, facts, knobs)


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("backend", ["static", "hf"])
def test_shards_shrink_with_the_ranks_and_the_working_set_does_not(lora, backend):
    """At N = 2, 3, 4, 8: the shards are 1/N of one process's (to the byte), the rank's KV cache is that of its
    largest share (6 prompts on 4 ranks: 2), the root unit and the whole decode weights stay; the peak falls."""
    model, m, _ = _model(lora, False)
    units = mr.units_of(model)
    step = mp.StepShape(prompts=6, rows=24, prompt_len=37, completion_len=50)
    facts = mp.RunFacts(backend=backend, logprob_pass=True, reference_copy=not lora)
    knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True)
    one = mp.predict(m, step, facts, knobs)
    peaks = []
    for n in (2, 3, 4, 8):
        ph = mr.predict(m, step, facts, knobs, mr.Ranks(n, units))
        gen, train = ph["generate"], ph["train"]
        assert gen[f"weights (1/{n})"] == one["generate"]["weights"] / n
        assert train[f"optimizer (1/{n})"] == one["train"]["optimizer"] / n
        assert train[f"gradients (1/{n})"] == one["train"]["gradients"] / n
        assert train.get("reference", 0.0) == (m.weight_bytes if not lora else 0.0)  # made before sharding: whole
        assert train["root unit (whole)"] == units.root_params * 2 == ph["logprobs"]["root unit (whole)"]
        share = -(-6 // n)
        assert gen["kv cache"] == mp.generate_bytes(m, dataclasses.replace(step, prompts=share, rows=4 * share),
                                                    facts, knobs)["kv cache"]
        whole = gen["replica (whole)"] if backend == "static" else gen["gathered weights (whole)"]
        assert whole >= m.weight_bytes
        peaks.append(mr.peak(ph))
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]  # (at this tiny size not below one
    # process's: the whole decode weights and the root unit outweigh what sharding saves)


def test_full_fine_tuning_s_root_reduction_sets_the_peak_where_the_root_dominates():
    """An untied 500k vocabulary on 2 narrow layers (on the meta device) and one-row micro-batches of 16 tokens:
    the root's fp32 gradient reduction at the end of the backward (2 + 4 bytes per root parameter) is larger than
    the activation peak (LoRA never reduces the root). At the Qwen2.5 shapes it is not (2 bytes per root parameter
    more against the layers in flight, the root's parameters and the lm_head's workspace)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=500_000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    units = mr.units_of(model)
    assert units.root_params == 2 * 500_000 * 256 + 256
    step = mp.StepShape(prompts=8, rows=16, prompt_len=8, completion_len=8)
    knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=1, by_rows=True)
    for lora in (False, True):
        cfg = load_train_config(None, [f"model.lora={str(lora).lower()}", "model.lora_r=4"])
        m = model_memory(model, cfg.model, torch.bfloat16)
        train = mr.predict(m, step, mp.RunFacts(), knobs, mr.Ranks(8, units))["train"]
        assert ("root fp32 reduce-scatter input" in train) is not lora
        if not lora:
            assert train["root fp32 reduce-scatter input"] == 4 * units.root_params
            assert train["root gradient (whole)"] == 2 * units.root_params
    assert train["replica (mapped)"] == m.weight_bytes - m.merge_copy_bytes  # merged LoRA: its frozen rest stays


def test_more_than_one_rank_needs_the_unit_sizes():
    _, m, _ = _model(True, True)
    with pytest.raises(ValueError, match="Ranks.units"):
        mr.predict(m, mp.StepShape(prompts=2, rows=4, prompt_len=4, completion_len=4), mp.RunFacts(), mp.Knobs(),
                   mr.Ranks(2))
