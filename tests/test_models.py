"""logitless.models: hidden states without logits, lm_head, gather/scatter, completion logprobs.

Ground truth is always the model's own dense forward: `model(ids, mask, position_ids).logits` upcast to
float64, log-softmaxed and gathered at the completion positions.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from logitless.models import (
    UnsupportedModelError,
    completion_logprobs,
    final_hidden_states,
    gather_positions,
    lm_head_of,
    position_ids_from_mask,
    scatter_positions,
)
from tests.conftest import tiny_qwen2

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "What is 7 * 6?",
    "Solve for x: 2x + 3 = 11.",
    "Hi",
]
# fp32 entropy over a 151k vocabulary (logZ - E_p[logit], both ~10) has a relative error of ~1e-5
ENT_TOL = dict(rtol=5e-5, atol=2e-5)
COMPLETIONS = [
    "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 altogether. The answer is 72.",
    "42",
    "2x = 8, so x = 4.",
    "Hello! How can I help you today?",
]


def _pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


def make_batch(tok, prompt_side: str = "left", eos_id: int | None = None):
    eos = tok.eos_token_id if eos_id is None else eos_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    p_rows = [tok(p).input_ids for p in PROMPTS]
    c_rows = [tok(c).input_ids + [eos] for c in COMPLETIONS]
    prompt_ids, prompt_mask = _pad(p_rows, pad, prompt_side)
    completion_ids, completion_mask = _pad(c_rows, pad, "right")
    return prompt_ids, prompt_mask, completion_ids, completion_mask, p_rows, c_rows


def dense_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Left-padded-prompt reference: full logits, log_softmax in float64, gather at P-1 .. P+T-2."""
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    lp = torch.log_softmax(logits[:, P - 1 : P + T - 1].double() / temperature, -1)  # [B, T, V]
    m = completion_mask.double()
    logp = lp.gather(-1, completion_ids[..., None])[..., 0] * m
    entropy = -(lp.exp() * lp).sum(-1) * m
    return logp, entropy


def peaked(model):
    """Scale the final norm so logits span ~±10 instead of ~±1.4 (random init is nearly uniform)."""
    with torch.no_grad():
        model.get_decoder().norm.weight.mul_(8.0)
    return model


@contextlib.contextmanager
def lm_head_never_called(model):
    """Fail if anything runs the lm_head module (i.e. computes [*, V] logits) inside the block."""

    def boom(module, args):
        raise AssertionError("lm_head was called: logits were computed")

    handle = model.get_output_embeddings().register_forward_pre_hook(boom)
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def qwen_tied():
    return peaked(tiny_qwen2(tie=True, seed=0))


@pytest.fixture(scope="module")
def qwen_untied():
    return peaked(tiny_qwen2(tie=False, seed=1))


# ---------------------------------------------------------------------------------------------- gather/scatter


def test_gather_scatter_round_trip_and_grad():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    g = gather_positions(x, mask)
    assert g.shape == (8, 2, 4)
    assert torch.equal(g[0], x[0, 1]) and torch.equal(g[2], x[0, 4]) and torch.equal(g[3], x[2, 0])
    back = scatter_positions(g, mask, fill=-7.0)
    assert back.shape == x.shape
    assert torch.equal(back[mask.bool()], x[mask.bool()])
    assert torch.all(back[~mask.bool()] == -7.0)
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].double().expand_as(x))
    # bool and int masks agree, and 1-D values scatter to [B, L]
    v = torch.arange(8.0)
    assert torch.equal(scatter_positions(v, mask.bool()), scatter_positions(v, mask))
    assert scatter_positions(v, mask)[2, 4] == 7.0


def test_gather_scatter_bad_input():
    x = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="mask"):
        gather_positions(x, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="mask"):
        gather_positions(x, torch.ones(8, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        gather_positions(x, torch.ones(2, 4))
    with pytest.raises(ValueError, match="3 rows but mask has 8"):
        scatter_positions(torch.zeros(3), torch.ones(2, 4, dtype=torch.bool))


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 1, 1]])
    expect = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 0, 1, 2]])
    assert torch.equal(position_ids_from_mask(mask), expect)


