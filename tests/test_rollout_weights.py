"""The rollout's weight sources: a merged-LoRA inference copy samples exactly what the PEFT model's
`completion_logprobs` computes (CPU fp32), follows adapter updates through `sync()`, never writes the base
weights, and costs only the targeted layers' weights."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.weights import LiveWeights, MergedLoraWeights, lora_layers, rollout_weights

from tests.test_rollout_families import TOK, make_model

PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is"]
OPTS = SamplingOptions(num_generations=2, temperature=0.8, max_new_tokens=10, seed=3, ignore_eos=True)
TARGETS = {"llama": ["q_proj", "v_proj", "gate_proj"], "qwen2_sliding": ["k_proj", "o_proj", "down_proj"],
           "gpt2": ["c_attn", "c_fc"]}  # gpt2: Conv1D layers (fan_in_fan_out)


def lora_model(family: str) -> torch.nn.Module:
    base = make_model(family)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], lora_dropout=0.0,
                     fan_in_fan_out=family == "gpt2")
    model = get_peft_model(base, cfg)
    perturb(model, 0)
    return model


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Adapter weights large enough to move the logits (lora_B starts at zero), as an optimizer step would."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def peft_logprobs(model, b) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                   temperature=OPTS.temperature)[0].float()


@pytest.mark.parametrize("mode", ["resident", "in_place"])
@pytest.mark.parametrize("family", list(TARGETS))
def test_merged_lora_rollout_matches_the_peft_model(family, mode, one_thread):
    model = lora_model(family)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    weights = MergedLoraWeights(model, mode)
    eng = make_engine("static", model, TOK, check_every=4, weights=weights)
    for step in range(2):
        b = eng.generate(PROMPTS, OPTS)
        lp = peft_logprobs(model, b)
        torch.testing.assert_close(b.sampler_logp, lp, atol=1e-4, rtol=0)
        # the check can fail: the base model without adapters gives other logprobs
        with model.disable_adapter():
            assert (peft_logprobs(model, b) - lp).abs().max() > 1e-2
        perturb(model, step + 1)  # an optimizer step; the next generate syncs the merged copy
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n  # base weights never written (in_place: written back exactly)
    # the copy shares every parameter except the targeted layers' weights (in_place: every parameter)
    own = {id(p) for p in model.parameters()}
    extra = [p for p in weights.module.parameters() if id(p) not in own]
    if mode == "in_place":
        assert extra == [] and weights.extra_bytes == 0
        return
    assert weights.extra_bytes == sum(p.numel() * p.element_size() for p in extra) > 0
    targeted = sum(layer.get_base_layer().weight.numel() for _, layer in lora_layers(model))
    assert sum(p.numel() for p in extra) == targeted


def test_merged_copy_keeps_addresses_across_syncs():
    model = lora_model("llama")
    weights = MergedLoraWeights(model)
    ptrs = [p.data_ptr() for p in weights.module.parameters()]
    perturb(model, 5)
    weights.sync()
    assert [p.data_ptr() for p in weights.module.parameters()] == ptrs


def test_weight_source_choice_and_errors():
    plain = make_model("llama")
    assert isinstance(rollout_weights(plain, None), LiveWeights)
    with pytest.raises(ValueError, match="rollout.merge_lora=true needs a LoRA model"):
        rollout_weights(plain, True)
    model = lora_model("llama")
    assert isinstance(rollout_weights(model, None), MergedLoraWeights)
    assert isinstance(rollout_weights(model, False), LiveWeights)
    dora = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert isinstance(rollout_weights(dora, None), LiveWeights)  # automatic: falls back to the PEFT model
    with pytest.raises(ValueError, match=r"DoRA.*rollout\.merge_lora=false"):
        rollout_weights(dora, True)


def test_the_copy_does_not_inherit_a_compiled_call_of_the_training_model():
    model = lora_model("llama")
    base = model.get_base_model()
    base.get_compiled_call(None)  # as a static engine on the unmerged model would have left it
    weights = MergedLoraWeights(model)
    assert "_compiled_call" not in weights.module.__dict__
