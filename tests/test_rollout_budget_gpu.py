"""GPU: the compiled static engine keeps its KV cache under rollout.max_kv_gib by decoding in waves (the last,
shorter wave padded to the same graph shape), samples what the trainer computes, and a merged-LoRA copy samples
what the PEFT model computes, in bf16. Run with `python -m pytest -m gpu tests/test_rollout_budget_gpu.py`."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers as tf

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.weights import MergedLoraWeights

from tests.test_rollout_families import byte_tokenizer

pytestmark = pytest.mark.gpu

TOK = byte_tokenizer()
# Qwen2.5-1.5B layer shapes, 4 layers: 2 KV heads of 128 -> 4 KiB of bf16 keys+values per token and layer
CFG = dict(vocab_size=len(TOK), hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
           num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.02,
           pad_token_id=TOK.pad_token_id, bos_token_id=None, eos_token_id=TOK.eos_token_id)
PROMPTS = ["alpha beta gamma " * k for k in (1, 3, 5, 7)]
OPTS = SamplingOptions(num_generations=8, temperature=1.0, max_new_tokens=3900, seed=0, ignore_eos=True)
KV_PER_TOKEN = 4 * 2 * 2 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 bytes = 4 KiB
MEAN_TOL, MAX_TOL = 0.03, 0.3  # bf16 compiled decode vs the trainer's forward (tests/test_rollout_gpu.py)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**CFG, attn_implementation="sdpa")).to(torch.bfloat16).eval()


def logp_diff(m, b) -> torch.Tensor:
    dev = torch.device("cuda")
    args = [x.to(dev) for x in (b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)]
    with torch.no_grad():
        lp = completion_logprobs(m, *args, temperature=OPTS.temperature)[0].float().cpu()
    return (b.sampler_logp - lp)[b.completion_mask.bool()].abs()


def test_kv_budget_bounds_the_rollout_peak():
    m = model()
    P = max(len(TOK(p)["input_ids"]) for p in PROMPTS)
    L = min(-(-(P + OPTS.max_new_tokens) // 128) * 128, CFG["max_position_embeddings"])
    row_gib = KV_PER_TOKEN * L / 2**30  # 16 MiB
    budget = 5.5 * row_gib  # 32 rows -> 6 waves of 6 rows (the last padded from 2)
    eng = make_engine("static", m, TOK, compile=True, max_kv_gib=budget)
    peaks = {}
    for name, e in (("waves", eng), ("one", make_engine("static", m, TOK, compile=True))):
        e.generate(PROMPTS, OPTS)  # compile
        assert e._max_len == L
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        b = e.generate(PROMPTS, OPTS)
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        d = logp_diff(m, b)
        assert d.mean() < MEAN_TOL and d.max() < MAX_TOL, (name, float(d.mean()), float(d.max()))
    # one wave holds 32 rows of cache; the waves 6 rows, plus the prefill and small decode buffers
    assert peaks["one"] > 32 * row_gib * 0.95, peaks
    assert peaks["waves"] < budget + 48 / 1024, (peaks, budget)


def test_merged_lora_copy_matches_the_peft_model_in_bf16():
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(model(), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 2e-2)
    weights = MergedLoraWeights(m)
    eng = make_engine("static", m, TOK, compile=True, weights=weights)
    b = eng.generate(PROMPTS, SamplingOptions(**{**OPTS.__dict__, "max_new_tokens": 128}))
    d = logp_diff(m, b)
    assert d.mean() < MEAN_TOL and d.max() < MAX_TOL, (float(d.mean()), float(d.max()))
    with m.disable_adapter():  # the check can fail: without the adapters the logprobs are far off
        assert logp_diff(m, b).mean() > 3 * MEAN_TOL


def test_automatic_budget_stays_under_the_process_memory_cap():
    """Unset max_kv_gib: the budget comes from the memory free under torch.cuda.set_per_process_memory_fraction
    (bench_e2e --memory-budget), so a rollout that needs 32 rows of cache runs in waves instead of failing."""
    m = model()
    P = max(len(TOK(p)["input_ids"]) for p in PROMPTS)
    L = min(-(-(P + OPTS.max_new_tokens) // 128) * 128, CFG["max_position_embeddings"])
    row = KV_PER_TOKEN * L
    # the earlier tests' garbage (reference cycles of their models) is theirs, not this rollout's: a rollout runs a
    # full collection only for a cycle holding its own caches, so it is collected here, before the cap is taken
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    cap = torch.cuda.memory_reserved() + 12 * row + 256 * 2**20  # room for ~12 rows and the decode transients
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        torch.cuda.reset_peak_memory_stats()
        b = make_engine("static", m, TOK, compile=False).generate(PROMPTS, OPTS)
        assert torch.cuda.max_memory_reserved() <= cap
        assert b.completion_ids.shape == (32, OPTS.max_new_tokens)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
