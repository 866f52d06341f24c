"""4-bit (NF4) expert stacks for QLoRA on mixtures of experts (`logitless/models/nf4_experts.py`).

The oracle is the same model whose expert stacks hold their dequantized values as plain parameters: bitsandbytes'
own `dequantize_4bit` of the stored stacks. A 4-bit experts module must compute exactly what that model computes
(fp32 on CPU, forward and gradients), with routing replay on, under each experts implementation."""

from __future__ import annotations

import copy

import pytest
import torch

from logitless.models.experts import EXPERT_PARAMS, expert_modules, graph_capturable, set_experts_implementation
from tests.test_routing_replay import logprobs, make_model, sample

bnb = pytest.importorskip("bitsandbytes")

from logitless.models.nf4_experts import (  # noqa: E402
    Nf4Options,
    dequantize_experts,
    dequantized,
    is_quantized,
    nf4_bytes,
    quantize_experts,
)

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss")
OPTIONS = Nf4Options(quant_type="nf4", blocksize=64, double_quant=True)


def quantized_and_reference(family: str, options: Nf4Options = OPTIONS, device: str = "cpu",
                            dtype: torch.dtype = torch.float32):
    """(a model with 4-bit experts, the same model with its expert stacks replaced by their dequantized values), in
    `dtype` on `device` (quantized there, as loading does)."""
    model = make_model(family).to(device, dtype)
    reference = copy.deepcopy(model)
    assert quantize_experts(model, options) == len(expert_modules(reference))
    with torch.no_grad():
        for (_, q), (_, r) in zip(expert_modules(model), expert_modules(reference)):
            for name in q._nf4_stacks:
                getattr(r, name).copy_(dequantized(q, name))
    return model, reference


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_experts_forward_equals_the_dequantized_model_with_replay(family, one_thread):
    model, reference = quantized_and_reference(family)
    modules = expert_modules(model)
    assert modules and all(is_quantized(m) for _, m in modules)
    assert not any(n in dict(m.named_parameters(recurse=False)) for _, m in modules for n in EXPERT_PARAMS)
    b = sample("hf", model)  # the routes the 4-bit model chose while sampling
    assert b.prompt_routes is not None
    for impl in ("eager", "grouped_mm", "batched_mm"):
        set_experts_implementation(model, impl), set_experts_implementation(reference, impl)
        for replay in (True, None):
            got, want = logprobs(model, b, replay), logprobs(reference, b, replay)
            assert torch.equal(got, want), (impl, replay, float((got - want).abs().max()))
    # the check can fail: the experts in full precision (before quantization) compute something else
    set_experts_implementation(model, "eager")
    full = make_model(family)
    assert not torch.equal(logprobs(full, b, True), logprobs(model, b, True))


def test_the_stacks_are_stored_in_about_half_a_byte_each_and_dequantize_back(one_thread):
    model, reference = quantized_and_reference("qwen3_moe")
    _, module = expert_modules(model)[0]
    _, ref = expert_modules(reference)[0]
    for name in EXPERT_PARAMS:
        numel = getattr(ref, name).numel()
        stored = sum(b.numel() * b.element_size() for n, b in module.named_buffers(recurse=False)
                     if n.startswith(name + "_"))
        codes = 4 * (16 + 256 + 1)  # the 4-bit and the 8-bit code books (fp32) and the scales' offset
        assert stored == nf4_bytes(numel, OPTIONS) + codes, (stored, numel)
        assert dequantized(module, name).dtype == torch.float32 and dequantized(module, name).shape == getattr(ref, name).shape
    assert graph_capturable(model, torch.device("cpu"))[0]
    assert dequantize_experts(model) == len(expert_modules(reference))
    for (_, m), (_, r) in zip(expert_modules(model), expert_modules(reference)):
        assert not is_quantized(m) and type(m) is type(r)
        for name in EXPERT_PARAMS:
            assert torch.equal(getattr(m, name), getattr(r, name)) and not getattr(m, name).requires_grad


def test_options_follow_the_linear_layers_settings(one_thread):
    """Single quantization and another block size store other bytes and other values; the oracle still holds."""
    plain = Nf4Options(quant_type="nf4", blocksize=128, double_quant=False)
    model, reference = quantized_and_reference("olmoe", plain)
    b = sample("hf", model)
    assert torch.equal(logprobs(model, b, True), logprobs(reference, b, True))
    _, module = expert_modules(model)[0]
    assert module.gate_up_proj_absmax.dtype == torch.float32 and not hasattr(module, "gate_up_proj_nested_absmax")
    other, _ = quantized_and_reference("olmoe")
    assert not torch.equal(dequantized(module, "gate_up_proj"), dequantized(expert_modules(other)[0][1], "gate_up_proj"))


