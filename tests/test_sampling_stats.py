"""Every rollout backend draws tokens from the right distribution: a chi-square goodness-of-fit test on a model
whose next-token logits are known exactly, with temperature, top-k, top-p and min-p on and off.

The models (Phi and Qwen2, tiny) are rigged so that the logits at every step are a fixed vector whatever the
context: each draw is then an independent sample of a categorical distribution computed here by hand (not
with transformers' processors). A draw is rejected at a false-alarm rate of 1e-6; with the draw counts used
here a shift like [0.50, 0.25, 0.15, 0.10] -> [0.57, 0.26, 0.12, 0.06], or (hf, static) a temperature 5 % off,
is rejected (`test_chi_square_detects_a_small_shift` checks both on a fixed seed).
"""

from __future__ import annotations

import math

import pytest
import torch

from logitless.rollout import SamplingOptions, make_engine

ALPHA = 1e-6  # false-alarm rate of each goodness-of-fit test
WORDS = ["a", "b", "c", "d", "e", "f"]  # the sampled vocabulary; then <eos>, <pad>
PROBS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]  # next-token distribution at temperature 1
NEVER = -1e4  # logit of <eos> and <pad>: probability exactly 0 in fp32
CB_KW = dict(num_blocks=64, block_size=16, max_batch_tokens=256, use_cuda_graph=False, use_async_batching=False)


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square with df degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `counts` [K] against `probs` [K]. A category of probability 0
    that was drawn gives p = 0."""
    counts, probs = counts.double(), probs.double()
    if (counts[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    return chi2_sf(float(stat), int(keep.sum()) - 1)


def target_distribution(
    temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, penalized: tuple[int, ...] = (),
    penalty: float = 1.0,
) -> torch.Tensor:
    """[8] probabilities of the documented sampler: CTRL repetition penalty on `penalized` tokens, then
    temperature, then keep the top_k most likely, then the smallest most-likely set of mass >= top_p, then the
    tokens of probability >= min_p * max; renormalized after each filter."""
    logits = torch.tensor(PROBS, dtype=torch.float64).log()
    for i in penalized:
        logits[i] = logits[i] / penalty if logits[i] > 0 else logits[i] * penalty
    p = torch.softmax(logits / temperature, 0)
    order = p.argsort(descending=True)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k:
        keep[order[top_k:]] = False
    p = torch.where(keep, p, 0.0) / p[keep].sum()
    if top_p < 1.0:
        mass_before = torch.cumsum(p[order], 0) - p[order]  # mass of the more likely tokens
        keep[order[mass_before >= top_p]] = False
        p = torch.where(keep, p, 0.0) / p[keep].sum()
    if min_p:
        keep &= p >= min_p * p.max()
        p = torch.where(keep, p, 0.0) / p[keep].sum()
    return torch.cat([p, torch.zeros(2, dtype=torch.float64)])


def word_tokenizer():
    """An in-memory word-level tokenizer over WORDS + <eos> + <pad> (ids 0..7)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*WORDS, "<eos>", "<pad>"])}
    tk = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")


def fixed_logits_model(family: str) -> torch.nn.Module:
    """A tiny causal LM whose logits at every position are exactly log(PROBS) (+ NEVER for <eos>, <pad>)."""
    logits = torch.tensor([*[math.log(p) for p in PROBS], NEVER, NEVER])
    torch.manual_seed(0)
    if family == "phi":  # lm_head has a bias: zero the final LayerNorm so the hidden state is 0
        from transformers import PhiConfig, PhiForCausalLM

        cfg = PhiConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, max_position_embeddings=256, eos_token_id=6, pad_token_id=7)
        m = PhiForCausalLM(cfg)
        with torch.no_grad():
            m.model.final_layernorm.weight.zero_()
            m.model.final_layernorm.bias.zero_()
            m.lm_head.bias.copy_(logits)
    else:  # qwen2: identical embeddings and zeroed block outputs make the normed hidden state all ones
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                          tie_word_embeddings=False, eos_token_id=6, pad_token_id=7)
        m = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            m.model.embed_tokens.weight.fill_(1.0)
            for layer in m.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            m.lm_head.weight.zero_()
            m.lm_head.weight[:, 0] = logits
    return m.eval()


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def models(one_thread):
    return {family: fixed_logits_model(family) for family in ("phi", "qwen2")}


def draw(backend: str, model, tok, opts: SamplingOptions, rows: int, steps: int, device: str = "cpu"):
    """(counts [8] of all rows * steps sampled tokens, the batch)."""
    kw = CB_KW if backend == "continuous" else {}
    eng = make_engine(backend, model.to(device), tok, **kw)
    opts = SamplingOptions(**{**opts.__dict__, "num_generations": rows, "max_new_tokens": steps, "ignore_eos": True})
    b = eng.generate(["a c"], opts)
    assert b.completion_mask.all() and b.completion_ids.shape == (rows, steps)
    return torch.bincount(b.completion_ids.flatten(), minlength=8), b