# ------------------------------------------------------------------------------------- completion logprobs (Qwen2)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_completion_logprobs_matches_dense_qwen2(which, qwen_tokenizer, qwen_tied, qwen_untied):
    model = qwen_tied if which == "tied" else qwen_untied
    head = lm_head_of(model)
    assert (head.weight is model.get_input_embeddings().weight) == (which == "tied")
    batch = make_batch(qwen_tokenizer)[:4]
    cmask = batch[3].bool()
    assert cmask.sum() < cmask.numel() and (batch[1] == 0).any()  # really padded on both sides
    results = {}
    with torch.no_grad():
        for temperature, with_entropy in ((1.0, False), (0.7, True)):
            ref_logp, ref_ent = dense_completion_logprobs(model, *batch, temperature=temperature)
            with lm_head_never_called(model):
                logp, ent = completion_logprobs(model, *batch, temperature=temperature, with_entropy=with_entropy)
            assert logp.dtype == torch.float32 and logp.shape == batch[2].shape
            torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-5)
            assert torch.all(logp[~cmask] == 0)
            if with_entropy:
                assert ent.dtype == torch.float32
                torch.testing.assert_close(ent.double(), ref_ent, **ENT_TOL)
                assert torch.all(ent[~cmask] == 0)
                assert ref_ent[cmask].min() < math.log(model.config.vocab_size) - 1.0  # not near-uniform
            else:
                assert ent is None
            results[temperature] = logp
    # temperature really changes the result (guards against an ignored argument)
    assert (results[0.7] - results[1.0]).abs().max() > 0.1


def test_right_padded_prompts_match_unpadded_rows(qwen_tokenizer, qwen_tied):
    """Right-padded prompts (a gap of padding inside the row) give each row's unpadded result."""
    left = make_batch(qwen_tokenizer, "left")
    right = make_batch(qwen_tokenizer, "right")
    p_rows, c_rows = left[4], left[5]
    with torch.no_grad():
        lp_left, ent_left = completion_logprobs(qwen_tied, *left[:4], temperature=0.8, with_entropy=True)
        lp_right, ent_right = completion_logprobs(qwen_tied, *right[:4], temperature=0.8, with_entropy=True)
        for i, (p, c) in enumerate(zip(p_rows, c_rows)):
            ids = torch.tensor([p + c])
            logits = qwen_tied(input_ids=ids).logits[0, len(p) - 1 : len(p) + len(c) - 1].double() / 0.8
            lp = torch.log_softmax(logits, -1)
            ref = lp.gather(-1, torch.tensor(c)[:, None])[:, 0]
            ref_ent = -(lp.exp() * lp).sum(-1)
            for got, got_ent in ((lp_left, ent_left), (lp_right, ent_right)):
                torch.testing.assert_close(got[i, : len(c)].double(), ref, rtol=0, atol=2e-5)
                torch.testing.assert_close(got_ent[i, : len(c)].double(), ref_ent, **ENT_TOL)


def test_final_hidden_states_is_lm_head_input_and_supports_packing(qwen_tokenizer, qwen_untied):
    prompt_ids, prompt_mask, *_ = make_batch(qwen_tokenizer)
    with torch.no_grad():
        h = final_hidden_states(qwen_untied, prompt_ids, prompt_mask)
        pos = position_ids_from_mask(prompt_mask)
        ref = qwen_untied(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos).logits
        m = prompt_mask.bool()
        torch.testing.assert_close(qwen_untied.lm_head(h)[m], ref[m], rtol=0, atol=1e-5)
        # a padding-free packed batch: [1, L] with position ids restarting per sequence, no attention mask
        a, b = qwen_tokenizer(PROMPTS[0]).input_ids, qwen_tokenizer(PROMPTS[2]).input_ids
        packed = torch.tensor([a + b])
        packed_pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
        hp = final_hidden_states(qwen_untied, packed, None, packed_pos)
        ha = final_hidden_states(qwen_untied, torch.tensor([a]), None)
        hb = final_hidden_states(qwen_untied, torch.tensor([b]), None)
        torch.testing.assert_close(hp[0], torch.cat([ha[0], hb[0]]), rtol=0, atol=1e-4)


