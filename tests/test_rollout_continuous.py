"""The "continuous" backend (transformers continuous batching) on a tiny byte-level model whose next-token
distribution is flat over 258 tokens, where a filter the backend must not apply (transformers' default top-k of
50) would change every logprob: the recorded logprobs are those of the unfiltered distribution, sampled and
greedy; the caller's RNG is left as it was; the refusals of filter options and of the engine's own fields, by
their text. Cases that mutation testing (docs/testing.md) showed the engine tests leave open."""

from __future__ import annotations

import gc

import pytest
import torch

from logitless.rollout import SamplingOptions, make_engine
from tests.test_rollout import dense_logprobs
from tests.test_rollout_families import TOK, make_model

KW = dict(num_blocks=32, block_size=16, max_batch_tokens=64, use_cuda_graph=False, use_async_batching=False)
PROMPTS = ["ab", "xyz"]


@pytest.fixture(scope="module")
def model():
    m = make_model("llama")
    gc.freeze()  # each generate_batch call collects garbage: keep the heap it walks small
    return m


def test_sampled_logprobs_are_of_the_unfiltered_distribution(model):
    eng = make_engine("continuous", model, TOK, **KW)
    opts = SamplingOptions(num_generations=2, temperature=1.3, max_new_tokens=6, seed=3, ignore_eos=True)
    b = eng.generate(PROMPTS, opts)
    assert (b.completion_mask.sum(1) == 6).all()
    ref = dense_logprobs(model, b, 1.3)
    torch.testing.assert_close(b.sampler_logp.double(), ref, atol=1e-4, rtol=0)
    assert ref.min() < -4  # flat over 258 tokens: log(1/258) = -5.6, far outside any top-50
    t = b.timing
    assert isinstance(t.generate_seconds, float) and 0 < t.generate_seconds <= t.seconds


def test_greedy_takes_the_argmax_and_records_temperature_one_logprobs(model):
    opts = SamplingOptions(num_generations=1, temperature=0.0, max_new_tokens=5, ignore_eos=True)
    hf = make_engine("hf", model, TOK).generate(PROMPTS, opts)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = int(hf.completion_ids[0, 1])  # ignore_eos must ignore this one too
    try:
        b = make_engine("continuous", model, TOK, **KW).generate(PROMPTS, opts)
    finally:
        model.generation_config.eos_token_id = saved
    assert torch.equal(b.completion_ids, hf.completion_ids) and (b.completion_mask.sum(1) == 5).all()
    torch.testing.assert_close(b.sampler_logp.double(), dense_logprobs(model, b, 1.0), atol=1e-4, rtol=0)


def test_seeded_call_leaves_the_callers_rng_as_it_was(model):
    eng = make_engine("continuous", model, TOK, **KW)
    opts = SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=3, seed=5, ignore_eos=True)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = eng.generate(PROMPTS, opts)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)  # another outer state: the seeded draw must not depend on it
    assert torch.equal(eng.generate(PROMPTS, opts).completion_ids, a.completion_ids)


@pytest.mark.parametrize("field, value, off", [
    ("top_k", 5, 0), ("top_p", 0.9, 1.0), ("min_p", 0.1, 0.0), ("repetition_penalty", 1.2, 1.0),
])
def test_filter_options_are_refused_by_their_text(model, field, value, off):
    eng = make_engine("continuous", model, TOK, **KW)
    with pytest.raises(ValueError) as info:
        eng.generate(PROMPTS, SamplingOptions(**{field: value}))
    assert str(info.value) == (
        f"SamplingOptions.{field}={value!r} is not supported by backend 'continuous': transformers would return "
        f"logprobs of the filtered distribution; use backend 'hf' or {field}={off!r}"
    )


def test_engine_fields_are_refused_by_their_text(model):
    with pytest.raises(TypeError) as info:
        make_engine("continuous", model, TOK, num_blocks=8, bogus=1, also_bad=2)
    assert str(info.value) == "ContinuousEngine: unknown ContinuousBatchingConfig fields ['also_bad', 'bogus']"
    for field in ("return_logprobs", "seed"):
        with pytest.raises(TypeError) as info:
            make_engine("continuous", model, TOK, **{field: 1})
        assert str(info.value) == (
            "ContinuousEngine: return_logprobs and seed are set by the engine (SamplingOptions.seed)"
        )
    eng = make_engine("continuous", model, TOK, **KW)
    assert eng.cb_kwargs == KW and eng.model is model and eng.tokenizer is TOK
