"""Settings left "auto" (trainer/memory/auto.py): what each becomes on CPU and on CUDA, from the model's config alone."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bench import bench_plan
from logitless.trainer.memory import auto
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.demo import demo_config

CUDA = torch.device("cuda")


def _cfg(*over: str):
    return load_train_config(None, ["rollout.max_completion_length=1024", "train.prompts_per_step=16", *over])


def _choices(res) -> dict:
    return {c.key: (c.value, c.auto) for c in res.choices}


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def test_cpu_demo_keeps_its_settings():
    """The CPU demo: transformers generate, padded row micro-batches, nothing compiled, no plan (no weights read)."""
    res = auto.resolve(demo_config(), device=torch.device("cpu"))
    c = res.cfg
    assert (c.rollout.backend, c.train.packed, c.train.micro_batch_tokens) == ("hf", False, None)
    assert (c.model.compile_layers, c.model.liger_kernels, c.model.gradient_checkpointing) == (False, False, False)
    assert (c.model.activation_offload, c.train.offload_during_rollout, c.rollout.max_kv_gib) == (False, False, None)
    assert res.plan is None and all(auto for _, auto in _choices(res).values())


def test_cuda_picks_the_fast_exact_path_for_a_supported_family():
    res = auto.resolve(_cfg("train.max_steps=500", "train.memory_budget_gib=24"), device=CUDA,
                       skeleton=bench_plan.skeleton("1.5b"))
    c = res.cfg
    assert c.rollout.backend == "static" and c.train.packed and c.model.compile_layers is True
    assert c.model.liger_kernels is False  # compiled layers run the model's own code
    assert c.model.gradient_checkpointing is True and c.train.micro_batch_tokens == 32768  # the plan, 24 GiB
    assert c.rollout.max_kv_gib is not None and res.plan.fits
    why = dict((c.key, c.reason) for c in res.choices)
    assert "layout" in why["rollout.backend"] and "500" not in why["model.compile_layers"]
    assert why["train.memory_budget_gib"] == "set in the config"


def test_short_runs_are_not_compiled_and_liger_takes_over_where_installed():
    pytest.importorskip("liger_kernel")
    res = auto.resolve(_cfg("train.max_steps=20"), device=CUDA, skeleton=bench_plan.skeleton("1.5b"),
                       free_gib=80.0)
    assert res.cfg.model.compile_layers is False and "too short" in _reason(res, "model.compile_layers")
    assert res.cfg.model.liger_kernels is True


def test_liger_under_torchrun_only_with_a_replica_per_gpu_and_not_with_host_offload():
    """Under torchrun Liger's kernels run in the sharded update where installed; never with a split rollout (its
    replica would run them) or train.fsdp_offload (untested), whether installed or not."""
    skel = bench_plan.skeleton("1.5b")
    for over, why in ((["rollout.backend=static", "rollout.tensor_parallel=2"], "rollout.tensor_parallel"),
                      (["train.fsdp_offload=true"], "train.fsdp_offload")):
        res = auto.resolve(_cfg("train.max_steps=20", *over), world_size=2, device=CUDA, skeleton=skel, free_gib=80.0)
        assert res.cfg.model.liger_kernels is False and why in _reason(res, "model.liger_kernels")
    # the per-GPU memory model counts Liger's smaller recompute (fewer fp32 temporaries) when they are set
    recompute = {on: auto.resolve(_cfg("train.max_steps=20", "model.gradient_checkpointing=true",
                                       f"model.liger_kernels={on}"), world_size=4, device=CUDA, skeleton=skel,
                                  free_gib=80.0).rank_memory.phases["train"]["recompute"] for on in ("true", "false")}
    assert recompute["true"] < 0.9 * recompute["false"]
    pytest.importorskip("liger_kernel")
    res = auto.resolve(_cfg("train.max_steps=20"), world_size=4, device=CUDA, skeleton=skel, free_gib=80.0)
    assert res.cfg.model.liger_kernels is True and "FSDP2" in _reason(res, "model.liger_kernels")


def _reason(res, key):
    return next(c.reason for c in res.choices if c.key == key)


def test_settings_given_are_kept():
    over = ["rollout.backend=hf", "train.packed=false", "model.compile_layers=false", "model.liger_kernels=false",
            "model.gradient_checkpointing=false", "train.micro_batch_tokens=null", "train.memory_budget_gib=24"]
    res = auto.resolve(_cfg(*over), device=CUDA, skeleton=bench_plan.skeleton("1.5b"))
    c = res.cfg
    assert (c.rollout.backend, c.train.packed, c.model.compile_layers, c.model.liger_kernels) == ("hf", False, False, False)
    assert c.model.gradient_checkpointing is False and c.train.micro_batch_tokens is None
    assert c.rollout.max_kv_gib is None  # hf: no KV cap
    choices = _choices(res)
    assert all(not choices[k.split("=")[0]][1] for k in over if not k.startswith("train.memory"))


def test_activation_offload_turns_checkpointing_on():
    res = auto.resolve(_cfg("model.activation_offload=true"), device=torch.device("cpu"))
    assert res.cfg.model.gradient_checkpointing is True


def test_a_static_only_option_means_static_even_on_cpu():
    res = auto.resolve(_cfg("rollout.max_kv_gib=2"), device=torch.device("cpu"))
    assert res.cfg.rollout.backend == "static" and "rollout.max_kv_gib" in _reason(res, "rollout.backend")


def test_layouts_the_static_engine_refuses_go_to_hf_and_windows_are_not_packed():
    from transformers import MistralConfig, Qwen3NextConfig

    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    hybrid = _meta(Qwen3NextConfig(**small, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    res = auto.resolve(_cfg("train.memory_budget_gib=24"), device=CUDA, skeleton=hybrid)
    assert res.cfg.rollout.backend == "hf" and "linear_attention" in _reason(res, "rollout.backend")
    windowed = _meta(MistralConfig(**small, num_hidden_layers=2, sliding_window=64))
    res = auto.resolve(_cfg("train.memory_budget_gib=24"), device=CUDA, skeleton=windowed)
    assert res.cfg.rollout.backend == "static" and res.cfg.train.packed is False
    assert "sliding_attention" in _reason(res, "train.packed")


def test_a_given_model_is_packed_only_if_its_own_attention_runs_varlen():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logitless.models.varlen import NAME, register

    register()
    small = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    for impl, packed in (("sdpa", False), (NAME, True)):
        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**small, attn_implementation=impl)).to(torch.bfloat16)
        res = auto.resolve(_cfg("train.memory_budget_gib=24"), device=CUDA, model=model)
        assert res.cfg.train.packed is packed, _reason(res, "train.packed")


def test_fp32_models_and_torchrun_get_no_packing_compile_or_plan():
    res = auto.resolve(_cfg("model.dtype=float32", "train.max_steps=500"), device=CUDA,
                       skeleton=bench_plan.skeleton("1.5b"), free_gib=80.0)
    assert res.cfg.train.packed is False and "float32" in _reason(res, "train.packed")
    res = auto.resolve(_cfg("train.max_steps=500"), world_size=2, device=CUDA, skeleton=bench_plan.skeleton("1.5b"),
                       free_gib=80.0)
    assert res.plan is None and res.cfg.model.compile_layers is False
    installed = importlib.util.find_spec("liger_kernel") is not None  # (FSDP2 runs Liger's kernels where installed)
    assert res.cfg.model.liger_kernels is installed
    assert res.rank_memory is not None and res.ranks == 2  # (the per-GPU prediction only: tests/test_memory_ranks.py)
    assert res.cfg.model.gradient_checkpointing is False and "torchrun" in _reason(res, "model.gradient_checkpointing")


def test_dry_run_prints_the_plan_from_the_model_config_alone(tmp_path, capsys):
    """A model folder holding only config.json is enough for --dry-run's plan (no weights exist to read)."""
    from rich.console import Console
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=151_936, max_position_embeddings=32_768, **bench_plan.SHAPES["1.5b"]).save_pretrained(tmp_path)
    cfg = _cfg(f"model.name_or_path={tmp_path}", "train.memory_budget_gib=24", "model.device=cpu")
    auto.print_dry_run(cfg, Console(width=200, force_terminal=False, stderr=True))
    out = capsys.readouterr().err
    assert "memory plan: predicted peak per phase (GiB), budget 24.0" in out and "train.micro_batch_tokens" in out
    missing = _cfg(f"model.name_or_path={tmp_path / 'nowhere'}", "model.device=cpu", "train.memory_budget_gib=24")
    auto.print_dry_run(missing, Console(width=200, force_terminal=False, stderr=True))
    err = capsys.readouterr().err
    assert "the model's config could not be read without weights (" in err and "predicted peak" not in err


def test_a_model_whose_config_cannot_be_read_takes_the_plain_path_on_cuda(tmp_path):
    res = auto.resolve(_cfg(f"model.name_or_path={tmp_path / 'nowhere'}", "train.max_steps=500"), device=CUDA,
                       free_gib=80.0)
    c = res.cfg
    assert (c.rollout.backend, c.train.packed, c.model.liger_kernels) == ("hf", False, False) and res.plan is None
    assert c.model.gradient_checkpointing is False and c.train.micro_batch_tokens is None
    assert "could not be read without weights" in res.notes[0]


def test_cli_dry_run_prints_the_settings_and_plan_on_stderr(capsys):
    """`logitless train --dry-run`: the config (YAML) on stdout, then what auto decides and the plan on stderr; the
    demo's model config comes from its GGUF file's metadata."""
    from logitless.cli import main

    assert main(["train", "--dry-run", "train.memory_budget_gib=8"]) == 0
    captured = capsys.readouterr()
    assert "memory_budget_gib: 8.0" in captured.out and "settings of this run" not in captured.out
    assert "settings of this run" in captured.err and "memory plan: predicted peak per phase" in captured.err
