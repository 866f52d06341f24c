"""Fused projections (`logitless.rollout.fused`): a model whose q/k/v and gate/up projections are fused computes the
same logits and the static engine decodes it to the same tokens, across model families; compiled, the graph holds
3 fewer matrix products per layer; the merged-LoRA weight sources and the replicas fuse their own copies, or (in
place) lay the frozen base weights back to back without changing the training model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.fused import FusedGroup, SlicedLinear, fuse_projections, owners, share_storage, tensor_at
from logitless.rollout.weights import MergedLoraWeights, fresh_copy
from tests.test_rollout_families import TOK, make_model

PROMPTS = ["2+2 is", "The quick brown fox"]


def _sliced(module: nn.Module) -> int:
    return sum(isinstance(m, SlicedLinear) for m in module.modules())


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_window", "gemma2"])
def test_fused_projections_compute_the_same_model(family, one_thread):
    model = make_model(family)
    fused = fresh_copy(model)
    layers = model.config.num_hidden_layers
    assert len(fuse_projections(fused)) == 2 * layers
    assert _sliced(fused) == 5 * layers
    ids = torch.randint(0, len(TOK), (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    opts = SamplingOptions(num_generations=2, max_new_tokens=10, seed=0, ignore_eos=True)
    a, b = (make_engine("static", m, TOK, check_every=4, cache_multiple=8).generate(PROMPTS, opts)
            for m in (model, fused))
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, atol=1e-5, rtol=0)
    assert all(g.product is None for g in fused.modules() if isinstance(g, FusedGroup))  # nothing outlives a forward


def test_compiled_fused_model_runs_one_gemm_per_group(one_thread):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    counts = []

    def count(gm, example_inputs):
        counts.append(sum("mm" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return make_boxed_func(gm.forward)

    ids = torch.randint(0, len(TOK), (4, 1), generator=torch.Generator().manual_seed(0))
    for fused in (False, True):
        model = make_model("qwen2")
        if fused:
            fuse_projections(model)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=aot_autograd(fw_compiler=count), fullgraph=True)(ids)
    plain, fused_count = counts
    assert plain - fused_count == 3 * model.config.num_hidden_layers, counts


def test_member_views_write_the_group_and_out_of_order_calls_stay_exact():
    torch.manual_seed(0)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = nn.Linear(6, 4), nn.Linear(6, 2, bias=False), nn.Linear(6, 2)
    plain = copy.deepcopy(parent)
    (group,) = fuse_projections(parent)
    assert group.weight.shape == (8, 6) and group.bias.shape == (8,)
    torch.testing.assert_close(group.bias[4:6], torch.zeros(2))  # k has no bias: zeros in the group's
    with torch.no_grad():
        tensor_at(parent, "k_proj.weight").copy_(torch.ones(2, 6))  # a sync writing a member by name
        plain.k_proj.weight.copy_(torch.ones(2, 6))
    torch.testing.assert_close(group.weight[4:6], torch.ones(2, 6))
    x = torch.randn(3, 6)
    for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "k_proj", "q_proj"), ("k_proj", "k_proj", "q_proj")):
        for name in order:
            torch.testing.assert_close(getattr(parent, name)(x), getattr(plain, name)(x))
        group.product = None
    assert [t is group.weight or t is group.bias for t in owners(parent, ["q_proj.weight", "v_proj.bias"])] == [True, True]


def test_a_fused_copy_frees_the_replaced_weights_and_refreshes_shared_biases():
    import gc
    import weakref

    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(5, 7), nn.Linear(5, 3, bias=False)
    old = [weakref.ref(parent.gate_proj.weight), weakref.ref(parent.up_proj.weight)]
    bias = parent.gate_proj.bias  # e.g. a training model's bias, shared with the replaced layer
    (group,) = fuse_projections(parent)
    gc.collect()
    assert [r() for r in old] == [None, None]  # the group holds the only copy of the weights
    with torch.no_grad():
        bias.add_(2.0)
    group.refresh_bias()
    torch.testing.assert_close(group.bias, torch.cat([bias.detach(), torch.zeros(3)]))


def test_share_storage_keeps_parameters_and_values_and_fusing_then_copies_nothing():
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(5, 7, bias=False), nn.Linear(5, 3, bias=False)
    params = [parent.gate_proj.weight, parent.up_proj.weight]
    before = [p.detach().clone() for p in params]
    share_storage([parent.gate_proj, parent.up_proj])
    assert [parent.gate_proj.weight, parent.up_proj.weight] == params  # same Parameter objects
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert params[0].untyped_storage().data_ptr() == params[1].untyped_storage().data_ptr()
    (group,) = fuse_projections(parent)
    assert group.weight.untyped_storage().data_ptr() == params[0].untyped_storage().data_ptr()  # a view, no copy
    with torch.no_grad():
        params[1].add_(1.0)  # e.g. the in-place merge writing W + dW into the base weight
    torch.testing.assert_close(group.weight[7:], before[1] + 1.0)


def _peft(family: str):
    from peft import LoraConfig, get_peft_model

    model = make_model(family)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return peft


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("mode", ["resident", "in_place"])
def test_merged_lora_weights_fused_decode_the_same_tokens(family, mode, one_thread):
    peft = _peft(family)
    base_before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    plain = MergedLoraWeights(peft, mode)
    fused = MergedLoraWeights(peft, mode, fuse=True)
    layers = peft.config.num_hidden_layers
    assert len(fused.groups) == 2 * layers and _sliced(fused.module) == 5 * layers
    assert not any(isinstance(m, SlicedLinear) for m in peft.modules())  # the training model keeps its modules
    held = sum(p.numel() for p in fused.module.parameters() if p.device.type != "meta")
    assert held == sum(p.numel() for p in plain.module.parameters())  # the groups replace, never add to, weights
    opts = SamplingOptions(num_generations=2, max_new_tokens=10, seed=0, ignore_eos=True)
    outs = []
    for weights in (plain, fused):
        engine = make_engine("static", peft, TOK, weights=weights, check_every=4, cache_multiple=8)
        outs.append(engine.generate(PROMPTS, opts))
        weights.release()
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    torch.testing.assert_close(outs[0].sampler_logp, outs[1].sampler_logp, atol=1e-5, rtol=0)
    for n, p in peft.named_parameters():  # the training model: the same values after both rollouts
        assert torch.equal(p, base_before[n]), n
    if mode == "in_place":  # its frozen base weights of a group now share one storage, the fused group's
        attn = fused.module.model.layers[0].self_attn
        q = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        assert attn.q_proj.group.weight.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()


def test_replica_fuses_its_copy_and_a_sync_by_name_fills_the_groups(one_thread):
    from logitless.trainer.distributed.parallel import RolloutCopy

    model = make_model("qwen2")
    replica = RolloutCopy(model, fuse=True)
    assert len(replica.groups) == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # "a training step": every weight and bias changes
    replica.sync(model)  # on one process the sharded model is the model itself
    ids = torch.randint(0, len(TOK), (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(replica.model(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_fuse_projections_true_is_refused_where_nothing_can_fuse(one_thread):
    from logitless.trainer.placement.engines import make_rollout_engine
    from logitless.trainer.config.schema import RolloutConfig

    with pytest.raises(ValueError, match=r"rollout\.fuse_projections=True needs rollout\.backend=static"):
        RolloutConfig(backend="hf", fuse_projections=True)
    cfg = RolloutConfig(backend="static", fuse_projections=True)
    with pytest.raises(ValueError, match=r"rollout\.fuse_projections=true .*training model itself.*unset"):
        make_rollout_engine(cfg, make_model("qwen2"), TOK)  # full fine-tuning on one process: LiveWeights
    engine = make_rollout_engine(RolloutConfig(backend="static"), _peft("llama"), TOK)  # default: fused where it can
    assert engine.weights.groups
    off = make_rollout_engine(RolloutConfig(backend="static", fuse_projections=False), _peft("llama"), TOK)
    assert off.weights.groups == []