FILTERS = {  # name: (temperature, top_k, top_p, min_p)
    "plain": (1.0, 0, 1.0, 0.0),
    "cold": (0.6, 0, 1.0, 0.0),
    "hot": (1.7, 0, 1.0, 0.0),
    "top_k": (1.0, 3, 1.0, 0.0),
    "top_p": (1.0, 0, 0.75, 0.0),
    "min_p": (1.0, 0, 1.0, 0.2),
    "all": (0.8, 5, 0.9, 0.1),
}


# every filter on one family; the other family on the combined filters (the sampler code is model-independent)
CASES = [("phi", name) for name in FILTERS] + [("qwen2", "all")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["hf", "static"])
@pytest.mark.parametrize("family,name", CASES)
def test_token_frequencies_match_the_sampling_distribution(models, tok, backend, family, name, device):
    temperature, top_k, top_p, min_p = FILTERS[name]
    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=1)
    counts, b = draw(backend, models[family], tok, opts, rows=2000, steps=50, device=device)
    expected = target_distribution(temperature, top_k, top_p, min_p)
    p = chi_square_pvalue(counts.cpu(), expected)
    assert p > ALPHA, f"{backend}/{name}: counts {counts.tolist()} vs expected {(expected * 100_000).round().tolist()}"
    # the recorded logprob ignores the filters: log_softmax(logits / T) of the drawn token
    full = torch.log_softmax(torch.tensor(PROBS, dtype=torch.float64).log() / temperature, 0)
    torch.testing.assert_close(b.sampler_logp.double(), full[b.completion_ids], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_repetition_penalty_frequencies(models, tok, backend):
    # one step: the history is the prompt "a c", so tokens 0 and 2 are penalized
    opts = SamplingOptions(temperature=1.0, repetition_penalty=1.5, seed=2)
    counts, _ = draw(backend, models["phi"], tok, opts, rows=20_000, steps=1)
    expected = target_distribution(1.0, penalized=(0, 2), penalty=1.5)
    assert chi_square_pvalue(counts, expected) > ALPHA, counts.tolist()


@pytest.mark.parametrize("family,temperature", [("phi", 0.6), ("qwen2", 1.0)])
def test_continuous_token_frequencies(models, tok, family, temperature):
    # continuous batching is slower per token on CPU: 15,000 draws (top-k/p, min-p are refused by this backend)
    counts, b = draw("continuous", models[family], tok, SamplingOptions(temperature=temperature, seed=3), rows=150, steps=100)
    expected = target_distribution(temperature)
    assert chi_square_pvalue(counts, expected) > ALPHA, counts.tolist()
    full = torch.log_softmax(torch.tensor(PROBS, dtype=torch.float64).log() / temperature, 0)
    torch.testing.assert_close(b.sampler_logp.double(), full[b.completion_ids], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["phi", "qwen2"])
@pytest.mark.parametrize("backend", ["hf", "static", "continuous"])
def test_greedy_always_draws_the_argmax(models, tok, backend, family):
    counts, _ = draw(backend, models[family], tok, SamplingOptions(temperature=0.0, seed=4), rows=1, steps=20)
    assert counts[0] == 20


def test_target_distribution_by_hand():
    """The hand-computed targets the frequency tests rely on, checked on values worked out on paper."""
    torch.testing.assert_close(target_distribution(1.0)[:6], torch.tensor(PROBS, dtype=torch.float64))
    top3 = torch.tensor([0.40, 0.25, 0.15, 0, 0, 0], dtype=torch.float64) / 0.80
    torch.testing.assert_close(target_distribution(1.0, top_k=3)[:6], top3)
    torch.testing.assert_close(target_distribution(1.0, top_p=0.75)[:6], top3)  # 0.40+0.25 < 0.75 <= 0.80
    top4 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0, 0], dtype=torch.float64) / 0.90
    torch.testing.assert_close(target_distribution(1.0, min_p=0.2)[:6], top4)  # keep p >= 0.08


def test_chi_square_detects_a_small_shift():
    """The test's power on a fixed seed: 15,000 draws (the smallest count used above) from [0.57, 0.26, 0.12,
    0.06] are rejected against [0.50, 0.25, 0.15, 0.10]; 100,000 draws at a temperature 5 % off are rejected
    against the right temperature; draws from the target itself are not. And the p-value matches tables."""
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([0.50, 0.25, 0.15, 0.10], dtype=torch.float64)
    shifted = torch.tensor([0.57, 0.26, 0.12, 0.06], dtype=torch.float64)
    hot = target_distribution(1.0)[:6]
    cooler = target_distribution(0.95)[:6]
    for p, q, n in ((target, shifted, 15_000), (hot, cooler, 100_000)):
        bad = torch.bincount(torch.multinomial(q, n, replacement=True, generator=g), minlength=len(p))
        good = torch.bincount(torch.multinomial(p, n, replacement=True, generator=g), minlength=len(p))
        assert chi_square_pvalue(bad, p) < ALPHA
        assert chi_square_pvalue(good, p) > ALPHA
    # the chi-square(3) survival function at its tabulated 0.05 and 1e-6 critical values
    assert chi2_sf(7.814727903, 3) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(30.66405, 3) == pytest.approx(1e-6, rel=1e-3)
