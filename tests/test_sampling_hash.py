"""The static sampler's random streams, value by value (`rollout/sampling.py`): the tensor hash against a
pure-Python lowbias32, the key chain (seed, prompt, sample, step) and the Gumbel noise against the same chain
computed here with Python ints, and the edges of the uniform draw. The chi-square tests in test_fused_sampler.py
check the distribution; these check that the streams are the documented ones, so that a changed constant or
a dropped fold (still random-looking, but other draws than the seeds of earlier runs give) fails.

Written to kill the mutants of `logitless/rollout/sampling.py` that the distribution tests let live.
"""

from __future__ import annotations

import math

import pytest
import torch

from logitless.rollout.sampling import (
    _mul32,
    apply_filters,
    fused_sampler,
    gumbel,
    mix32,
    row_keys,
    sample_tokens,
    step_keys,
    vocab_codes,
)

M = 0xFFFFFFFF
EDGES = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, M - 1, M]


def lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32, on Python ints."""
    x &= M
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def inverse_lowbias32(h: int) -> int:
    h ^= h >> 16
    h = (h * pow(0x846CA68B, -1, 2**32)) & M
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(0x7FEB352D, -1, 2**32)) & M
    return h ^ (h >> 16)


def fold(h: int, value: int) -> int:
    return lowbias32((h ^ lowbias32(value + 0x9E3779B9)) & M)


def key(seed: int, prompt: int, sample: int) -> int:
    seed %= 2**64
    h = fold(lowbias32(seed & M), seed >> 32)
    return fold(fold(h, prompt), sample)


def test_mix32_is_lowbias32():
    xs = torch.tensor(EDGES + list(range(3, 2000, 7)), dtype=torch.long)
    assert mix32(xs).tolist() == [lowbias32(x) for x in xs.tolist()]
    # bijective on a sample: no two inputs collide
    assert len(set(mix32(torch.arange(100_000)).tolist())) == 100_000


@pytest.mark.parametrize("m", [0x7FEB352D, 0x846CA68B, 0xFFFF, 0x10000, 0xFFFFFFFF, 3])
def test_mul32_is_the_product_mod_2_to_the_32(m):
    xs = torch.tensor(EDGES + [12345, 0xABCDEF01], dtype=torch.long)
    assert _mul32(xs, m).tolist() == [(x * m) & M for x in xs.tolist()]


def test_mix32_masks_its_input_to_32_bits():
    xs = torch.tensor([2**32, 2**32 + 5, 2**40 + 0xDEADBEEF, -1], dtype=torch.long)
    assert mix32(xs).tolist() == [lowbias32(x & M) for x in xs.tolist()]


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1, 2**32, 2**32 + 7, 2**63 + 11, -1, -(2**40)])
def test_row_and_step_keys_follow_the_documented_chain(seed):
    prompts = torch.tensor([0, 1, 2, 5, 0, 1000])
    samples = torch.tensor([0, 0, 3, 1, 7, 2])
    keys = row_keys(seed, prompts, samples)
    assert keys.dtype == torch.long
    want = [key(seed, p, s) for p, s in zip(prompts.tolist(), samples.tolist())]
    assert keys.tolist() == want
    for step in (0, 1, 511):
        assert step_keys(keys, step).tolist() == [fold(k, step) for k in want]


def test_seeds_that_differ_only_in_their_high_bits_give_other_streams():
    p, s = torch.tensor([0, 1]), torch.tensor([0, 0])
    assert not torch.equal(row_keys(5, p, s), row_keys(5 + 2**32, p, s))
    assert torch.equal(row_keys(5, p, s), row_keys(5 + 2**64, p, s))  # any int seed, taken mod 2**64
    assert not torch.equal(row_keys(5, p, s), row_keys(5, s, p))  # prompt and sample are not interchangeable


def test_vocab_codes_and_gumbel_values():
    codes = vocab_codes(50, torch.device("cpu"))
    assert codes.tolist() == [lowbias32(2 * v + 1) for v in range(50)]
    keys = step_keys(row_keys(3, torch.tensor([0, 4]), torch.tensor([1, 0])), 2)
    g = gumbel(keys, codes)
    assert g.shape == (2, 50) and g.dtype == torch.float32
    for b, k in enumerate(keys.tolist()):
        for v, c in enumerate(codes.tolist()):
            u = ((lowbias32(k ^ c) >> 8) + 0.5) / 2**24
            assert math.isclose(float(g[b, v]), -math.log(-math.log(u)), rel_tol=1e-5, abs_tol=1e-5), (b, v)


def test_uniform_draw_stays_inside_zero_one():
    """h = 0 and h = 2**32 - 1 give u = 0.5 / 2**24 and 1 - 0.5 / 2**24: finite Gumbel values at both ends."""
    zero_key = torch.tensor([0], dtype=torch.long)  # mix32(0 ^ 0) = 0
    g = gumbel(zero_key, torch.tensor([0], dtype=torch.long))
    u = 0.5 / 2**24
    assert math.isclose(float(g), -math.log(-math.log(u)), rel_tol=1e-6)
    top = inverse_lowbias32(M)  # the key whose hash with code 0 is 2**32 - 1
    assert lowbias32(top) == M
    g = gumbel(torch.tensor([top], dtype=torch.long), torch.tensor([0], dtype=torch.long))
    u = 1 - 2**-24  # (2**24 - 0.5) / 2**24 is not an fp32 number: it rounded to 1.0, and the noise to +inf
    assert torch.isfinite(g).all() and math.isclose(float(g), -math.log(-math.log(u)), rel_tol=1e-6)


def test_a_filtered_token_is_never_drawn_even_with_the_largest_noise():
    """A row whose noise at a filtered-out token is the largest value the hash gives: that token stays out (an
    infinite noise there made -inf + inf = NaN, and argmax picks NaN)."""
    V = 16
    codes = vocab_codes(V, torch.device("cpu"))
    logits = torch.linspace(2.0, -1.0, V).expand(V, V).contiguous()
    keys = torch.tensor([inverse_lowbias32(M) ^ c for c in codes.tolist()])  # row v: the top noise at token v
    assert (gumbel(keys, codes).argmax(-1) == torch.arange(V)).all() and torch.isfinite(gumbel(keys, codes)).all()
    scores = torch.where(torch.arange(V) < 4, logits, -math.inf)  # top-4 kept
    token, logp = sample_tokens(logits, scores, keys, codes, 1.0, greedy=False)
    assert (token < 4).all(), token.tolist()
    assert torch.isfinite(logp).all()


def test_sample_tokens_is_the_argmax_of_scores_plus_the_rows_noise():
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 2
    keys = step_keys(row_keys(1, torch.arange(5), torch.zeros(5, dtype=torch.long)), 0)
    codes = vocab_codes(40, torch.device("cpu"))
    for T in (1.0, 0.7, 2.0):
        token, logp = sample_tokens(logits, None, keys, codes, T, greedy=False)
        assert torch.equal(token, (logits / T + gumbel(keys, codes)).argmax(-1))
        torch.testing.assert_close(logp, torch.log_softmax(logits.double() / T, -1).gather(1, token[:, None])[:, 0].float())
        scores = torch.where(torch.arange(40) < 10, logits / T, -math.inf)  # a filter that keeps 10 tokens
        token, logp = sample_tokens(logits, scores, keys, codes, T, greedy=False)
        assert (token < 10).all() and torch.equal(token, (scores + gumbel(keys, codes)).argmax(-1))
        torch.testing.assert_close(logp, torch.log_softmax(logits.double() / T, -1).gather(1, token[:, None])[:, 0].float())
        greedy, glogp = sample_tokens(logits, scores, keys, codes, T, greedy=True)
        assert torch.equal(greedy, scores.argmax(-1))
        torch.testing.assert_close(glogp, torch.log_softmax(logits.double() / T, -1).gather(1, greedy[:, None])[:, 0].float())


def test_fused_sampler_without_cuda_or_compile_is_the_plain_function():
    assert fused_sampler(torch.device("cpu"), compile=True) is sample_tokens
    assert fused_sampler(torch.device("cpu"), compile=False) is sample_tokens


def test_apply_filters_chains_the_processors_in_order():
    history = torch.zeros((1, 1), dtype=torch.long)
    scaled = torch.tensor([[1.0, 2.0, 3.0]])
    assert apply_filters([], history, scaled) is None
    add = lambda ids, s: s + 1  # noqa: E731
    double = lambda ids, s: s * 2  # noqa: E731
    assert apply_filters([add, double], history, scaled).tolist() == [[4.0, 6.0, 8.0]]
    assert apply_filters([double, add], history, scaled).tolist() == [[3.0, 5.0, 7.0]]
    # the history reaches the processors: a repetition penalty divides the positive score of a token seen before
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    seen = torch.tensor([[2, 2]])
    assert apply_filters([RepetitionPenaltyLogitsProcessor(2.0)], seen, scaled).tolist() == [[1.0, 2.0, 1.5]]


def test_step_keys_make_no_tensor_of_the_step(monkeypatch):
    """The step is hashed on the host: a tensor made from it on CUDA is a host-to-device copy, which
    synchronizes the stream at every decode step (the GPU then idles while the host launches the next one)."""
    keys = row_keys(3, torch.tensor([0, 1]), torch.tensor([0, 1]))
    want = step_keys(keys, 9).tolist()

    def no_tensor(*args, **kwargs):
        raise AssertionError("step_keys made a tensor from a Python number")

    monkeypatch.setattr(torch, "as_tensor", no_tensor)
    monkeypatch.setattr(torch, "tensor", no_tensor)
    assert step_keys(keys, 9).tolist() == want
