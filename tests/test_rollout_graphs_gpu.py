"""GPU: the static engine's step graphs (several decode steps per CUDA graph launch, `rollout/graphs.py`) give
the rollout of the step-by-step compiled decode, token for token, across model families, with waves, length
buckets, finished rows compacted away, EOS and stop strings. Run with `python -m pytest -m gpu
tests/test_rollout_graphs_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.graphs import StepGraphs

from tests.test_rollout_families import TOK, make_model
from tests.test_rollout_waves import kv_gib_per_row

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is", "a"]


def _engine(model, graphs: bool, **kw):
    return make_engine("static", model, TOK, compile=True, check_every=4, cache_multiple=8, step_graphs=graphs, **kw)


@pytest.fixture
def replays(monkeypatch):
    """Counts of step-graph replays by steps per graph (the check can fail: the per-step path replays none)."""
    seen: dict[int, int] = {}
    real = StepGraphs.run

    def run(self, key, n, step):
        seen[n] = seen.get(n, 0) + 1
        return real(self, key, n, step)

    monkeypatch.setattr(StepGraphs, "run", run)
    return seen


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "llama4_chunked", "mistral_window"])
def test_step_graphs_give_the_step_by_step_rollout(family, replays):
    model = make_model(family, attn="sdpa").cuda()
    eos = list(range(60, 100))  # rows end at varied steps
    opts = SamplingOptions(num_generations=8, temperature=1.0, max_new_tokens=30, seed=3, eos_token_ids=eos,
                           stop=["zz"])
    P = max(len(TOK(p).input_ids) for p in PROMPTS)
    kw = dict(max_kv_gib=kv_gib_per_row(model, P, 30) * 16.5, length_buckets=3, compact_finished=True)  # 2 waves
    ref = _engine(model, False, **kw).generate(PROMPTS, opts)
    assert replays == {}
    eng = _engine(model, True, **kw)
    got = eng.generate(PROMPTS, opts)
    assert replays.get(4, 0) >= 2 and replays.get(1, 0) >= 1, replays  # 4-step graphs, and a bucket's last steps
    again = eng.generate(PROMPTS, opts)  # a second call: new caches, graphs captured again over them
    lengths = ref.completion_mask.sum(1)
    assert lengths.min() < 8 and lengths.max() > 14  # rows end at different steps: compaction runs
    for b in (got, again):
        assert torch.equal(b.completion_ids, ref.completion_ids) and b.completions == ref.completions
        assert torch.equal(b.completion_mask, ref.completion_mask)
        torch.testing.assert_close(b.sampler_logp, ref.sampler_logp, atol=1e-5, rtol=0)
    # and both are the model's distribution
    args = [x.cuda() for x in (got.prompt_ids, got.prompt_mask, got.completion_ids, got.completion_mask)]
    with torch.no_grad():
        lp = completion_logprobs(model, *args, temperature=1.0)[0].float().cpu()
    m = got.completion_mask.bool()
    assert (got.sampler_logp - lp)[m].abs().max() < 1e-3


def test_step_graphs_with_top_p_fall_back_to_steps(replays):
    """Filters draw eagerly (tests/test_sampling_stats.py), so a rollout with top-p launches step by step."""
    model = make_model("qwen2", attn="sdpa").cuda()
    opts = SamplingOptions(num_generations=4, top_p=0.9, max_new_tokens=12, seed=0, ignore_eos=True)
    a = _engine(model, True).generate(PROMPTS, opts)
    b = _engine(model, False).generate(PROMPTS, opts)
    assert replays == {} and torch.equal(a.completion_ids, b.completion_ids)