def test_completion_logprobs_bad_input(qwen_tokenizer, qwen_tied):
    p, pm, c, cm = make_batch(qwen_tokenizer)[:4]
    with pytest.raises(ValueError, match="completion_mask"):
        completion_logprobs(qwen_tied, p, pm, c, cm[:, :-1])
    with pytest.raises(ValueError, match="prompt_mask"):
        completion_logprobs(qwen_tied, p, pm[:3], c, cm)
    with pytest.raises(ValueError, match="rows"):
        completion_logprobs(qwen_tied, p[:3], pm[:3], c, cm)
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(qwen_tied, p, pm, c, cm, temperature=0.0)
    holes = cm.clone()
    holes[0, 2] = 0
    with pytest.raises(ValueError, match="right-padded"):
        completion_logprobs(qwen_tied, p, pm, c, holes)
    empty = pm.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="row 1"):
        completion_logprobs(qwen_tied, p, empty, c, cm)
    with pytest.raises(ValueError, match="grad_hint must be a \\[B, T\\]"):
        completion_logprobs(qwen_tied, p, pm, c, cm, grad_hint=torch.zeros(c.shape[0], c.shape[1] + 1))
    with pytest.raises(ValueError, match="attention_mask shape"):
        final_hidden_states(qwen_tied, p, pm[:, 1:])


# ---------------------------------------------------------------------------------------------- model families

V_SMALL = 300
COMMON = dict(
    vocab_size=V_SMALL,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
FAMILIES = {
    # name: (config factory, expected logit multiplier, lm_head has bias)
    "llama": (lambda: tf.LlamaConfig(**COMMON), 1.0, False),
    "mistral": (lambda: tf.MistralConfig(**COMMON, tie_word_embeddings=True), 1.0, False),
    "gemma2_no_softcap": (lambda: tf.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=None), 1.0, False),
    "phi_bias": (lambda: tf.PhiConfig(**COMMON), 1.0, True),
    "cohere_logit_scale": (lambda: tf.CohereConfig(**COMMON, logit_scale=0.25), 0.25, False),
    "granite_logits_scaling": (lambda: tf.GraniteConfig(**COMMON, logits_scaling=4.0), 0.25, False),
    "hyperclovax_logits_scaling": (
        lambda: tf.AutoConfig.for_model("hyperclovax", **COMMON, logits_scaling=3.0), 3.0, False
    ),
    "bloom_alibi": (lambda: tf.BloomConfig(vocab_size=V_SMALL, hidden_size=32, n_layer=2, n_head=4,
                                           initializer_range=0.2), 1.0, False),
    "opt_learned_positions": (lambda: tf.OPTConfig(vocab_size=V_SMALL, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                                   num_attention_heads=4, word_embed_proj_dim=32,
                                                   init_std=0.2), 1.0, False),
    "minicpm3_hidden_scaling": (
        lambda: tf.AutoConfig.for_model(
            "minicpm3", **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, dim_model_base=8,
        ),
        0.25,
        False,
    ),
}


def _random_batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, vocab, (3, 6), generator=g)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    completion_ids = torch.randint(0, vocab, (3, 5), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_families_exact(family):
    make_cfg, multiplier, has_bias = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(make_cfg()).eval()
    head = lm_head_of(model)
    assert head.logit_multiplier == pytest.approx(multiplier) and (head.bias is not None) == has_bias
    batch = _random_batch(V_SMALL)
    with torch.no_grad():
        ref_logp, ref_ent = dense_completion_logprobs(model, *batch, temperature=0.6)
        logp, ent = completion_logprobs(model, *batch, temperature=0.6, with_entropy=True)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, **ENT_TOL)


