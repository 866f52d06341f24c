"""The mixture-of-experts load-balancing loss (`model.router_aux_loss_coef`, `models/routing.py balance_loss`): each
layer's term equals transformers' own `load_balancing_loss_func` of that layer, padding left out; the term a forward
collects is the mean over its MoE layers with the gradient of that oracle; the trainer adds it only when asked."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from logitless.models import completion_logprobs
from logitless.models.routing import balance_loss, balance_of, collect_balance, routing_of, routing_scope
from logitless.trainer.checks.model import check_router_aux
from tests.test_routing_replay import FAMILIES, TOK, make_model, moe_run
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)


@pytest.mark.parametrize("masked", [False, True])
def test_one_layer_equals_transformers(masked):
    torch.manual_seed(1)
    B, L, E, k = 3, 7, 6, 2
    logits = torch.randn(B * L, E, dtype=torch.float64)
    idx = torch.softmax(logits, -1).topk(k, -1).indices
    mask = torch.rand(B, L) > 0.3 if masked else None
    ours = balance_loss(logits, idx, E, None if mask is None else mask.flatten())
    ref = load_balancing_loss_func((logits,), E, k, None if mask is None else mask.long())
    assert torch.allclose(ours.double(), ref.double(), rtol=1e-6, atol=0), (ours, ref)
    if masked:  # padding's logits do not count: changing them leaves the loss as it is
        moved = logits.clone()
        moved[~mask.flatten()] += 5.0
        assert torch.equal(balance_loss(moved, idx, E, mask.flatten()), ours)
    uniform = torch.zeros(B * L, E)
    assert torch.allclose(balance_loss(uniform, torch.arange(B * L)[:, None] % E, E), torch.tensor(1.0))


def _batch():
    enc = TOK(["The quick brown fox", "Hi"], return_tensors="pt", padding=True)
    completion = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0]])
    cmask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return enc["input_ids"], enc["attention_mask"], completion, cmask


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_forward_collects_the_mean_over_layers_of_transformers_loss_with_its_gradient(family, one_thread):
    """balance_of after one trainer forward = the mean over MoE layers of transformers' loss of each layer's router
    logits (from `output_router_logits`), padding masked, and its gradient on every router weight is that of the
    oracle."""
    model = make_model(family)
    cfg = FAMILIES[family]()
    E, k = routing_of(model).num_experts, routing_of(model).top_k
    ids, mask, completion, cmask = _batch()
    with routing_scope(model) as routing:
        collect_balance(routing)
        completion_logprobs(model, ids, mask, completion, cmask)
        ours = balance_of(routing)
    routers = routing.routers
    grads = torch.autograd.grad(ours, [r.weight for r in routers])
    assert routing.balance is None  # collected only inside the scope

    full, full_mask = torch.cat([ids, completion], 1), torch.cat([mask, cmask], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=full, attention_mask=full_mask, position_ids=pos, output_router_logits=True)
    per_layer = [load_balancing_loss_func((logits,), E, k, full_mask) for logits in out.router_logits]
    ref = torch.stack(per_layer).mean()
    ref_grads = torch.autograd.grad(ref, [r.weight for r in routers])
    assert len(out.router_logits) == len(routers) == cfg.num_hidden_layers
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-7), (ours, ref)
    for g, r in zip(grads, ref_grads):
        assert g.abs().sum() > 0 and torch.allclose(g, r, rtol=1e-4, atol=1e-7)


def test_the_trainer_adds_it_only_when_asked(tmp_path, tok, one_thread):  # noqa: F811
    """coef > 0: every step logs train/router_balance_loss (about 1 for a random router at k = 2 of 8: E * sum f P)
    and trains a different model than coef 0, whose run logs nothing of it."""
    on = moe_run(tmp_path / "on", tok, "model.router_aux_loss_coef=0.5")
    off = moe_run(tmp_path / "off", tok)
    assert all(0.5 < r["train/router_balance_loss"] < 4.0 for r in on), [r.get("train/router_balance_loss") for r in on]
    assert all("train/router_balance_loss" not in r for r in off)
    assert [r["loss"] for r in on] != [r["loss"] for r in off]


def test_a_model_without_routers_is_refused_naming_the_key():
    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                               num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=0.1 .* not a mixture of experts.*=0"):
        check_router_aux(dense, 0.1)
    assert "2 MoE layers" in check_router_aux(make_model("qwen3_moe"), 0.1)
    from logitless.trainer.config.schema import load_train_config

    with pytest.raises(Exception, match="router_aux_loss_coef must be a finite number >= 0"):
        load_train_config(None, ["model.router_aux_loss_coef=-0.1"])
