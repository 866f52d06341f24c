"""The step accounting (trainer/report/accounting.py): FLOPs against torch's own FLOP counter on real forward/backward
passes, the decode-ceiling bytes against a step-by-step count, and the phase timer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers as tf
from torch.utils.flop_counter import FlopCounterMode

from logitless.models import completion_logprobs
from logitless.trainer.report.accounting import ModelShape, PhaseTimer, decode_ideal_seconds, device_peaks, update_flops

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
ROWS = [(5, 7), (3, 9)]  # (prompt, completion) lengths


def tied_qwen2():
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=True))


def untied_llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, tie_word_embeddings=False))


def lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.enable_input_require_grads()  # as under gradient checkpointing: every layer's input gradient is formed
    return model


def counted_flops(model) -> dict[str, int]:
    """torch's FLOP count of one forward + backward of completion_logprobs over ROWS, by op."""
    torch.manual_seed(0)
    model.config._attn_implementation = "eager"  # attention as plain batched matmuls, which the counter sees
    total: dict[str, int] = {}
    for p, t in ROWS:
        pid, cid = torch.randint(0, 300, (1, p)), torch.randint(0, 300, (1, t))
        with FlopCounterMode(display=False) as fc:
            lp, _ = completion_logprobs(model, pid, torch.ones_like(pid), cid, torch.ones_like(cid))
            lp.sum().backward()
        for op, n in fc.get_flop_counts()["Global"].items():
            total[str(op)] = total.get(str(op), 0) + n
    return total


@pytest.mark.parametrize("make", [tied_qwen2, untied_llama, lambda: lora(tied_qwen2()), lambda: lora(untied_llama())],
                         ids=["full_tied", "full_untied", "lora_tied", "lora_untied"])
def test_update_flops_match_torch_flop_counter(make, one_thread):
    torch.manual_seed(0)
    model = make()
    shape = ModelShape.of(model)
    counted = counted_flops(model)
    linear = counted.get("aten.mm", 0) + counted.get("aten.addmm", 0)
    assert update_flops(dataclasses.replace(shape, d_attn=0), ROWS) == linear
    # attention: eager computes the full L x L square, the accounting the causal half (L (L + 1) / 2 per layer)
    attention = update_flops(shape, ROWS) - linear
    square = sum(3 * 4 * shape.layers * shape.d_attn * (p + t) ** 2 for p, t in ROWS)
    assert attention == pytest.approx(square * sum((p + t) * (p + t + 1) / 2 for p, t in ROWS)
                                      / sum((p + t) ** 2 for p, t in ROWS), rel=1e-12)
    assert counted["aten.bmm"] == pytest.approx(square, rel=0.01)


def test_model_shape_counts_each_weight_once():
    full, untied = tied_qwen2(), untied_llama()
    s = ModelShape.of(full)
    assert s.decode_weight_bytes == 2 * sum(p.numel() for p in full.parameters())  # tied embedding listed once
    assert s.head_params == s.head_trainable == 300 * 64 and s.lora_params == 0
    u = ModelShape.of(untied)
    emb = untied.get_input_embeddings().weight.numel()
    assert u.decode_weight_bytes == 2 * (sum(p.numel() for p in untied.parameters()) - emb)  # a lookup reads B rows
    assert u.kv_bytes_per_token == 2 * 2 * 2 * (64 // 4) * 2  # layers * (K, V) * kv heads * head_dim * bf16
    peft = ModelShape.of(lora(tied_qwen2()))
    assert peft.body_trainable == peft.head_trainable == 0 and peft.lora_params > 0
    assert peft.decode_weight_bytes == s.decode_weight_bytes  # adapters are not what an ideal decode reads


def brute_force_decode_bytes(shape: ModelShape, prompts: list[int], completions: list[int]) -> float:
    per_layer = shape.kv_bytes_per_token / shape.layers
    total = 0.0
    for s in range(max(completions)):
        for p, t in zip(prompts, completions):
            if s < t:
                ctx = p + s
                total += (shape.layers - shape.sliding_layers) * per_layer * ctx
                total += shape.sliding_layers * per_layer * min(ctx, shape.sliding_window or ctx)
        total += shape.decode_weight_bytes
    return total


@pytest.mark.parametrize("config, sliding", [
    (tf.Qwen2Config(**COMMON), 0),
    (tf.MistralConfig(**COMMON, sliding_window=6), 2),
    (tf.Gemma2Config(**COMMON, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]), 1),
], ids=["full", "all_sliding", "alternating"])
def test_decode_ideal_seconds_equals_step_by_step_count(config, sliding):
    with torch.device("meta"):
        shape = ModelShape.of(tf.AutoModelForCausalLM.from_config(config))
    prompts, completions = [3, 9, 4, 1], [10, 2, 0, 7]
    assert shape.sliding_layers == sliding
    bw = 1e9
    assert decode_ideal_seconds(shape, prompts, completions, bw) == pytest.approx(
        brute_force_decode_bytes(shape, prompts, completions) / bw, rel=1e-12)
    assert math.isnan(decode_ideal_seconds(shape, prompts, completions, math.nan))