def test_lora_on_attention_trains_with_the_dequantized_models_gradients_and_no_stack_waits_for_backward(one_thread):
    """LoRA on the linear layers of a 4-bit-experts model: the adapters' gradients (routing replay on) are the
    dequantized model's, and no tensor of a stack's size is kept for the backward (the experts run checkpointed)."""
    from logitless.trainer.policy.modeling import prepare_for_training
    from tests.test_moe_lora import lora_cfg

    model, reference = quantized_and_reference("qwen3_moe")
    b = sample("hf", model)
    stack = expert_modules(reference)[0][1].gate_up_proj.numel()
    grads = []
    for m in (model, reference, make_model("qwen3_moe")):  # the last: full-precision experts (the check can fail)
        set_experts_implementation(m, "grouped_mm")
        torch.manual_seed(1)
        peft = prepare_for_training(m, lora_cfg(False)).train()
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(n) % 2**31))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            logp = logprobs(peft, b, True)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        grads.append({n: p.grad for n, p in peft.named_parameters() if p.requires_grad})
        if m is model:
            assert max(saved) < stack, (max(saved), stack)
    assert grads[0].keys() == grads[1].keys() and all(g.abs().max() > 0 for g in grads[0].values())
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5)
    assert any((grads[0][n] - grads[2][n]).abs().max() > 1e-4 for n in grads[0])


def test_lora_on_4bit_expert_stacks_is_refused_naming_the_option():
    from logitless.trainer.config.schema import ModelConfig

    with pytest.raises(ValueError, match=r"model\.lora_target_experts=true .*model\.load_in_4bit=true .*set "
                                         r"model\.lora_target_experts=false"):
        ModelConfig(load_in_4bit=True, lora_target_experts=True, lora_dropout=0.0)


def test_the_merged_rollout_copy_shares_the_4bit_experts(one_thread):
    """The rollout's merged LoRA copy holds what the policy holds: the same 4-bit buffers (no copy of the experts),
    and decodes what the unmerged policy computes (B = 0 here, so the merged copy is the base)."""
    from logitless.rollout.weights import MergedLoraWeights, lora_layers
    from logitless.trainer.policy.modeling import prepare_for_training
    from tests.test_moe_lora import lora_cfg

    model, _ = quantized_and_reference("olmoe")
    peft = prepare_for_training(model, lora_cfg(False))
    weights = MergedLoraWeights(peft, "resident")
    ours, theirs = expert_modules(weights.module), expert_modules(model)
    assert len(ours) == len(theirs) and all(is_quantized(m) for _, m in ours)
    for (_, a), (_, b) in zip(ours, theirs):
        assert a is not b and a.gate_up_proj_packed is b.gate_up_proj_packed
    adapted = lora_layers(peft)
    assert adapted and not any(".experts" in n for n, _ in adapted)
    assert weights.extra_bytes == sum(4 * layer.get_base_layer().weight.numel() for _, layer in adapted)
    b = sample("hf", peft)
    assert torch.equal(logprobs(weights.module, b, True), logprobs(peft, b, True))


def qlora_moe_run(root, tok, *overrides):
    """A 2-step `logitless train` of a tiny Qwen3-MoE loaded from a folder with model.load_in_4bit (fp32 compute on
    CPU): NF4 linear layers (bitsandbytes) and NF4 expert stacks, LoRA on the linear layers, routing replay on."""
    from logitless.trainer.config.schema import load_train_config
    from logitless.trainer.loop import train
    import transformers as tf

    from tests.test_routing_replay import COMMON
    from tests.conftest import TINY_LORA_QUIET

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(**{**COMMON, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                                  "eos_token_id": tok.eos_token_id, "max_position_embeddings": 512},
                               head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                               num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    cfg = load_train_config(None, [
        f"model.name_or_path={root / 'base'}", "model.load_in_4bit=true", "model.dtype=float32", "model.device=cpu",
        f"train.output_dir={root / 'run'}", "train.max_steps=2", "train.prompts_per_step=2",
        "train.micro_batch_size=2", "rollout.num_generations=2", "rollout.max_completion_length=6",
        "rollout.backend=static", "data.options={difficulty: 1, n: 20, chat: false}", "optim.learning_rate=0.05",
        "reward.reward_funcs=[length_target]", "reward.reward_options={length_target: {target: 30}}",
        "train.num_iterations=2", "checkpoint.save_steps=1", "train.skip_zero_advantage=false", *TINY_LORA_QUIET,
        *overrides])
    return train(cfg).records


def test_4bit_linear_layers_keep_one_cpu_path_in_eval_without_grad(one_thread):
    """bitsandbytes runs a 4-bit layer in eval mode without gradients through another CPU kernel where the CPU has
    AVX512-BF16 (repacking the weight in place, other roundings): after `one_cpu_4bit_path` (which
    `prepare_for_training` applies to 4-bit models) such a call computes what the training path computes, on any
    CPU. Here every layer claims that CPU, so without the function the test fails on one (and crashes elsewhere)."""
    from logitless.trainer.policy.modeling import one_cpu_4bit_path

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 96, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(96, 64), requires_grad=False, quant_type="nf4").to("cpu")
    packed = layer.weight.data.clone()
    layer.support_avx512bf16_for_cpu = True
    one_cpu_4bit_path(torch.nn.Sequential(layer))
    x = torch.randn(5, 64)
    trained = layer(x.requires_grad_()).detach()
    layer.eval()
    with torch.no_grad():
        evaluated = layer(x.detach())
    assert torch.equal(evaluated, trained) and torch.equal(layer.weight.data, packed)


