"""The memory plan of a mixture of experts: every expert's weights held (weights, merged copy, adapters), the
activations at the active width (k experts per token), expert stacks 4-bit under QLoRA, the tiled MLP off with its
reason, and `logitless train CONFIG --dry-run` printing the plan of a MoE config folder."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from logitless.models.experts import expert_modules
from logitless.rollout.weights import MergedLoraWeights
from logitless.trainer.memory import auto
from logitless.trainer.memory import plan as mp
from logitless.trainer.memory.model import model_memory, moe_summary
from logitless.trainer.policy.modeling import prepare_for_training
from tests.test_moe_lora import FAMILIES, lora_cfg, moe_model


def _stacks(model) -> list[torch.Tensor]:
    return [p for _, m in expert_modules(model) for p in m.parameters(recurse=False)]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_all_experts_are_held_and_activations_use_the_active_width(family):
    model = moe_model(family)
    mem = model_memory(model, lora_cfg(False), torch.float32)
    params = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in _stacks(model))
    E = 8 if family == "qwen3_moe" else 4
    assert mem.params == params and mem.weight_bytes == 4 * params  # every expert's weights, fp32
    assert mem.expert_bytes == 4 * expert and 0 < mem.expert_bytes < mem.weight_bytes
    assert mem.active_params == params - expert + expert * 2 // E  # k = 2 of E experts per token
    assert mem.intermediate == 2 * 32  # activations: k experts of width 32, not E
    assert "mixture of experts" in moe_summary(mem)
    assert moe_summary(dataclasses.replace(mem, expert_bytes=0)) is None


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_expert_adapters_and_their_merged_stacks_are_counted_as_peft_and_the_copy_hold_them(family, one_thread):
    """Counted before peft adds them (from the config), the same read from the peft model after, and the merged
    decode copy's bytes are what MergedLoraWeights allocates (every expert's stack of each adapted layer)."""
    model = moe_model(family)
    cfg = lora_cfg(True)
    before = model_memory(model, cfg, torch.float32)
    without = model_memory(model, lora_cfg(False), torch.float32)
    peft = prepare_for_training(model, cfg)
    assert before.trainable == sum(p.numel() for p in peft.parameters() if p.requires_grad) > without.trainable
    assert model_memory(peft, cfg, torch.float32) == before
    assert before.merge_copy_bytes == MergedLoraWeights(peft, "resident").extra_bytes
    assert before.merge_copy_bytes - without.merge_copy_bytes == 4 * sum(p.numel() for p in _stacks(model)
                                                                         if p.dim() == 3)


def test_qlora_counts_the_expert_stacks_at_4_bit_and_one_layer_dequantized():
    """Under model.load_in_4bit the plan counts the linear layers and the expert stacks at NF4's 0.5 byte per
    parameter plus scales (routers and norms stay bf16), one MoE layer's stacks dequantized in bf16 in every phase,
    and a loaded 4-bit model (stacks as 4-bit buffers) as its skeleton."""
    pytest.importorskip("bitsandbytes")
    from logitless.models.nf4_experts import Nf4Options, quantize_experts

    with torch.device("meta"):
        skeleton = moe_model("qwen3_moe").to(torch.bfloat16)
    cfg = lora_cfg(False)
    bf16 = model_memory(skeleton, cfg, torch.bfloat16)
    q4cfg = dataclasses.replace(cfg, load_in_4bit=True, dtype="bfloat16")
    q4 = model_memory(skeleton, q4cfg, torch.bfloat16)
    linear = sum(m.weight.numel() for n, m in skeleton.named_modules()
                 if isinstance(m, torch.nn.Linear) and m is not skeleton.get_output_embeddings())
    stacks = sum(p.numel() for p in _stacks(skeleton))
    assert bf16.expert_bytes == 2 * stacks and q4.expert_bytes == pytest.approx(stacks * mp.NF4_BYTES, abs=8)
    assert q4.weight_bytes == pytest.approx(bf16.weight_bytes - (linear + stacks) * (2 - mp.NF4_BYTES), abs=16)
    assert q4.dequantized_expert_bytes == 2 * stacks // 2 and bf16.dequantized_expert_bytes == 0  # 2 MoE layers
    assert q4.params == bf16.params and q4.active_params == bf16.active_params
    assert "4-bit, one MoE layer's dequantized at a time" in moe_summary(q4)
    assert mp.resident_bytes(q4, mp.RunFacts())["dequantized experts"] == q4.dequantized_expert_bytes

    loaded = moe_model("qwen3_moe").to(torch.bfloat16)
    quantize_experts(loaded, Nf4Options())
    assert model_memory(loaded, q4cfg, torch.bfloat16) == q4


def test_dry_run_prints_the_plan_of_a_moe_config_folder(tmp_path, capsys, monkeypatch):
    """`logitless train CONFIG --dry-run` on a folder holding only a qwen3_moe config.json: the settings (the experts
    backend, the tiled MLP off because the layers are experts) and the plan, whose weights count every expert."""
    from logitless.cli import main

    FAMILIES["qwen3_moe"]().save_pretrained(tmp_path / "moe")
    config = {"model": {"name_or_path": str(tmp_path / "moe"), "device": "cpu", "lora_target_experts": True},
              "train": {"memory_budget_gib": 8}, "rollout": {"max_completion_length": 64},
              "data": {"options": {"chat": False}}}  # (the folder's tokenizer has no chat template)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("COLUMNS", "300")  # (rich: table cells whole on one line)
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    err = " ".join(capsys.readouterr().err.split())  # (rich folds long lines)
    assert "memory plan: predicted peak per phase (GiB), budget 8.0" in err
    assert "model.experts_implementation" in err and "cpu: the model's own loop" in err
    assert "mixture of experts: its MoE layers route each token to experts" in err  # model.mlp_chunk_tokens
    c = FAMILIES["qwen3_moe"]()
    per_layer = c.num_experts * (2 * c.moe_intermediate_size * c.hidden_size + c.hidden_size * c.moe_intermediate_size)
    assert f"the expert stacks are {4 * c.num_hidden_layers * per_layer / 2**20:.2f} MiB of the" in err
    assert "to 4 expert stacks (experts.down_proj, experts.gate_up_proj), an adapter per expert" in err  # preflight

    from logitless.trainer.config.schema import load_train_config

    res = auto.resolve(load_train_config(tmp_path / "run.yaml"), device=torch.device("cpu"))
    assert res.model.expert_bytes == 4 * c.num_hidden_layers * per_layer  # fp32 on CPU, every expert
    assert res.cfg.model.experts_implementation == "eager" and res.cfg.model.mlp_chunk_tokens is None
    assert res.plan.phases["train"]["weights"] == res.model.weight_bytes >= res.model.expert_bytes