def test_gpt2_with_real_tokenizer(gpt2_tokenizer):
    """GPT-2: decoder body is `transformer`, whose last_hidden_state must include ln_f."""
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=len(gpt2_tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256,
                        initializer_range=0.2)
    model = tf.GPT2LMHeadModel(cfg).eval()
    batch = make_batch(gpt2_tokenizer)[:4]
    with torch.no_grad():
        captured = {}
        hook = model.transformer.ln_f.register_forward_hook(lambda mod, i, o: captured.update(out=o))
        h = final_hidden_states(model, batch[0], batch[1])
        hook.remove()
        assert torch.equal(h, captured["out"])
        ref_logp, ref_ent = dense_completion_logprobs(model, *batch, temperature=1.3)
        logp, ent = completion_logprobs(model, *batch, temperature=1.3, with_entropy=True)
    assert lm_head_of(model).weight is model.transformer.wte.weight
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, **ENT_TOL)


# ---------------------------------------------------------------------------------------------------- refusals


def test_gemma2_softcapping_refused():
    model = tf.AutoModelForCausalLM.from_config(tf.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=30.0))
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping=30.0"):
        lm_head_of(model)
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        completion_logprobs(model, *_random_batch(V_SMALL))


def test_unknown_logit_scaling_refused():
    cfg = tf.LlamaConfig(**COMMON)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.config.logit_scale = 2.0  # e.g. a custom model with a convention we do not know
    with pytest.raises(UnsupportedModelError, match="logit_scale=2.0"):
        lm_head_of(model)


def test_non_causal_lm_refused():
    cfg = tf.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    for model in (tf.LlamaModel(cfg), tf.LlamaForSequenceClassification(cfg), torch.nn.Linear(4, 4)):
        with pytest.raises(UnsupportedModelError):
            lm_head_of(model)
        with pytest.raises(ValueError):  # UnsupportedModelError is a ValueError
            final_hidden_states(model, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------------- PEFT


def _lora(model, target_modules, **kw):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    # init_lora_weights=False: random non-zero B, so the adapter changes the model from the first step
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False, **kw)
    return get_peft_model(model, cfg)


def test_peft_lora_adapters_active_and_disable(qwen_tokenizer, qwen_untied):
    base = copy.deepcopy(qwen_untied)
    batch = make_batch(qwen_tokenizer)[:4]
    ids, mask = torch.cat(batch[:3:2], 1), torch.cat(batch[1::2], 1)
    with torch.no_grad():
        h_base = final_hidden_states(base, ids, mask)
        lp_base = completion_logprobs(base, *batch)[0]
        peft_model = _lora(base, ["q_proj", "v_proj"])
        h_lora = final_hidden_states(peft_model, ids, mask)
        assert (h_lora - h_base)[mask.bool()].abs().max() > 1e-2
        ref_logp, ref_ent = dense_completion_logprobs(peft_model, *batch, temperature=0.9)
        logp, ent = completion_logprobs(peft_model, *batch, temperature=0.9, with_entropy=True)
        torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent.double(), ref_ent, **ENT_TOL)
        with peft_model.disable_adapter():
            torch.testing.assert_close(final_hidden_states(peft_model, ids, mask), h_base, rtol=0, atol=1e-6)
            torch.testing.assert_close(completion_logprobs(peft_model, *batch)[0], lp_base, rtol=0, atol=1e-6)


def test_peft_lora_on_lm_head_refused(qwen_untied):
    peft_model = _lora(copy.deepcopy(qwen_untied), ["q_proj", "lm_head"])
    with pytest.raises(UnsupportedModelError, match="lm_head.*target_modules"):
        lm_head_of(peft_model)


