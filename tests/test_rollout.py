"""Rollout engines: reproducibility, sampler logprobs vs the training-side logprobs, EOS / stop strings /
truncation, generation context, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.types import RolloutBatch

from tests.conftest import tiny_qwen2

PROMPTS = ["Hello there, how", [{"role": "user", "content": "What is 2+2? Answer briefly please."}]]


@pytest.fixture(scope="module")
def peaked_model():
    """Tiny untied Qwen2 whose lm_head is scaled so next-token distributions are peaked (logit std ~6),
    which makes logprob comparisons sensitive and repeats/stops likely."""
    m = tiny_qwen2(tie=False, seed=1)
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


def dense_logprobs(model, b: RolloutBatch, temperature: float) -> torch.Tensor:
    """Ground truth from the full forward: log_softmax(logits / T) at position P + t - 1, positions from the mask."""
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double()
    P, T = b.prompt_ids.shape[1], b.completion_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : P + T - 1] / temperature, -1)
    return lp.gather(-1, b.completion_ids[..., None])[..., 0] * b.completion_mask


def check_layout(b: RolloutBatch, n: int, G: int, pad_id: int) -> None:
    B = n * G
    assert b.prompt_ids.shape[0] == B and b.completion_ids.shape[0] == B
    assert torch.equal(b.prompt_index, torch.arange(n).repeat_interleave(G))
    assert b.sampler_logp.dtype == torch.float32
    m = b.completion_mask.bool()
    # mask is a prefix per row; padding holds the pad id and logp 0
    assert torch.equal(m, m.long().cumprod(1).bool())
    assert (b.completion_ids[~m] == pad_id).all() and (b.sampler_logp[~m] == 0).all()
    assert (b.sampler_logp[m] <= 1e-6).all()
    # prompts are left-padded: the last prompt column is real for every row
    assert (b.prompt_mask[:, -1] == 1).all()
    assert len(b.completions) == B and b.timing.num_tokens == int(m.sum())


FAST = ["hf", "static"]


def engine(backend, model, tok):
    # check_every=4 exercises the static loop's host-side stop/finished checks within short completions
    return make_engine(backend, model, tok, **({"check_every": 4} if backend == "static" else {}))


@pytest.mark.parametrize("backend", FAST)
def test_seeded_reproducible_and_logprobs_match_dense(peaked_model, tok, backend):
    eng = engine(backend, peaked_model, tok)
    opts = SamplingOptions(num_generations=3, temperature=0.7, top_k=40, top_p=0.95, min_p=0.01,
                           repetition_penalty=1.2, max_new_tokens=7, seed=123)
    a = eng.generate(PROMPTS, opts)
    b = eng.generate(PROMPTS, opts)
    c = eng.generate(PROMPTS, SamplingOptions(**{**opts.__dict__, "seed": 124}))
    check_layout(a, 2, 3, tok.pad_token_id)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    # the same tokens exactly; their logprobs to fp32 noise: CPU kernels may sum in another order from one call to
    # the next (a 1e-4 difference of one logprob was seen once on a loaded 2-core machine, peaked logits at T = 0.7)
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, atol=5e-4, rtol=0)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the recorded distribution is log_softmax(raw / T): before repetition penalty and filters
    ref = dense_logprobs(peaked_model, a, 0.7)
    torch.testing.assert_close(a.sampler_logp.double(), ref, atol=5e-5, rtol=0)
    # and it is not the filtered one: some sampled tokens had a logp well below 0 under the full softmax
    assert a.sampler_logp[a.completion_mask.bool()].min() < -0.5


@pytest.mark.parametrize("backend", FAST)
def test_logprobs_match_fused_completion_logprobs(peaked_model, tok, backend):
    eng = engine(backend, peaked_model, tok)
    for T in (1.0, 0.6):
        b = eng.generate(PROMPTS, SamplingOptions(num_generations=2, temperature=T, max_new_tokens=6, seed=7))
        with torch.no_grad():
            lp, _ = completion_logprobs(
                peaked_model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, temperature=T
            )
        torch.testing.assert_close(b.sampler_logp, lp.float(), atol=5e-5, rtol=0)


@pytest.mark.parametrize("backend", FAST)
def test_top_k_one_equals_greedy(peaked_model, tok, backend):
    eng = engine(backend, peaked_model, tok)
    greedy = eng.generate(PROMPTS, SamplingOptions(num_generations=1, temperature=0.0, max_new_tokens=6))
    topk1 = eng.generate(
        PROMPTS, SamplingOptions(num_generations=1, temperature=1.0, top_k=1, max_new_tokens=6, seed=3)
    )
    assert torch.equal(greedy.completion_ids, topk1.completion_ids)
    # greedy logprobs are recorded at temperature 1
    ref = dense_logprobs(peaked_model, greedy, 1.0)
    torch.testing.assert_close(greedy.sampler_logp.double(), ref, atol=5e-5, rtol=0)


@pytest.mark.parametrize("backend", FAST)
def test_eos_one_token_completion_and_truncation(peaked_model, tok, backend):
    eng = engine(backend, peaked_model, tok)
    base = SamplingOptions(num_generations=1, temperature=0.0, max_new_tokens=5, eos_token_ids=[tok.pad_token_id])
    free = eng.generate(PROMPTS, base)
    assert free.truncated.all() and not free.finished.any() and (free.completion_mask.sum(1) == 5).all()
    first = int(free.completion_ids[0, 0])
    opts = SamplingOptions(**{**base.__dict__, "eos_token_ids": [first]})
    cut = eng.generate(PROMPTS, opts)
    assert cut.completion_mask[0].tolist()[:1] == [1] and int(cut.completion_mask[0].sum()) == 1
    assert bool(cut.finished[0]) and not bool(cut.truncated[0])
    assert int(cut.completion_ids[0, 0]) == first
    assert cut.sampler_logp[0, 0] == pytest.approx(float(free.sampler_logp[0, 0]), abs=1e-5)
    # row 1 ends at its first `first` token, if any (EOS kept under the mask)
    row1 = free.completion_ids[1].tolist()
    n1 = row1.index(first) + 1 if first in row1 else 5
    assert int(cut.completion_mask[1].sum()) == n1
    assert cut.completion_ids[1, :n1].tolist() == row1[:n1]
    # ignore_eos runs to max_new_tokens through EOS tokens
    ign = eng.generate(PROMPTS, SamplingOptions(**{**opts.__dict__, "ignore_eos": True}))
    assert torch.equal(ign.completion_ids, free.completion_ids) and ign.truncated.all() and not ign.finished.any()


def _boundary_stop(tok, ids: list[int]) -> tuple[str, int] | None:
    """A stop string made of the last 2 chars of token k-1's text and the first 2 of token k's, and k+1."""
    for k in range(1, len(ids) - 1):
        before, after = tok.decode(ids[:k]), tok.decode(ids[: k + 1])
        if "\ufffd" in after or not after.startswith(before) or len(before) < 2 or len(after) - len(before) < 2:
            continue
        stop = before[-2:] + after[len(before) : len(before) + 2]
        if stop not in before and stop.strip():
            return stop, k + 1
    return None


@pytest.mark.parametrize("backend", FAST)
def test_stop_string_across_token_boundary(peaked_model, tok, backend):
    eng = engine(backend, peaked_model, tok)
    opts = SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=10, seed=5, ignore_eos=True)
    free = eng.generate(PROMPTS, opts)
    found = None
    for row in range(4):
        found = _boundary_stop(tok, free.completion_ids[row].tolist())
        if found:
            break
    assert found is not None, "no usable token boundary in 4 sampled rows"
    stop, k = found
    cut = eng.generate(PROMPTS, SamplingOptions(**{**opts.__dict__, "stop": [stop]}))
    ids = free.completion_ids[row, :k].tolist()
    assert cut.completion_ids[row, :k].tolist() == ids and int(cut.completion_mask[row].sum()) == k
    assert bool(cut.finished[row]) and not bool(cut.truncated[row])
    full = tok.decode(ids, skip_special_tokens=True)
    assert cut.completions[row].endswith(stop) and cut.completions[row] == full[: full.find(stop) + len(stop)]
    torch.testing.assert_close(cut.sampler_logp[row, :k], free.sampler_logp[row, :k])
    for r in range(4):  # every row is cut at its own first stop occurrence, or runs to the end
        if stop not in free.completions[r]:
            assert int(cut.completion_mask[r].sum()) == 10 and bool(cut.truncated[r])


@pytest.mark.parametrize("backend", FAST)
def test_generation_mode_restores_training_state(peaked_model, tok, backend):
    m = tiny_qwen2(seed=2)
    m.train()
    m.gradient_checkpointing_enable()
    m.config.use_cache = False
    seen = []
    h = m.register_forward_pre_hook(
        lambda mod, args: seen.append((mod.training, torch.is_grad_enabled(), mod.model.gradient_checkpointing))
    )
    try:
        engine(backend, m, tok).generate(["hi"], SamplingOptions(num_generations=2, max_new_tokens=3, seed=0))
    finally:
        h.remove()
    assert seen and all(s == (False, False, False) for s in seen)
    assert m.training and m.model.gradient_checkpointing and m.config.use_cache is False


def test_continuous_backend_logprobs_and_seed(peaked_model, tok):
    kw = dict(num_blocks=32, block_size=16, max_batch_tokens=64, use_cuda_graph=False, use_async_batching=False)
    eng = make_engine("continuous", peaked_model, tok, **kw)
    opts = SamplingOptions(num_generations=2, temperature=0.8, max_new_tokens=5, seed=11, ignore_eos=True)
    a = eng.generate(PROMPTS, opts)
    check_layout(a, 2, 2, tok.pad_token_id)
    assert a.truncated.all() and (a.completion_mask.sum(1) == 5).all()
    torch.testing.assert_close(a.sampler_logp.double(), dense_logprobs(peaked_model, a, 0.8), atol=1e-4, rtol=0)
    b = eng.generate(PROMPTS, opts)
    assert torch.equal(a.completion_ids, b.completion_ids)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(PROMPTS, SamplingOptions(top_p=0.9))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_generations", 0, "num_generations"),
        ("temperature", -1.0, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_k", -1, "top_k"),
        ("min_p", 1.0, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("max_new_tokens", 0, "max_new_tokens"),
        ("stop", "</a>", "stop"),
        ("stop", None, "stop"),
        ("eos_token_ids", 3, "eos_token_ids"),
        ("max_prompt_length", 0, "max_prompt_length"),
    ],
)
def test_options_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingOptions(**{field: value}).validate()


def test_bad_prompts(peaked_model, tok, gpt2_tokenizer):
    eng = make_engine("hf", peaked_model, tok)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([], SamplingOptions())
    with pytest.raises(TypeError, match="list of strings"):
        eng.generate("just a string", SamplingOptions())
    long = "word " * 600  # > context window 512 - max_new_tokens
    with pytest.raises(ValueError, match="truncate_prompt=True"):
        eng.generate([long], SamplingOptions(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_prompt_length=5"):
        eng.generate(["one two three four five six seven"], SamplingOptions(max_new_tokens=2, max_prompt_length=5))
    b = eng.generate([long], SamplingOptions(num_generations=1, max_new_tokens=4, truncate_prompt=True, seed=0))
    assert b.prompt_ids.shape[1] == 512 - 4
    assert b.prompt_ids[0].tolist() == tok(long)["input_ids"][-(512 - 4):]
    with pytest.raises(ValueError, match="make_engine"):
        make_engine("vllm-typo", peaked_model, tok)
    with pytest.warns(UserWarning, match="greedy"):
        eng.generate(["hi"], SamplingOptions(num_generations=2, temperature=0.0, max_new_tokens=2))


def test_tokenizer_without_pad_or_chat_template(gpt2_tokenizer):
    m = tiny_qwen2(vocab_size=len(gpt2_tokenizer), seed=3)
    eng = make_engine("hf", m, gpt2_tokenizer)
    assert gpt2_tokenizer.pad_token_id is None and not gpt2_tokenizer.chat_template
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        b = eng.generate(["a b", "hello world and more"], SamplingOptions(num_generations=2, max_new_tokens=3, seed=1))
        eng.generate(["a b"], SamplingOptions(num_generations=1, max_new_tokens=2, seed=1))
    pad_warnings = [w for w in rec if "no pad token" in str(w.message)]
    assert len(pad_warnings) == 1  # stated once
    eos = gpt2_tokenizer.eos_token_id
    assert (b.prompt_ids[b.prompt_mask == 0] == eos).all() and (b.prompt_mask == 0).any()
    with pytest.raises(ValueError, match="chat_template"):
        eng.generate([[{"role": "user", "content": "hi"}]], SamplingOptions())


def test_gqa_decode_attention_equals_sdpa(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from logitless.rollout.attention import gqa_decode_attention

    torch.manual_seed(0)
    B, H, kv, L, d = 3, 6, 2, 9, 8
    mod = torch.nn.Module()
    mod.num_key_value_groups, mod.is_causal = H // kv, True
    q = torch.randn(B, H, 1, d, dtype=torch.float64)
    k, v = torch.randn(B, kv, L, d, dtype=torch.float64), torch.randn(B, kv, L, d, dtype=torch.float64)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[2, ..., 7:] = False  # unwritten cache slots
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.3)
    out, _ = gqa_decode_attention(mod, q, k, v, mask, scaling=0.3)
    assert out.shape == (B, 1, H, d)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # traced by torch.compile (the static engine's decode graph) it runs as matmuls around a masked softmax
    traced = torch.compile(gqa_decode_attention, backend="eager", fullgraph=True)
    ref_default_scale = sdpa_attention_forward(mod, q, k, v, mask)[0]

    def no_sdpa(*args, **kwargs):
        raise AssertionError("the traced decode attention called sdpa")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    torch.testing.assert_close(traced(mod, q, k, v, mask, scaling=0.3)[0], ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(traced(mod, q, k, v, mask)[0], ref_default_scale, atol=1e-12, rtol=0)  # 1/sqrt(d)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(traced(mod, q, k, v, additive, scaling=0.3)[0], ref, atol=1e-12, rtol=0)
    monkeypatch.undo()
    # a short masked multi-token query (an observation's prefill) attends as grouped rows too: the mask (causal
    # over the written slots, padding, a bool or an additive one, per row or broadcast over rows) repeats over the
    # H/kv heads of a group; K and V are never repeated
    heads = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda query, *a, **kw: heads.append(query.shape[1]) or sdpa(query, *a, **kw))
    q2 = torch.randn(B, H, 4, d, dtype=torch.float64)
    m2 = torch.tril(torch.ones(4, L, dtype=torch.bool), diagonal=L - 4).expand(B, 1, 4, L).clone()
    m2[0, ..., :3] = False
    m2[1, ..., 2] = False
    for m in (m2, torch.zeros(m2.shape, dtype=torch.float64).masked_fill(~m2, float("-inf")), m2[:1]):
        out, _ = gqa_decode_attention(mod, q2, k, v, m, scaling=0.3)
        assert heads[-1] == kv and out.shape == (B, 4, H, d)
        torch.testing.assert_close(out, sdpa_attention_forward(mod, q2, k, v, m, scaling=0.3)[0], atol=1e-12, rtol=0)
    # without a mask (sdpa's causal kernels), or where the repeated mask would outgrow the repeated K and V (a long
    # prompt's prefill), transformers' sdpa runs unchanged
    gqa_decode_attention(mod, q2, k, v, None)
    assert heads[-1] == H
    long_q = 2 * H * d * k.element_size()  # the mask repeated over the group: long_q·(H/kv) bytes a slot
    q3, m3 = torch.randn(1, H, long_q, d, dtype=torch.float64), torch.ones(1, 1, long_q, L, dtype=torch.bool)
    torch.testing.assert_close(gqa_decode_attention(mod, q3, k[:1], v[:1], m3)[0],
                               sdpa_attention_forward(mod, q3, k[:1], v[:1], m3)[0])
    assert heads[-1] == H
