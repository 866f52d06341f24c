"""bench/fused_projections.py: a model whose QKV and gate-up projections are fused computes the same logits, and
the static engine decodes it to the same tokens, across model families; under torch.compile the graph holds 3
fewer matrix products per layer."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.fused_projections import SlicedLinear, fuse_projections
from logitless.rollout import SamplingOptions, make_engine
from tests.test_rollout_families import TOK, make_model

PROMPTS = ["2+2 is", "The quick brown fox"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_window", "gemma2"])
def test_fused_projections_compute_the_same_model(family, one_thread):
    model = make_model(family)
    fused = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert fuse_projections(fused) == 2 * layers
    assert sum(isinstance(m, SlicedLinear) for m in fused.modules()) == 5 * layers
    ids = torch.randint(0, len(TOK), (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    opts = SamplingOptions(num_generations=2, max_new_tokens=10, seed=0, ignore_eos=True)
    a, b = (make_engine("static", m, TOK, check_every=4, cache_multiple=8).generate(PROMPTS, opts)
            for m in (model, fused))
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, atol=1e-5, rtol=0)
    assert all(m.product is None for m in fused.modules() if hasattr(m, "product"))  # nothing outlives a forward


def test_compiled_fused_model_runs_one_gemm_per_group(one_thread):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    counts = []

    def count(gm, example_inputs):
        counts.append(sum("mm" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return make_boxed_func(gm.forward)

    ids = torch.randint(0, len(TOK), (4, 1), generator=torch.Generator().manual_seed(0))
    for fused in (False, True):
        model = make_model("qwen2")
        if fused:
            fuse_projections(model)
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=aot_autograd(fw_compiler=count), fullgraph=True)(ids)
    plain, fused_count = counts
    assert plain - fused_count == 3 * model.config.num_hidden_layers, counts