def test_peft_modules_to_save_lm_head(qwen_tokenizer, qwen_untied):
    peft_model = _lora(copy.deepcopy(qwen_untied), ["q_proj"], modules_to_save=["lm_head"])
    trained_copy = peft_model.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        trained_copy.weight.add_(0.05 * torch.randn_like(trained_copy.weight))
    assert lm_head_of(peft_model).weight is trained_copy.weight
    batch = make_batch(qwen_tokenizer)[:4]
    with torch.no_grad():
        ref_logp, _ = dense_completion_logprobs(peft_model, *batch)
        torch.testing.assert_close(completion_logprobs(peft_model, *batch)[0].double(), ref_logp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_match_dense(checkpointing, qwen_tokenizer, qwen_untied):
    peft_model = _lora(copy.deepcopy(qwen_untied), ["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model.train()
    if checkpointing:
        peft_model.gradient_checkpointing_enable()
        assert peft_model.get_base_model().model.gradient_checkpointing
    batch = [x[:2] for x in make_batch(qwen_tokenizer)[:4]]
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(batch[2].shape, generator=g, dtype=torch.float64)  # an advantage-like weighting
    lora = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)

    logp, ent = completion_logprobs(peft_model, *batch, temperature=0.7, with_entropy=True)
    (-(logp.double() * weights).sum() - 0.1 * ent.double().sum()).backward()
    ours = {n: p.grad.clone() for n, p in lora.items()}
    peft_model.zero_grad(set_to_none=True)

    ref_logp, ref_ent = dense_completion_logprobs(peft_model, *batch, temperature=0.7)
    (-(ref_logp * weights).sum() - 0.1 * ref_ent.sum()).backward()
    for n, p in lora.items():
        assert p.grad is not None and p.grad.abs().max() > 0, n
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-3, atol=1e-5, msg=n)


# ----------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_completion_logprobs_and_lora_grads(dtype):
    """On CUDA (Triton backend): values vs an fp64 head over the same hidden states, LoRA grads vs dense."""
    dev = torch.device("cuda")
    model = _lora(peaked(tiny_qwen2(tie=False, seed=2)), ["q_proj", "v_proj"]).to(dev, dtype).train()
    vocab = model.config.vocab_size
    batch = [x.to(dev) for x in _random_batch(vocab, seed=4)]
    logp, ent = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True)

    # the same hidden states through a float64 head: checks the plumbing and the op, not bf16 body numerics
    p_ids, p_mask, c_ids, c_mask = batch
    P, T = p_ids.shape[1], c_ids.shape[1]
    with torch.no_grad():
        h = final_hidden_states(model, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1))
        w = lm_head_of(model).weight
        lp = torch.log_softmax(F.linear(h[:, P - 1 : P + T - 1].double(), w.double()) / 0.7, -1)
        # the naive path in the model dtype (logits rounded to it, then an fp32 softmax), for the error scale
        lp_naive = torch.log_softmax(F.linear(h[:, P - 1 : P + T - 1], w).float() / 0.7, -1)
    m = c_mask.bool()
    ref_logp = lp.gather(-1, c_ids[..., None])[..., 0]
    ref_ent = -(lp.exp() * lp).sum(-1)
    naive_err = (lp_naive.gather(-1, c_ids[..., None])[..., 0].double() - ref_logp)[m].abs().max().item()
    torch.testing.assert_close(logp[m].double(), ref_logp[m], rtol=0, atol=max(2e-3, 1.5 * naive_err))
    torch.testing.assert_close(ent[m].double(), ref_ent[m], rtol=2e-4, atol=max(2e-3, 1.5 * naive_err))
    assert torch.all(logp[~m] == 0)

    if dtype != torch.float32:
        return
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    weights = torch.randn(c_ids.shape, device=dev, dtype=torch.float64, generator=torch.Generator(dev).manual_seed(5))
    (-(logp.double() * weights).sum() - 0.1 * ent.double().sum()).backward()
    ours = {n: p.grad.clone() for n, p in lora.items()}
    model.zero_grad(set_to_none=True)
    ref_logp, ref_ent = dense_completion_logprobs(model, *batch, temperature=0.7)
    (-(ref_logp * weights).sum() - 0.1 * ref_ent.sum()).backward()
    for n, p in lora.items():
        assert p.grad.abs().max() > 0, n
        torch.testing.assert_close(ours[n], p.grad, rtol=2e-3, atol=1e-4, msg=n)
