"""The "hf" backend's settings and parts on their own: its defaults, the refusals by their text, that `fast_gqa`
really swaps in the grouped-query decode attention, the time it reports, and the logprob recorder at its edges.
Cases that mutation testing (docs/testing.md) showed the engine tests leave open."""

from __future__ import annotations

import pytest
import torch

from logitless.models import UnsupportedModelError
from logitless.rollout import SamplingOptions
from logitless.rollout.attention import NAME as GQA_NAME
from logitless.rollout.hf import HFEngine, LogprobRecorder
from tests.test_rollout_families import TOK, make_model


def test_defaults_and_refusals_by_their_text():
    model = make_model("llama")
    eng = HFEngine(model, TOK)
    assert (eng.static_cache, eng.compile, eng.fast_gqa) == (False, False, True)
    assert HFEngine(model, TOK, static_cache=True).compile is True  # compiled with a static cache by default
    assert HFEngine(model, TOK, static_cache=True, compile=False).compile is False
    with pytest.raises(ValueError) as info:
        HFEngine(model, TOK, compile=True)
    assert str(info.value) == "HFEngine(compile=True) needs static_cache=True (only static caches are compiled)"
    chunked = make_model("llama4_chunked")
    HFEngine(chunked, TOK)  # the dynamic cache runs chunked attention
    with pytest.raises(UnsupportedModelError) as info:
        HFEngine(chunked, TOK, static_cache=True)
    assert str(info.value) == (
        "HFEngine(static_cache=True) cannot run model_type 'llama4_text': transformers' static-cache generate fails "
        "on chunked-attention layers. Use static_cache=False, or rollout.backend=static"
    )


@pytest.mark.parametrize("fast_gqa", [True, False])
def test_fast_gqa_decodes_with_the_grouped_query_attention(fast_gqa):
    model = make_model("llama", "sdpa")  # 4 query heads over 2 KV heads
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(mod.config._attn_implementation))
    try:
        b = HFEngine(model, TOK, fast_gqa=fast_gqa).generate(
            ["ab"], SamplingOptions(num_generations=1, max_new_tokens=2, seed=0, ignore_eos=True)
        )
    finally:
        hook.remove()
    assert seen == ([GQA_NAME] if fast_gqa else ["sdpa"]) * 2
    assert model.config._attn_implementation == "sdpa"  # restored after the call
    t = b.timing
    assert isinstance(t.generate_seconds, float) and 0 < t.generate_seconds <= t.seconds


def test_logprob_recorder_with_no_step_recorded():
    rec = LogprobRecorder(0.5)
    out = rec.finish(torch.zeros((3, 0), dtype=torch.long))
    assert out.shape == (3, 0) and out.dtype == torch.float32
    with pytest.raises(RuntimeError) as info:
        LogprobRecorder(1.0).finish(torch.zeros((3, 2), dtype=torch.long))  # no step was recorded
    assert str(info.value) == "LogprobRecorder saw 0 steps for 2 generated tokens"
