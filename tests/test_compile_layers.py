"""model.compile_layers: every decoder layer compiled in place (dynamic shapes) gives the uncompiled model's
gradients, under gradient checkpointing and LoRA, padded and packed, across micro-batch shapes without a
recompile; copies of such a model (rollout copies, replicas, the reference policy) never run the original's
compiled layers (torch's deepcopy drops `nn.Module.compile`'s call; the test guards it)."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.lm_head import decoder_layers
from logitless.models.varlen import NAME as VARLEN
from logitless.models.varlen import register as register_varlen_attention
from logitless.rollout.weights import fresh_copy
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import prepare_for_training, trainable_parameters
from tests.test_packing import batch, tiny


def _grads(model, inputs, packed: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(model, *inputs, with_entropy=True, packed=packed)
    w = torch.linspace(-1, 1, logp.numel()).view_as(logp)
    ((logp * w).sum() + 0.1 * ent.sum()).backward()
    return [p.grad.clone() for p in trainable_parameters(model)]


@pytest.mark.parametrize("family,packed,attention", [("qwen2", True, "sdpa"), ("llama", False, "sdpa"),
                                                     ("llama", True, VARLEN)])
def test_compiled_layers_give_the_same_gradients(family, packed, attention, one_thread):
    """With logitless_varlen the packed rows' boundaries reach the layers as arguments: no host sync inside a
    compiled layer, so no graph break."""
    register_varlen_attention()
    cfg = dict(lora_r=4, lora_alpha=8, gradient_checkpointing=True, lora_target_modules="all-linear")
    plain, compiled = tiny(family), tiny(family)
    for m in (plain, compiled):
        m.set_attn_implementation(attention)
    plain = prepare_for_training(plain, ModelConfig(**cfg)).train()
    compiled = prepare_for_training(compiled, ModelConfig(**cfg, compile_layers=True)).train()
    with torch.no_grad():  # the same adapters (peft draws lora_A at random; lora_B non-zero so every grad moves)
        for p, q in zip(trainable_parameters(plain), trainable_parameters(compiled)):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
            q.copy_(p)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seed, rows in ((7, 5), (3, 4)):  # a second micro-batch shape: dynamic shapes, no new graph
        inputs = batch(B=rows, seed=seed)
        a, b = _grads(plain, inputs, packed), _grads(compiled, inputs, packed)
        assert any(g.abs().max() > 0 for g in a)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # the trainer's packed path (varlen) compiles once for every layer and both shapes; sdpa's packed mask once more
    assert graphs == 1 if attention == VARLEN else 1 <= graphs <= 2
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


def test_copies_of_a_compiled_model_run_their_own_layers(one_thread):
    model = tiny("qwen2")
    for layer in decoder_layers(model):
        layer.compile(backend="eager")
    copy = fresh_copy(model)
    assert all(m._compiled_call_impl is None for m in copy.modules())
    expected = fresh_copy(model)
    with torch.no_grad():
        for p in model.parameters():  # the original moves on (a training step); its copies must not follow
            p.add_(0.5)
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, expected(ids).logits)
        assert not torch.allclose(model(ids).logits, copy(ids).logits)
    torch._dynamo.reset()


def test_static_engine_decodes_a_model_with_compiled_layers_to_the_same_tokens(one_thread):
    """Full fine-tuning on one process decodes with the training model itself, compiled layers and all."""
    from logitless.rollout import SamplingOptions, make_engine
    from tests.test_rollout_families import TOK, make_model

    model = make_model("qwen2")
    plain = fresh_copy(model)
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)
    opts = SamplingOptions(num_generations=2, max_new_tokens=10, seed=0, ignore_eos=True)
    a, b = (make_engine("static", m, TOK, check_every=4, cache_multiple=8).generate(["2+2 is", "The quick brown fox"], opts)
            for m in (plain, model))
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.sampler_logp, a.sampler_logp, atol=1e-5, rtol=0)
    torch._dynamo.reset()
