"""Refill (`rollout/static_refill.py`, rollout.refill): when the KV budget holds fewer rows than a call has, decode
slots take the next row as soon as theirs ends. Oracle: the waves of the same budget (and one wave), which give
each row the same tokens and logprobs; refill must give them too, on full-attention families with learned
(gpt2) and rotary positions, odd row counts, one-row and several-row budgets, EOS, stop strings, greedy and
sampled draws, top-k/top-p. On planted long-tailed lengths it takes fewer decode steps than the waves. What
rules it out is refused naming the setting."""

from __future__ import annotations

import pytest
import torch

from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout import static_refill, step_graph
from logitless.trainer.config.schema import RolloutConfig
from tests.test_rollout_families import TOK
from tests.test_step_graph import models  # noqa: F401 (fixture: one tiny model per family)

PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is"]  # 3 prompts x G=3: 9 rows
EOS = list(range(3, 258, 13))  # about one byte in thirteen ends a row: lengths vary over the 16 tokens


def options(**kw) -> SamplingOptions:
    return SamplingOptions(**{**dict(num_generations=3, temperature=0.9, max_new_tokens=16, seed=5,
                                     eos_token_ids=EOS), **kw})




def budget(model, slots: int, new: int = 16) -> float:
    """A KV budget (GiB) that holds `slots` rows of these prompts: keys + values of every layer over the cache
    length (the prompt and `new` tokens rounded up to 8 slots), in fp32."""
    cfg, P = model.config, max(len(TOK(p)["input_ids"]) for p in PROMPTS)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    row = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4 * -(-(P + new) // 8) * 8
    return row * (slots + 0.5) / 2**30


def generate(model, opts, monkeypatch=None, **kw):
    """(batch, decode steps run by a `DecodeStep` or `RefillStep`, refill steps among them)."""
    calls = {"step": 0, "refill": 0}
    real = step_graph.DecodeStep.advance

    def counted(self):
        calls["step"] += 1
        calls["refill"] += isinstance(self, static_refill.RefillStep)
        return real(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_graph.DecodeStep, "advance", counted)
        eng = make_engine("static", model, TOK, check_every=3, cache_multiple=8, **kw)
        batch = eng.generate(PROMPTS, opts)
    return batch, calls["step"], calls["refill"]


def assert_same(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert a.completions == b.completions and torch.equal(a.truncated, b.truncated)
    # CPU GEMMs round a row differently for another row count (a few ulps), as between waves
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_refill_gives_the_waves_rollout(family, models, one_thread):
    model = models(family)
    one, _, _ = generate(model, options())
    lens = one.completion_mask.sum(1)
    assert lens.min() < 6 and lens.max() >= 10  # rows end at varied steps
    for slots in (4, 2, 1):  # 9 rows through 3 (waves of 3), 2 (waves of 2, one of 1) and 1 slot(s)
        waves, _, _ = generate(model, options(), max_kv_gib=budget(model, slots), refill=False)
        refill, steps, refilled = generate(model, options(), max_kv_gib=budget(model, slots), refill=True)
        assert steps == refilled > 0, (family, slots)  # the refill decoded
        assert_same(refill, waves)
        assert_same(refill, one)
    # the check can fail: another seed gives other tokens
    other, _, _ = generate(model, options(seed=6), max_kv_gib=budget(model, 2), refill=True)
    assert not torch.equal(other.completion_ids, one.completion_ids)


@pytest.mark.parametrize("kw", [dict(temperature=0.0, seed=None), dict(stop=["e", "o "], eos_token_ids=[257]),
                                dict(top_k=20, top_p=0.9, num_generations=5)],
                         ids=["greedy", "stop_strings", "top_k_top_p"])
def test_refill_with_greedy_stop_strings_and_filters(kw, models, one_thread):
    model = models("qwen2")
    opts = options(**kw)
    waves, _, _ = generate(model, opts, max_kv_gib=budget(model, 2), refill=False)
    refill, _, refilled = generate(model, opts, max_kv_gib=budget(model, 2), refill=True)
    assert refilled > 0
    assert_same(refill, waves)
    if "stop" in kw:
        assert any(any(s in c for s in kw["stop"]) for c in refill.completions)  # stop strings ended rows


def test_refill_is_on_by_default_where_it_applies(models, one_thread):
    model = models("llama")
    _, _, refilled = generate(model, options(), max_kv_gib=budget(model, 3))
    assert refilled > 0  # rows > slots, fused draw: refill
    _, _, refilled = generate(model, options(), max_kv_gib=budget(model, 20))
    assert refilled == 0  # one wave holds every row: nothing to refill
    _, _, refilled = generate(model, options(top_k=20), max_kv_gib=budget(model, 3))
    assert refilled == 0  # top-k draws eagerly: the waves' loop unless refill=true asks
    _, _, refilled = generate(models("qwen2_sliding"), options(), max_kv_gib=budget(model, 3))
    assert refilled == 0  # a sliding-window layer: waves


def test_refill_takes_fewer_steps_on_long_tailed_lengths(models, one_thread):
    """Planted lengths (`row_limits`): most rows short, one in a few long. Waves of 3 last as long as their
    longest row; refilled slots do not wait. Tokens and the planted lengths are the same either way."""
    model = models("llama")
    G, new = 4, 40
    lengths = torch.tensor([3, 5, 40, 4, 6, 3, 2, 38, 5, 4, 36, 3])  # 12 rows
    opts = options(num_generations=G, max_new_tokens=new, eos_token_ids=[257])  # no EOS in reach: lengths rule

    def run(refill):
        with pytest.MonkeyPatch.context() as mp:
            counts = {"n": 0}
            real = step_graph.DecodeStep.advance
            mp.setattr(step_graph.DecodeStep, "advance", lambda self: (counts.__setitem__("n", counts["n"] + 1),
                                                                       real(self))[1])
            eng = make_engine("static", model, TOK, check_every=2, cache_multiple=8, step_graph=True,
                              max_kv_gib=budget(model, 3, new), refill=refill)
            eng.row_limits = lengths
            return eng.generate(PROMPTS, opts), counts["n"]

    waves, wave_steps = run(False)
    refill, refill_steps = run(True)
    assert torch.equal(waves.completion_mask.sum(1), lengths)
    assert_same(refill, waves)
    # waves of rows (0-2), (3-5), (6-8), (9-11): 39 + 5 + 37 + 35 steps after each first token
    assert wave_steps == 116
    # 3 slots over 122 tokens: at least 122 / 3 steps, and well under the waves' (ends seen every 2 steps)
    assert 40 <= refill_steps <= 60, refill_steps


def test_refill_refusals_name_the_setting(models):
    model = models("llama")
    with pytest.raises(ValueError, match="rollout.compact_finished=false"):
        make_engine("static", model, TOK, compact_finished=True, refill=True)
    with pytest.raises(ValueError, match="sliding-window"):
        make_engine("static", models("qwen2_sliding"), TOK, refill=True)
    eng = make_engine("static", model, TOK, cache_multiple=8, max_kv_gib=budget(model, 2), refill=True)
    with pytest.raises(ValueError, match="rollout.repetition_penalty=1.0"):
        eng.generate(PROMPTS, options(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="rollout.refill=true .* rollout.length_buckets"):
        RolloutConfig(backend="static", refill=True, length_buckets=2)
    with pytest.raises(ValueError, match="rollout.refill=True needs rollout.backend=static"):
        RolloutConfig(backend="hf", refill=True)
    eng.row_limits = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="row_limits has shape"):
        eng.generate(PROMPTS, options())


@pytest.mark.gpu
def test_refill_on_cuda_captures_one_graph_and_draws_the_waves_tokens():
    """GPU (`python -m pytest -m gpu tests/test_rollout_refill.py`): the refill step compiled and captured as one
    CUDA graph per call (the triton attention and draw on bf16) against the captured waves of the same slot
    count, on planted long-tailed lengths: the same tokens, logprobs to bf16 kernel noise, fewer steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.conftest import tiny_qwen2

    model = tiny_qwen2(vocab_size=len(TOK), hidden=128, layers=2).to("cuda", torch.bfloat16).eval()
    # (k, v) x 2 layers x 2 KV heads x head dim 32 x bf16 x 120 slots (the 22-token prompt + 96, rounded up to 8)
    row_bytes = 2 * 2 * 2 * 32 * 2 * 120
    # 24 rows; lengths only as planted (a random bf16 model on the GPU draws the EOS id now and then)
    opts = options(num_generations=8, max_new_tokens=96, eos_token_ids=[257], ignore_eos=True)
    lengths = torch.tensor([96 if i % 7 == 3 else 4 + (5 * i) % 17 for i in range(24)])
    captures, steps = [], {}
    real = step_graph.capture

    def counted(fn, side):
        captures.append(1)
        return real(fn, side)

    def run(refill):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(step_graph, "capture", counted)
            n = {"n": 0}
            adv = step_graph.DecodeStep.advance
            mp.setattr(step_graph.DecodeStep, "advance", lambda self: (n.__setitem__("n", n["n"] + 1), adv(self))[1])
            eng = make_engine("static", model, TOK, cache_multiple=8, refill=refill,
                              max_kv_gib=8.5 * row_bytes / 2**30)  # 8 rows

            eng.row_limits = lengths
            batch = eng.generate(PROMPTS, opts)
            steps[refill] = n["n"]
            return batch

    waves = run(False)
    assert len(captures) == 3  # 3 waves of 8
    refill = run(True)
    assert len(captures) == 4  # one capture for the whole refilled call
    assert torch.equal(waves.completion_mask.sum(1), lengths)
    assert torch.equal(refill.completion_ids, waves.completion_ids)
    torch.testing.assert_close(refill.sampler_logp, waves.sampler_logp, atol=1e-3, rtol=0)
    assert steps[True] < steps[False], steps
