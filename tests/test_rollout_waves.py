"""The static engine under a KV-cache budget: rows decoded in waves give the same tokens and logprobs as one wave
(per-row random streams), on several model families; a budget too small for one row is refused with the
smallest value that works; the per-row streams really are per row."""

from __future__ import annotations

import re

import pytest
import torch

from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.kv_cache import length_buckets, wave_rows
from logitless.rollout.sampling import gumbel, row_keys, step_keys, vocab_codes

from tests.test_rollout_families import TOK, make_model

PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is", "a"]
OPTS = SamplingOptions(num_generations=3, temperature=0.9, top_k=50, top_p=0.95, max_new_tokens=12, seed=7)


def kv_gib_per_row(model, prompt_len: int, new: int, multiple: int = 8) -> float:
    """What the engine will count for one row: keys + values of every layer over the cache length."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    L = -(-(prompt_len + new) // multiple) * multiple
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4 * L / 2**30


@pytest.mark.parametrize("family", ["llama", "qwen2_sliding", "gemma2"])
def test_waves_give_the_same_rollout_as_one_wave(family, one_thread):
    model = make_model(family)
    one = make_engine("static", model, TOK, check_every=4, cache_multiple=8).generate(PROMPTS, OPTS)
    P = one.prompt_ids.shape[1]
    row = kv_gib_per_row(model, P, OPTS.max_new_tokens)
    B = len(PROMPTS) * OPTS.num_generations
    for rows in (5, 1):  # waves that split prompts' groups, and one row at a time
        eng = make_engine("static", model, TOK, check_every=4, cache_multiple=8, max_kv_gib=row * (rows + 0.5))
        waved = eng.generate(PROMPTS, OPTS)
        assert wave_rows(B, int(row * 2**30), row * (rows + 0.5) * 2**30, "x") == -(-B // -(-B // rows))
        assert torch.equal(waved.completion_ids, one.completion_ids), (family, rows)
        assert torch.equal(waved.completion_mask, one.completion_mask)
        # tokens are exact; logprobs agree to fp32 rounding (CPU GEMMs round a row differently for another row
        # count: a few ulps)
        torch.testing.assert_close(waved.sampler_logp, one.sampler_logp, atol=1e-5, rtol=0)
        assert waved.completions == one.completions
    # the check can fail: another seed gives other tokens
    other = make_engine("static", model, TOK, check_every=4, cache_multiple=8).generate(
        PROMPTS, SamplingOptions(**{**OPTS.__dict__, "seed": 8}))
    assert not torch.equal(other.completion_ids, one.completion_ids)


def test_budget_too_small_for_one_row_names_the_setting_and_the_minimum():
    model = make_model("llama")
    P = len(TOK("Hi there, how are you?")["input_ids"])
    row = kv_gib_per_row(model, P, OPTS.max_new_tokens)
    eng = make_engine("static", model, TOK, cache_multiple=8, max_kv_gib=row / 3)
    with pytest.raises(ValueError, match=r"rollout\.max_kv_gib") as err:
        eng.generate(PROMPTS, OPTS)
    need = float(re.search(r"rollout\.max_kv_gib >= ([0-9.e-]+)", str(err.value)).group(1))
    assert need >= row  # the value it names is enough ...
    ok = make_engine("static", model, TOK, cache_multiple=8, max_kv_gib=need).generate(PROMPTS, OPTS)
    assert ok.completion_ids.shape[0] == len(PROMPTS) * OPTS.num_generations  # ... and works
    with pytest.raises(ValueError, match=r"rollout\.max_kv_gib=-1"):
        make_engine("static", model, TOK, max_kv_gib=-1)


def test_row_streams_depend_only_on_seed_prompt_and_sample():
    codes = vocab_codes(300, torch.device("cpu"))
    a = row_keys(123, torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 0, 5]))
    b = row_keys(123, torch.tensor([2, 0]), torch.tensor([5, 1]))
    assert torch.equal(a[[3, 1]], b)  # the same (prompt, sample) gives the same key in any batch
    assert len(set(a.tolist())) == 4 and not torch.equal(row_keys(124, torch.tensor([0]), torch.tensor([0])), a[:1])
    g = gumbel(step_keys(a, 3), codes)  # [4, 300]
    assert torch.equal(g[[3, 1]], gumbel(step_keys(b, 3), codes))
    assert not torch.equal(g, gumbel(step_keys(a, 4), codes))
    # Gumbel(0, 1): mean = Euler's gamma, variance = pi^2 / 6 (1200 draws: 5 standard errors)
    big = gumbel(step_keys(row_keys(0, torch.arange(200), torch.zeros(200, dtype=torch.long)), 0), codes)
    assert abs(float(big.mean()) - 0.5772) < 5 * 1.28 / big.numel() ** 0.5
    assert abs(float(big.var()) - 1.6449) < 0.05


@pytest.mark.parametrize("family", ["llama", "mistral_window", "gemma2", "llama4_chunked"])
def test_length_buckets_give_the_same_rollout(family, one_thread):
    """Attending over the filled part of the cache (rounded up to a bucket) changes nothing but summation order,
    on full, sliding-window, alternating and chunked layouts."""
    model = make_model(family)
    opts = SamplingOptions(**{**OPTS.__dict__, "max_new_tokens": 20})
    whole = make_engine("static", model, TOK, check_every=4, cache_multiple=4).generate(PROMPTS, opts)
    eng = make_engine("static", model, TOK, check_every=4, cache_multiple=4, length_buckets=4)
    bucketed = eng.generate(PROMPTS, opts)
    P = whole.prompt_ids.shape[1]
    assert len(length_buckets(P, eng._max_len, 4, 4)) == 4
    assert torch.equal(bucketed.completion_ids, whole.completion_ids)
    torch.testing.assert_close(bucketed.sampler_logp, whole.sampler_logp, atol=1e-5, rtol=0)
    # the check can fail: buckets that hide the generated slots change the logprobs
    import logitless.rollout.static_rows as static_rows

    real, seen = static_rows.set_visible, []
    try:
        static_rows.set_visible = lambda cache, v: (seen.append(v), real(cache, P))
        wrong = eng.generate(PROMPTS, opts)
    finally:
        static_rows.set_visible = real
    assert len(seen) == 4 and seen == sorted(seen)  # every bucket was used, shortest first
    assert not torch.allclose(wrong.sampler_logp[:, 2:], whole.sampler_logp[:, 2:], atol=1e-3)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_compacting_finished_rows_gives_the_same_rollout(family, one_thread, monkeypatch):
    """Rows that ended are dropped from the decode batch (32 -> 16 -> 8 rows here); the samples do not change."""
    model = make_model(family)
    eos = list(range(60, 130))  # a quarter of the vocabulary ends a row: rows end at varied steps
    opts = SamplingOptions(num_generations=8, temperature=1.0, max_new_tokens=24, seed=3, eos_token_ids=eos,
                           stop=["zz"])
    plain = make_engine("static", model, TOK, check_every=2, cache_multiple=8).generate(PROMPTS, opts)
    import logitless.rollout.static_rows as static_rows

    sizes = []
    real = static_rows.select_rows
    monkeypatch.setattr(static_rows, "select_rows", lambda cache, rows: (sizes.append(len(rows)), real(cache, rows))[1])
    eng = make_engine("static", model, TOK, check_every=2, cache_multiple=8, compact_finished=True)
    compact = eng.generate(PROMPTS, opts)
    assert sizes[:2] == [16, 8], sizes  # the check exercises compaction
    lengths = plain.completion_mask.sum(1)
    assert lengths.min() < 6 and lengths.max() > 12  # rows really end at different steps
    assert torch.equal(compact.completion_ids, plain.completion_ids)
    assert torch.equal(compact.completion_mask, plain.completion_mask) and compact.completions == plain.completions
    torch.testing.assert_close(compact.sampler_logp, plain.sampler_logp, atol=1e-5, rtol=0)
