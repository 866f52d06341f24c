"""The experts backend of a mixture of experts (model.experts_implementation, logitless/models/experts.py): what
"auto" picks and why, that a loaded model runs it, and that the backends compute the same logprobs and gradients
(CPU, fp32; on an H100/H200 grouped_mm against eager within the eager model's own bf16 error, and the static
engine's captured decode step over grouped_mm experts)."""

from __future__ import annotations

import warnings

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.experts import (
    experts_implementation,
    graph_capturable,
    grouped_mm_runs,
    moe_shape,
    resolve_experts_implementation,
    set_experts_implementation,
)
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import load_model
from tests.test_moe_lora import FAMILIES, moe_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def logprobs_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's completion logprobs of `ids` (6 prompt tokens) and the gradient of their sum w.r.t. every
    expert stack, router and attention weight."""
    model.zero_grad(set_to_none=True)
    mask = torch.ones_like(ids)
    lp = completion_logprobs(model, ids[:, :6], mask[:, :6], ids[:, 6:], mask[:, 6:])[0]
    lp.sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
             if p.grad is not None and ("experts" in n or "gate" in n or "router" in n or "q_proj" in n)}
    return lp.detach().float(), grads


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # (gpt_oss: transposed stacks with biases)
def test_the_backends_compute_the_same_logprobs_and_gradients_on_cpu(family, one_thread):
    model = moe_model(family).train()
    ids = torch.randint(0, 256, (3, 14), generator=torch.Generator().manual_seed(0))
    set_experts_implementation(model, "eager")
    ref_lp, ref_grads = logprobs_and_grads(model, ids)
    assert any(".experts." in n for n in ref_grads) and any(g.abs().max() > 0 for g in ref_grads.values())
    for impl in ("grouped_mm", "batched_mm"):
        assert set_experts_implementation(model, impl) and experts_implementation(model) == impl
        lp, grads = logprobs_and_grads(model, ids)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_picks_grouped_mm_only_on_sm90_in_bf16(monkeypatch):
    assert resolve_experts_implementation("auto", CPU, torch.float32)[0] == "eager"
    assert resolve_experts_implementation("auto", CPU, torch.bfloat16)[0] == "eager"
    assert resolve_experts_implementation("batched_mm", CPU, torch.float32) == ("batched_mm", "set in the config")
    with pytest.raises(ValueError, match="model.experts_implementation='grouped'"):
        resolve_experts_implementation("grouped", CPU, torch.float32)
    # the decision on a GPU of each capability (the device query answered as that GPU would)
    for capability, dtype, expected, why in (((9, 0), torch.bfloat16, "grouped_mm", "SM90"),
                                             ((10, 0), torch.bfloat16, "grouped_mm", "SM90"),
                                             ((8, 0), torch.bfloat16, "eager", "8.0 < 9.0"),
                                             ((9, 0), torch.float32, "eager", "float32"),
                                             ((9, 0), torch.float16, "eager", "float16")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        impl, reason = resolve_experts_implementation("auto", CUDA, dtype)
        assert impl == expected and why in reason, (capability, dtype, reason)


def test_which_experts_a_cuda_graph_can_capture(monkeypatch):
    """batched_mm always, grouped_mm only in bf16 on SM90+ (elsewhere transformers' fallback reads the group offsets
    on the host), eager never (its loop reads the experts hit); a dense model and any model off CUDA need no check."""
    model = moe_model("qwen3_moe")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    expected = {("batched_mm", torch.float32): True, ("grouped_mm", torch.bfloat16): True,
                ("grouped_mm", torch.float32): False, ("eager", torch.bfloat16): False}
    for (impl, dtype), ok in expected.items():
        set_experts_implementation(model.to(dtype), impl)
        capturable, why = graph_capturable(model, CUDA)
        assert capturable == ok and (ok or impl in why), (impl, dtype, why)
        assert graph_capturable(model, CPU) == (True, "")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not graph_capturable(model, CUDA)[0]  # (bf16 grouped_mm below SM90)
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert graph_capturable(dense, CUDA) == (True, "")


def test_a_loaded_model_runs_the_configured_backend(tmp_path):
    """load_model sets the backend on every experts module (transformers' own default is grouped_mm everywhere);
    a dense model has none and is left as it is."""
    model = moe_model("qwen3_moe")
    model.save_pretrained(tmp_path / "moe")
    auto = load_model(ModelConfig(name_or_path=str(tmp_path / "moe"), device="cpu"), CPU)
    assert experts_implementation(auto) == "eager"  # auto on CPU: the model's own loop
    assert auto.model.layers[1].mlp.experts.config._experts_implementation == "eager"
    grouped = load_model(ModelConfig(name_or_path=str(tmp_path / "moe"), device="cpu",
                                     experts_implementation="grouped_mm"), CPU)
    assert experts_implementation(grouped) == "grouped_mm"
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert not set_experts_implementation(dense, "grouped_mm") and experts_implementation(dense) is None


def test_moe_shapes_of_each_family():
    """Expert width: moe_intermediate_size where the config has one (qwen*_moe), else intermediate_size."""
    shapes = {f: moe_shape(make()) for f, make in FAMILIES.items()}
    assert shapes["qwen3_moe"].active_intermediate == 2 * 32
    assert shapes["qwen2_moe"].active_intermediate == 2 * 32 + 64  # the shared expert too
    assert shapes["olmoe"].expert_intermediate == shapes["mixtral"].expert_intermediate == 32
    assert (shapes["gpt_oss"].experts, shapes["gpt_oss"].active) == (4, 2)
    from transformers import LlamaConfig

    assert moe_shape(LlamaConfig()) is None


# --- GPU (H100/H200): `python -m pytest -m gpu tests/test_moe_experts.py` ----------------------------------------


def _gpu_moe(dtype: torch.dtype, impl: str):
    model = moe_model("qwen3_moe").to("cuda", dtype)
    set_experts_implementation(model, impl)
    return model


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


@pytest.mark.gpu
def test_grouped_mm_matches_eager_within_eager_s_own_bf16_error():
    """In bf16 on SM90 grouped_mm (one grouped GEMM per projection) and eager (a loop of per-expert GEMMs) round
    differently; each is held to the fp32 model: grouped_mm's mean error in logprobs and its relative error in every
    gradient may be at most twice eager's bf16 error measured here on the same inputs, plus a floor (a token whose
    expert choice flips on a near-tie in one of them moves its logprob by up to a few tenths of a nat: the means and
    norms over 96 tokens keep one flip within the floor)."""
    if not grouped_mm_runs(CUDA, torch.bfloat16)[0]:
        pytest.skip(grouped_mm_runs(CUDA, torch.bfloat16)[1])
    ids = torch.randint(0, 256, (4, 30), generator=torch.Generator().manual_seed(0)).cuda()
    ref_lp, ref_grads = logprobs_and_grads(_gpu_moe(torch.float32, "eager").train(), ids)
    eager_lp, eager_grads = logprobs_and_grads(_gpu_moe(torch.bfloat16, "eager").train(), ids)
    grouped_lp, grouped_grads = logprobs_and_grads(_gpu_moe(torch.bfloat16, "grouped_mm").train(), ids)
    eager_err = float((eager_lp - ref_lp).abs().mean())
    assert eager_err > 0  # (bf16 rounds: the bound below is not vacuous)
    assert float((grouped_lp - ref_lp).abs().mean()) <= 2 * eager_err + 5e-3
    assert ref_grads.keys() == eager_grads.keys() == grouped_grads.keys()
    assert any(".experts." in name for name in ref_grads)
    for name, ref in ref_grads.items():
        bound = 2 * _relative(eager_grads[name], ref) + 2e-2
        assert _relative(grouped_grads[name], ref) <= bound, name


def _sampler_against_trainer(eng, model, samples: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(|sampler logp - trainer logp| over the completion tokens, the sampler's logprobs [B, T]) of two prompts
    decoded by `eng` on the GPU; an uncaptured decode step's warning is an error here."""
    from logitless.rollout import SamplingOptions

    opts = SamplingOptions(num_generations=samples, temperature=1.0, max_new_tokens=new_tokens, seed=3,
                           ignore_eos=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not be captured.*")
        b = eng.generate(["The quick brown fox", "2+2 is"], opts).to("cuda")
    with torch.no_grad():
        lp = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)[0]
    return (b.sampler_logp.float() - lp.float()).abs()[b.completion_mask.bool()], b.sampler_logp


