"""Mixture-of-experts families in the exactness matrix (`bench/gpu_exactness.py`, its MoE part in
`bench/gpu_exactness_moe.py`): the engine records each token's experts, the trainer's logprobs replay them.

GPU (bf16, the experts backend a run picks: grouped_mm on an H100): on every MoE family the `static` engine's
sampler logprobs, against the trainer's with its routes replayed, stay within 1.5x the mean and 2x the max gap of
`hf`'s (transformers `generate`, its own routes replayed), on the same weights in the same test (the conventions of
`tests/test_gpu_exactness.py check`). The gaps without replay (the trainer's own routing) and the share of token x
layer whose trainer top-k differs from the sampler's route are recorded (printed, and saved as JSON under the test's
tmp dir), not bounded.

    python -m pytest -m gpu -s tests/test_moe_exactness.py

CPU: the same measurement in fp32 (static uncompiled) on one family, to check the code path end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from bench import gpu_exactness as G
from bench.gpu_exactness_moe import routed_logprobs
from logitless.models.experts import resolve_experts_implementation
from logitless.models.routing import no_route, routing_of
from logitless.rollout import SamplingOptions, make_engine
from tests.test_gpu_exactness import check


@pytest.fixture(scope="module")
def tok(gpt2_tokenizer_dir):
    return G.tokenizer(gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def measured(tok, tmp_path_factory):
    """G.Result of (family, variant) on the GPU, each measured once per module; every result so far is saved to
    moe_exactness.json in the module's tmp dir (its path printed)."""
    cache: dict = {}
    path = tmp_path_factory.mktemp("moe_exactness") / "moe_exactness.json"

    def get(family: str, variant: str) -> G.Result:
        if (family, variant) not in cache:
            make = G.configs(tok.eos_token_id, moe=True)[family]
            cache[family, variant] = G.run_family(family, make, (variant,), tok)[0]
            path.write_text(json.dumps([dataclasses.asdict(r) for r in cache.values()], indent=1))
            print(f"saved {path}")
        return cache[family, variant]

    return get


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", G.MOE)
def test_static_with_routing_replay_samples_the_policy_to_bf16_rounding(family, measured):
    r, ref = measured(family, "static"), measured(family, "hf")
    print("\n" + "\n".join(G.row(x, [ref, r]) for x in (ref, r)))
    check(r, ref)
    backend = resolve_experts_implementation("auto", torch.device("cuda"), torch.bfloat16)[0]
    assert r.experts == ref.experts == backend  # what a run decodes and trains with (grouped_mm on SM90+)
    for x in (r, ref):  # recorded beside the bound: the trainer's own routing against the sampler's
        assert x.routed > 0 and 0.0 <= x.disagreement <= 1.0, x
        assert math.isfinite(x.own_mean) and math.isfinite(x.own_max), x


NEW_TOKENS, SAMPLES = 8, 2  # the CPU check's decode (fp32: sampler = trainer to rounding)


def test_cpu_fp32_records_replays_and_compares_routes(tok, one_thread):
    """On CPU in fp32 (static uncompiled) the bench's MoE measurement runs end to end: every real token but each
    row's last is routed in every MoE layer, the sampler's logprobs equal the trainer's with replay and without,
    and the trainer's own routing agrees with every recorded route; routes shifted to other experts are all counted
    as disagreeing, and replaying them changes the logprobs while comparing them does not."""
    family = "qwen3_moe"
    make = G.configs(tok.eos_token_id, moe=True)[family]
    results = G.run_family(family, make, G.MOE_VARIANTS, tok, device="cpu", dtype=torch.float32,
                           new_tokens=NEW_TOKENS, samples=SAMPLES)
    prompt_tokens = sum(len(tok(p).input_ids) for p in G.prompts()) * SAMPLES
    layers = make().num_hidden_layers
    for r in results:
        assert r.error is None, r.error
        assert r.experts == "eager"  # auto off CUDA
        assert r.tokens == G.PROMPTS * SAMPLES * NEW_TOKENS
        assert r.routed == layers * (prompt_tokens + G.PROMPTS * SAMPLES * (NEW_TOKENS - 1))
        assert r.mean < 1e-5 and r.max < 1e-4 and r.own_mean < 1e-5 and r.own_max < 1e-4, r
        assert r.disagreement == r.disagreement_replayed == 0.0

    model = G.build(make, "cpu", dtype=torch.float32)
    opts = SamplingOptions(num_generations=SAMPLES, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0,
                           ignore_eos=True)
    batch = make_engine("static", model, tok, record_routes=True).generate(G.prompts(), opts)
    experts = routing_of(model).num_experts
    for name in ("prompt_routes", "completion_routes"):
        routes = getattr(batch, name)
        shifted = ((routes.long() + 1) % experts).to(routes.dtype)  # {a+1, b+1} != {a, b}: every route differs
        setattr(batch, name, torch.where(routes == no_route(routes.dtype), routes, shifted))
    m = batch.completion_mask.bool()
    with G.trainer_forward(model, batch) as args:
        compared = routed_logprobs(model, args, batch, 1.0, replay=False)
        replayed = routed_logprobs(model, args, batch, 1.0, replay=True)
    assert compared.disagreement == 1.0 and compared.routed == results[0].routed
    assert (compared.logp - batch.sampler_logp)[m].abs().max() < 1e-4
    assert (replayed.logp - batch.sampler_logp)[m].abs().mean() > 0.01