def test_device_peaks_cpu_and_overrides():
    cpu = torch.device("cpu")
    assert all(math.isnan(x) for x in device_peaks(cpu))
    assert device_peaks(cpu, peak_tflops=100, hbm_tbs=2) == (100e12, 2e12)


def test_phase_timer_accumulates_and_reports_each_phase():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        with timer("a"):
            x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
            x += 1
    with timer("b"):
        pass
    m = timer.metrics()
    assert set(m) == {"time/a", "time/b", "memory/peak_gb/a", "memory/peak_gb/b", "memory/peak_gb"}
    assert m["time/a"] > m["time/b"] >= 0
    assert m["memory/peak_gb/a"] >= 64 / 1024 and m["memory/peak_gb"] == max(m["memory/peak_gb/a"], m["memory/peak_gb/b"])


def test_ceiling_fraction_is_measured_against_the_rollouts_own_time():
    """With train.async_rollout the generate phase is only the wait for a rollout run beside the update: the
    ceiling fraction divides by the rollout call's own seconds, whatever the phase clock says."""
    from types import SimpleNamespace

    from logitless.trainer.records import efficiency_metrics

    shape = ModelShape.of(tied_qwen2())
    mask = torch.ones(2, 6, dtype=torch.long)
    batch = SimpleNamespace(prompt_mask=mask, completion_mask=mask[:, :4], timing=SimpleNamespace(seconds=2.0))
    ctx = SimpleNamespace(peaks=(1e12, 1e9), shape=shape, device=torch.device("cpu"), world=SimpleNamespace(size=1),
                          rollout=SimpleNamespace(shared=False),
                          cfg=SimpleNamespace(train=SimpleNamespace(num_iterations=1)))
    plan = SimpleNamespace(trained=torch.arange(2))
    for waited in (0.01, 2.0, 7.0):
        timer = SimpleNamespace(seconds={"generate": waited, "train": 1.0})
        out = efficiency_metrics(ctx, SimpleNamespace(batch=batch), plan, timer)
        assert out["rollout/ceiling_fraction"] == pytest.approx(decode_ideal_seconds(shape, [6, 6], [4, 4], 1e9) / 2.0)
        limit = decode_ideal_seconds(shape, [6, 6], [4, 4], 1e9) + update_flops(shape, [(6, 4), (6, 4)]) / 1e12
        assert out["step/limit_s"] == pytest.approx(limit)  # decode at the bandwidth + the update at peak FLOP/s
        assert out["step/x_limit"] == pytest.approx((waited + 1.0) / limit)  # the step's phases over it


def test_decode_bytes_are_those_of_the_module_the_engine_decodes_with():
    """A QLoRA model whose rollout decodes from a merged bf16 copy reads bf16 weights, not its packed 4-bit ones."""
    from types import SimpleNamespace

    from logitless.trainer.context import _shape

    plain = tied_qwen2().to(torch.bfloat16)
    quantized = tied_qwen2().to(torch.bfloat16)
    proj = quantized.model.layers[0].mlp.up_proj
    packed = torch.nn.Parameter(torch.zeros(proj.weight.numel() // 4, 1, dtype=torch.bfloat16), requires_grad=False)
    packed.quant_state = SimpleNamespace(shape=proj.weight.shape)
    proj.weight = packed
    own = ModelShape.of(quantized)
    assert own.decode_weight_bytes < ModelShape.of(plain).decode_weight_bytes
    merged = _shape(quantized, plain)
    assert merged == dataclasses.replace(own, decode_weight_bytes=ModelShape.of(plain).decode_weight_bytes)
    assert _shape(quantized, quantized) == own  # quantized decode
    assert _shape(quantized, None) == own  # an engine that does not say


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_update_flops_of_a_mixture_of_experts_count_the_k_experts_each_token_runs(tuning, one_thread):
    """A tiny qwen3_moe (8 experts, 2 per token) on its eager experts (one GEMM per expert hit, which the counter
    sees): the accounting's linear FLOPs (k / E of the expert stacks, the router, attention) are torch's count."""
    import transformers as tf

    from logitless.models.experts import set_experts_implementation
    from tests.test_moe_lora import FAMILIES

    torch.manual_seed(0)
    config = FAMILIES["qwen3_moe"]()
    config.vocab_size = 320  # (the rows' ids go up to 300)
    model = tf.AutoModelForCausalLM.from_config(config)
    set_experts_implementation(model, "eager")
    if tuning == "lora":  # (logitless's all-linear: attention only, the experts and router frozen)
        from logitless.trainer.config.schema import ModelConfig
        from logitless.trainer.policy.lora_targets import add_lora

        model = add_lora(model, ModelConfig(lora_r=4, lora_alpha=8))
        model.enable_input_require_grads()
    shape = ModelShape.of(model)
    counted = counted_flops(model)
    linear = counted.get("aten.mm", 0) + counted.get("aten.addmm", 0)
    assert update_flops(dataclasses.replace(shape, d_attn=0), ROWS) == linear
