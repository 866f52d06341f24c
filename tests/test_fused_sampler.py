"""The static engine's fused sampler (`rollout/sampling.py`) draws from the right distribution: a chi-square
test of many independent rows (each its own random stream) against the filtered softmax computed here in fp64
from the definitions of temperature, top-k, top-p and min-p, with the filters on and off. The recorded logprob is
log_softmax(logits / T) of the drawn token. The GPU test runs the torch.compile'd sampler."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper

from logitless.rollout import SamplingOptions
from logitless.rollout.hf import sampling_processors
from logitless.rollout.sampling import apply_filters, fused_sampler, row_keys, step_keys, vocab_codes

V, N = 12, 30_000  # vocabulary, independent draws
LOGITS = torch.tensor([2.0, 1.7, 1.5, 1.1, 0.9, 0.4, 0.2, -0.1, -0.6, -1.0, -1.8, -2.5])
CASES = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=0.8, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.2, min_p=0.2),
    "all": dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.1),
}


def expected(opts: SamplingOptions) -> torch.Tensor:
    """[V] fp64 probabilities of the filtered distribution, from the filters' definitions (transformers' order:
    top-k, then top-p over the renormalized survivors, then min-p)."""
    p = torch.softmax(LOGITS.double() / opts.temperature, -1)
    keep = torch.ones(V, dtype=torch.bool)
    if opts.top_k:
        keep &= p >= p.topk(opts.top_k).values[-1]
    if opts.top_p < 1.0:
        q = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
        order = q.argsort(descending=True)
        before = torch.cumsum(q[order], 0) - q[order]  # mass of the tokens ranked above
        nucleus = torch.zeros(V, dtype=torch.bool)
        nucleus[order] = before < opts.top_p
        keep &= nucleus
    if opts.min_p > 0:
        keep &= p >= opts.min_p * p.max()
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


def draw(opts: SamplingOptions, device: torch.device, compile: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = LOGITS.to(device).expand(N, V).contiguous()
    filters = [p for p in sampling_processors(opts) if not isinstance(p, TemperatureLogitsWarper)]
    T = opts.logp_temperature
    scores = apply_filters(filters, torch.zeros((N, 1), dtype=torch.long, device=device), logits / T)
    keys = step_keys(row_keys(11, torch.arange(N, device=device), torch.zeros(N, dtype=torch.long, device=device)), 0)
    sampler = fused_sampler(device, compile)
    token, logp = sampler(logits, scores, keys, vocab_codes(V, device), T, opts.temperature == 0)
    return token.cpu(), logp.cpu()


def chi2_quantile(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at the normal quantile z (3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def check_distribution(opts: SamplingOptions, token: torch.Tensor, logp: torch.Tensor) -> None:
    p = expected(opts)
    counts = torch.bincount(token, minlength=V).double()
    assert (counts[p == 0] == 0).all(), "a filtered-out token was drawn"
    support = p > 0
    stat = float(((counts[support] - N * p[support]) ** 2 / (N * p[support])).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert stat < chi2_quantile(df), (stat, df, counts.tolist(), (N * p).tolist())
    ref = torch.log_softmax(LOGITS.double() / opts.logp_temperature, -1)[token]
    torch.testing.assert_close(logp.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_sampler_draws_the_filtered_softmax(case):
    opts = SamplingOptions(**CASES[case])
    token, logp = draw(opts, torch.device("cpu"), compile=False)
    check_distribution(opts, token, logp)


def test_the_chi_square_check_can_fail():
    """Draws of the unfiltered softmax fail the top-k case's check; the greedy sampler gives the argmax."""
    plain, _ = draw(SamplingOptions(temperature=0.8), torch.device("cpu"), compile=False)
    with pytest.raises(AssertionError):
        check_distribution(SamplingOptions(**CASES["top_k"]), plain, torch.zeros(N))
    # 'hot' draws checked against the T = 1 distribution fail on the statistic alone
    hot, hot_logp = draw(SamplingOptions(temperature=1.7), torch.device("cpu"), compile=False)
    with pytest.raises(AssertionError, match=r"^\("):
        check_distribution(SamplingOptions(temperature=1.0), hot, torch.log_softmax(LOGITS.double(), -1)[hot])
    greedy, _ = draw(SamplingOptions(temperature=0.0), torch.device("cpu"), compile=False)
    assert (greedy == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fused_sampler_on_cuda(case):
    opts = SamplingOptions(**CASES[case])
    token, logp = draw(opts, torch.device("cuda"), compile=True)
    check_distribution(opts, token, logp)


@pytest.mark.gpu
def test_compiled_sampler_outlives_dynamos_recompile_limit():
    """Each temperature is a recompile of the process-wide compiled sampler; past dynamo's limit the draws must go
    on (eagerly), not fail, and stay exact draws."""
    limit = torch._dynamo.config.recompile_limit
    temperatures = [0.5 + 0.1 * i for i in range(limit + 3)]
    for T in temperatures:
        opts = SamplingOptions(temperature=T)
        token, logp = draw(opts, torch.device("cuda"), compile=True)
        check_distribution(opts, token, logp)
