"""The inductor options of every compiled model forward (`models/compiled.py`) keep eager numerics: bf16 roundings
between fused ops and exact fp32 division (Triton's `/` is approximate), so the compiled decode computes what the
eager trainer computes."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from logitless.models.compiled import EAGER_NUMERICS, inductor_options


def test_every_option_is_one_inductor_knows_and_division_is_exact_where_it_can_be():
    known = torch._inductor.config.get_config_copy()
    assert set(inductor_options(True)) <= set(known)  # torch.compile refuses an unknown key only when it compiles
    division = {"eager_numerics.division_rounding", "emulate_divison_rounding"} & set(known)
    assert division and all(EAGER_NUMERICS[k] is True for k in division)


def test_compiled_forward_with_the_options_runs_on_cpu():
    f = torch.compile(lambda x, y: (x / y).to(torch.bfloat16).float() + x, options=inductor_options())
    x, y = torch.randn(33), torch.rand(33) + 0.5
    assert torch.equal(f(x, y), (x / y).to(torch.bfloat16).float() + x)


def renormalised_weights(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k routing weights of Qwen3-MoE / Mixtral: fp32 softmax, top-k, divided by their sum, then bf16."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, _ = torch.topk(probs, k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(torch.bfloat16)


@pytest.mark.gpu
def test_compiled_division_is_eagers_to_the_bit_where_triton_alone_is_not():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1 << 20, device="cuda", generator=g)
    y = torch.rand(1 << 20, device="cuda", generator=g) + 1e-3
    ours = torch.compile(lambda a, b: a / b, options=inductor_options())
    plain = torch.compile(lambda a, b: a / b, options={"emulate_precision_casts": True})
    assert torch.equal(ours(x, y), x / y)
    assert not torch.equal(plain(x, y), x / y)  # the baseline: inductor's default division differs somewhere


@pytest.mark.gpu
@pytest.mark.parametrize("experts,k", [(128, 8), (8, 2)], ids=["qwen3_moe", "mixtral"])
def test_compiled_renormalised_routing_weights_are_eagers_to_the_bit(experts, k):
    logits = torch.randn(4096, experts, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    logits = logits.to(torch.bfloat16)
    torch._dynamo.reset()
    ours = torch.compile(renormalised_weights, options=inductor_options())
    assert torch.equal(ours(logits, k), renormalised_weights(logits, k))