def test_qlora_moe_trains_on_cpu_with_sampler_equal_to_trainer_and_resumes_and_exports(tmp_path, gpt2_tokenizer,
                                                                                       one_thread):
    """`logitless train` with model.load_in_4bit on a tiny Qwen3-MoE folder, 2 steps on the static engine (its
    merged LoRA copy shares the 4-bit experts): the sampler's logprobs are the trainer's (fp32), every route is
    replayed, the adapters learn; a resume from step 1 makes step 2 again; the merged export saves the expert stacks
    dequantized (the values the run computed with) and the adapter export is the checkpoint's adapter."""
    from safetensors.torch import load_file

    from logitless.trainer import checkpoint as ckpt
    from logitless.trainer.config.schema import load_train_config
    from logitless.trainer.export import export_run, load_policy
    from logitless.trainer.loop import train

    tok = copy.deepcopy(gpt2_tokenizer)
    tok.pad_token = tok.eos_token
    records = qlora_moe_run(tmp_path, tok)
    assert len(records) == 2 and all(r["rollout/route_disagreement"] == 0.0 for r in records)
    assert all(r["rollout/mismatch_max"] < 1e-5 for r in records), [r["rollout/mismatch_max"] for r in records]
    assert all(r["grad_norm"] > 0 for r in records)

    run = tmp_path / "run"
    step1 = ckpt.resolve_checkpoint(run).parent / "step-000001"
    cfg = load_train_config(step1 / "config.yaml")
    policy, _ = load_policy(cfg, step1)
    modules = expert_modules(policy)
    assert modules and all(is_quantized(m) for _, m in modules)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules())

    resumed = train(cfg, resume=step1)
    assert resumed.records[-1]["loss"] == pytest.approx(records[-1]["loss"], rel=1e-5, abs=1e-7)

    out = export_run(run, output=tmp_path / "export", merged=True)
    assert (out.adapter / "adapter_model.safetensors").is_file()
    saved = {}
    for f in out.merged.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    final, _ = load_policy(cfg, ckpt.resolve_checkpoint(run))
    for name, module in expert_modules(final):  # saved as the hub's per-expert layout: gate, up and down of each
        prefix = name.removeprefix("base_model.model.")
        gate_up, down = dequantized(module, "gate_up_proj"), dequantized(module, "down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = (saved[f"{prefix}.{e}.{p}_proj.weight"] for p in ("gate", "up"))
            assert torch.equal(torch.cat([gate, up]), gate_up[e])
            assert torch.equal(saved[f"{prefix}.{e}.down_proj.weight"], down[e])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_4bit_experts_forward_equals_the_dequantized_model_bf16_grouped_mm_gpu(family):
    """On CUDA in bf16 with transformers' grouped_mm experts (the backend `auto` picks on SM90): the 4-bit model's
    logprobs (routing replay on) and input gradients are the dequantized model's, bit for bit (the same kernels on
    the same weights); the experts in bf16 before quantization differ."""
    model, reference = quantized_and_reference(family, device="cuda", dtype=torch.bfloat16)
    for m in (model, reference):
        set_experts_implementation(m, "grouped_mm")
    assert all(dequantized(mod, "down_proj").dtype == torch.bfloat16 for _, mod in expert_modules(model))
    b = sample("hf", model).to("cuda")  # (the engine hands its batch back on the host)
    assert torch.equal(logprobs(model, b, True), logprobs(reference, b, True))
    grads = []
    for m in (model, reference):
        emb = m.get_input_embeddings()
        emb.weight.requires_grad_(True)
        logprobs(m, b, True).float().sum().backward()
        grads.append(emb.weight.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 0
