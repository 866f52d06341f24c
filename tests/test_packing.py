"""Padding-free (packed) forwards and token-budget micro-batches.

Ground truth is the padded forward of `completion_logprobs`, itself tested against the model's dense logits in
test_models.py; gradients of a step are compared against the step split into row micro-batches.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from logitless.models import completion_logprobs
from logitless.models import varlen as varlen_module
from logitless.models.varlen import NAME as VARLEN
from logitless.models.varlen import register as register_varlen_attention
from logitless.models.varlen import row_boundaries
from logitless.objectives import ObjectiveOptions, loss_normalizer, policy_loss
from logitless.trainer.batching import make_micro_batches
from logitless.trainer.policy.modeling import check_packed_attention

V = 300
FAMILIES = ["qwen2", "llama", "gpt2"]


def tiny(family: str, seed: int = 0, hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    """A random-init causal LM of the given family (fp32, eval mode)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **common)).eval()
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **common)).eval()
    cfg = tf.GPT2Config(vocab_size=V, n_embd=hidden, n_layer=layers, n_head=4, n_positions=2048, bos_token_id=1,
                        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # deterministic in train()
    return tf.GPT2LMHeadModel(cfg).eval()


def batch(B: int = 6, P: int = 7, T: int = 9, seed: int = 0):
    """Left-padded prompts and right-padded completions of uneven lengths (one row has no completion)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, P + 1, (B,), generator=g)
    c_len = torch.randint(0, T + 1, (B,), generator=g)
    c_len[0], c_len[-1] = T, 0
    pm = (torch.arange(P)[None] >= P - p_len[:, None]).long()  # [B, P]
    cm = (torch.arange(T)[None] < c_len[:, None]).long()  # [B, T]
    pi = torch.randint(3, V, (B, P), generator=g) * pm
    ci = torch.randint(3, V, (B, T), generator=g) * cm
    return pi, pm, ci, cm


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_matches_padded(family, one_thread):
    model = tiny(family)
    pi, pm, ci, cm = batch()
    logp, ent = completion_logprobs(model, pi, pm, ci, cm, with_entropy=True, temperature=0.7)
    logp_p, ent_p = completion_logprobs(model, pi, pm, ci, cm, with_entropy=True, temperature=0.7, packed=True)
    torch.testing.assert_close(logp_p, logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_p, ent, atol=1e-5, rtol=0)
    assert logp[cm.bool()].abs().min() > 0  # real values, not zeros on both sides


def test_packed_gradients_match_padded(one_thread):
    model = tiny("qwen2")
    pi, pm, ci, cm = batch(seed=1)
    w = torch.randn(cm.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for packed in (False, True):
        model.zero_grad()
        logp, _ = completion_logprobs(model, pi, pm, ci, cm, packed=packed)
        (logp * w).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def _causal_only_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention that ignores row boundaries: plain causal attention over the whole (packed) sequence."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def test_check_packed_attention_refuses_an_attention_that_mixes_rows(one_thread):
    model = tiny("qwen2")
    check_packed_attention(model)  # sdpa keeps packed rows apart
    tf.AttentionInterface.register("logitless_test_causal_only", _causal_only_attention)
    model.set_attn_implementation("logitless_test_causal_only")
    with pytest.raises(ValueError, match=r"train\.packed=true.*model\.attn_implementation"):
        check_packed_attention(model)


def _rows_cost(mb, packed: bool) -> int:
    if packed:
        return int(mb.prompt_mask.sum() + mb.completion_mask.sum())
    return mb.prompt_ids.shape[0] * (mb.prompt_ids.shape[1] + mb.completion_ids.shape[1])


@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_micro_batches(packed):
    pi, pm, ci, cm = batch(B=16, P=12, T=20, seed=3)
    B = pi.shape[0]
    extra = (torch.zeros(B, ci.shape[1]), torch.zeros(B, dtype=torch.bool), torch.randn(B))
    longest = int((pm.sum(1) + cm.sum(1)).max())
    for budget in (longest, 2 * longest, 5 * longest):
        micro = make_micro_batches(pi, pm, ci, cm, *extra, 1, max_tokens=budget, packed=packed)
        assert sorted(torch.cat([m.rows for m in micro]).tolist()) == list(range(B))
        assert all(_rows_cost(m, packed) <= budget for m in micro)
        # greedy: the next micro-batch's first row would not have fit into the one before
        for a, b in zip(micro, micro[1:]):
            assert _rows_cost(_merge(pi, pm, ci, cm, extra, a, b), packed) > budget
    assert len(make_micro_batches(pi, pm, ci, cm, *extra, 1, max_tokens=10**6, packed=packed)) == 1
    with pytest.raises(ValueError, match=rf"train\.micro_batch_tokens={longest - 1} .*>= {longest}"):
        make_micro_batches(pi, pm, ci, cm, *extra, 1, max_tokens=longest - 1, packed=packed)


def _merge(pi, pm, ci, cm, extra, a, b):
    """Micro-batch a plus the first row of b."""
    rows = torch.cat([a.rows, b.rows[:1]])
    return make_micro_batches(pi, pm, ci, cm, *extra, len(rows), rows=rows)[0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_token_budget_step_gradient_equals_row_micro_batches(loss_type, one_thread):
    """Same step gradient for row micro-batches, padded token-budget and packed token-budget micro-batches."""
    model = tiny("llama")
    pi, pm, ci, cm = batch(B=8, seed=4)
    B = pi.shape[0]
    g = torch.Generator().manual_seed(5)
    sampler = -torch.rand(ci.shape, generator=g) * cm
    trunc, adv = cm.sum(1) == cm.shape[1], torch.randn(B, generator=g)
    opts = ObjectiveOptions(loss_type=loss_type)
    norm = loss_normalizer(opts, [cm], [trunc])
    longest = int((pm.sum(1) + cm.sum(1)).max())
    splits = {"rows": dict(size=3), "tokens": dict(size=1, max_tokens=2 * longest),
              "packed": dict(size=1, max_tokens=2 * longest, packed=True)}
    grads = {}
    for name, kw in splits.items():
        model.zero_grad()
        micro = make_micro_batches(pi, pm, ci, cm, sampler, trunc, adv, kw.pop("size"), **kw)
        for m in micro:
            logp, _ = completion_logprobs(model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                          packed=name == "packed")
            policy_loss(logp, m.completion_mask, m.advantages, opts, norm, sampler_logp=m.sampler_logp,
                        truncated=m.truncated).loss.backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        assert len(micro) > 1
    assert any(g.abs().max() > 0 for g in grads["rows"])
    for name in ("tokens", "packed"):
        for a, b in zip(grads["rows"], grads[name]):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def test_row_boundaries_follow_transformers_rule():
    cu, longest = row_boundaries(torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3]))
    assert cu.tolist() == [0, 3, 5, 6, 10] and longest == 4 and cu.dtype == torch.int32
    cu, longest = row_boundaries(torch.arange(5, 9))  # one row that does not start at 0
    assert cu.tolist() == [0, 4] and longest == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_attention_packed_matches_padded_sdpa(family, one_thread, monkeypatch):
    """attn_implementation=logitless_varlen: packed rows through the varlen path, padded rows through sdpa."""
    register_varlen_attention()
    model = tiny(family)
    pi, pm, ci, cm = batch(seed=6)
    padded_sdpa = completion_logprobs(model, pi, pm, ci, cm)[0]
    model.set_attn_implementation(VARLEN)
    calls = []
    real = varlen_module._varlen_rows
    monkeypatch.setattr(varlen_module, "_varlen_rows", lambda *a: calls.append(a[3].tolist()) or real(*a))
    packed = completion_logprobs(model, pi, pm, ci, cm, packed=True)[0]
    rows = (pm.sum(1) + cm.sum(1))[cm.any(1)]  # a row without completion tokens is left out of the packing
    assert calls == [[0, *rows.cumsum(0).tolist()]] * 2  # one varlen call per layer, one entry per row
    torch.testing.assert_close(packed, padded_sdpa, atol=1e-5, rtol=0)
    padded = completion_logprobs(model, pi, pm, ci, cm)[0]  # a padded batch falls back to sdpa
    assert len(calls) == 2
    torch.testing.assert_close(padded, padded_sdpa, atol=1e-6, rtol=0)
    check_packed_attention(model)


@pytest.mark.gpu
def test_varlen_attention_gpu_matches_padded_with_gradients():
    register_varlen_attention()
    model = tiny("qwen2", hidden=128, layers=2).cuda().to(torch.bfloat16).train()
    inputs = [t.cuda() for t in batch(B=8, P=40, T=60, seed=13)]
    grads = []
    for impl, packed in (("sdpa", False), (VARLEN, True)):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logp, _ = completion_logprobs(model, *inputs, packed=packed)
        logp.sum().backward()
        grads.append((logp.detach(), [p.grad.float() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=0.05, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.05)


def test_packed_run_loads_the_varlen_attention_unless_another_is_named():
    """train.packed with transformers' default sdpa would build a dense [S, S] mask: the run picks logitless_varlen."""
    from logitless.trainer.config.schema import load_train_config
    from logitless.trainer.context import model_config

    assert model_config(load_train_config(None, ["train.packed=true"])).attn_implementation == VARLEN
    assert model_config(load_train_config(None, [])).attn_implementation is None  # padded: transformers' default
    named = load_train_config(None, ["train.packed=true", "model.attn_implementation=flash_attention_2"])
    assert model_config(named).attn_implementation == "flash_attention_2"


def test_varlen_attention_finds_the_rows_without_the_packed_kwargs(one_thread):
    """A packed forward called without `cu_seq_lens_q` (e.g. a user's own packed batch) finds the rows from
    position_ids: the same hidden states as the forward that passes them."""
    from logitless.models.lm_head import final_hidden_states
    from logitless.models.varlen import packed_kwargs

    register_varlen_attention()
    model = tiny("llama")
    model.set_attn_implementation(VARLEN)
    lengths = torch.tensor([3, 5, 1, 4])
    ids = torch.randint(3, V, (1, int(lengths.sum())), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
    with torch.no_grad():
        given = final_hidden_states(model, ids, None, pos, **packed_kwargs(lengths))
        found = final_hidden_states(model, ids, None, pos)
        one_row = final_hidden_states(model, ids, None, torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(found, given, atol=1e-6, rtol=0)
    assert not torch.allclose(one_row, given, atol=1e-3)  # the boundaries matter


@pytest.mark.parametrize("packed", [False, True])
def test_logp_mask_computes_only_its_positions(packed, one_thread, monkeypatch):
    """completion_logprobs(logp_mask=...) (multi-turn: the model's tokens, observations left out): the same values at
    those positions as without it, 0 elsewhere, and only those rows through the fused op; gradients equal a
    weighting of the full result by the mask."""
    from logitless.models import logprobs as logprobs_module

    model = tiny("llama")
    pi, pm, ci, cm = batch(seed=3)
    sub = cm * (torch.rand(cm.shape, generator=torch.Generator().manual_seed(4)) < 0.6).long()
    seen = []
    real = logprobs_module.token_logprobs
    monkeypatch.setattr(logprobs_module, "token_logprobs", lambda h, *a, **k: seen.append(h.shape[0]) or real(h, *a, **k))
    full, full_ent = completion_logprobs(model, pi, pm, ci, cm, with_entropy=True, packed=packed)
    part, part_ent = completion_logprobs(model, pi, pm, ci, cm, with_entropy=True, packed=packed, logp_mask=sub)
    assert seen == [int(cm.sum()), int(sub.sum())]
    torch.testing.assert_close(part, full * sub, atol=1e-6, rtol=0)
    torch.testing.assert_close(part_ent, full_ent * sub, atol=1e-6, rtol=0)
    w = torch.randn(cm.shape, generator=torch.Generator().manual_seed(5))
    model.zero_grad()
    completion_logprobs(model, pi, pm, ci, cm, packed=packed)[0].mul(sub * w).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    completion_logprobs(model, pi, pm, ci, cm, packed=packed, logp_mask=sub)[0].mul(w).sum().backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="logp_mask selects positions outside completion_mask"):
        completion_logprobs(model, pi, pm, ci, cm, logp_mask=torch.ones_like(cm))