@pytest.mark.gpu
def test_static_engine_captures_its_decode_step_over_grouped_mm_experts(one_thread):
    """The static engine's compiled decode step with grouped_mm experts is captured as one CUDA graph (a host sync
    in the experts would fail the capture and warn) and samples what the trainer computes in bf16."""
    if not grouped_mm_runs(CUDA, torch.bfloat16)[0]:
        pytest.skip(grouped_mm_runs(CUDA, torch.bfloat16)[1])
    from logitless.rollout import make_engine
    from tests.test_rollout_families import TOK

    model = _gpu_moe(torch.bfloat16, resolve_experts_implementation("auto", CUDA, torch.bfloat16)[0]).eval()
    assert experts_implementation(model) == "grouped_mm"
    eng = make_engine("static", model, TOK)
    assert eng._graph_step(CUDA, [])
    diff, sampled = _sampler_against_trainer(eng, model, samples=4, new_tokens=24)
    assert float(diff.mean()) < 0.05 and bool(torch.isfinite(sampled).all())


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_experts_that_sync_with_the_host_decode_without_cuda_graphs(impl, one_thread):
    """fp32 experts that sync with the host (eager's loop; grouped_mm's fallback outside bf16) cannot be captured:
    the static engine says so once, decodes compiled without CUDA graphs and samples what the trainer computes;
    rollout.step_graph=true is refused naming the fix."""
    from logitless.rollout import make_engine
    from tests.test_rollout_families import TOK

    model = _gpu_moe(torch.float32, impl).eval()
    with pytest.raises(ValueError, match="rollout.step_graph=true.*experts_implementation=batched_mm"):
        make_engine("static", model, TOK, step_graph=True)
    with pytest.warns(UserWarning, match="without CUDA graphs.*" + impl):
        eng = make_engine("static", model, TOK)
    assert not eng._graph_step(CUDA, [])
    diff, _ = _sampler_against_trainer(eng, model, samples=2, new_tokens=12)
    assert float(diff.max()) < 1e-3  # fp32: the same function to summation order (a flip of expert would show)
