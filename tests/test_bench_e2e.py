"""bench/bench_e2e.py runs end to end on a tiny shape (CPU, logitless only; TRL's part needs a GPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiny_logitless_run(tmp_path: Path, tokenizer: Path, shape: str, steps: int, *extra: str) -> dict:
    """bench_e2e's logitless side on a tiny `shape` on CPU (hf rollout, 2 prompts x 2, T = 6); its results JSON."""
    cmd = [
        sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tokenizer", str(tokenizer),
        "--out", str(tmp_path), "--shape", shape, "--systems", "logitless", "--T", "6", "--steps", str(steps),
        "--prompts", "2", "--G", "2", "--micro", "2", "--backend", "hf", "--set", "train.num_threads=1", *extra,
    ]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=600)
    return json.loads((tmp_path / f"e2e_{shape}.json").read_text())


def test_bench_e2e_tiny_logitless(tmp_path, qwen_tokenizer_dir):
    result = tiny_logitless_run(tmp_path, qwen_tokenizer_dir, "tiny", 2, "--torch-profile", "2")
    (run,) = result["runs"]
    assert run["system"] == "logitless" and run["error"] is None and len(run["steps"]) == 2
    for step in run["steps"]:
        assert 0 < step["completion_tokens"] <= 2 * 2 * 6
        assert step["seconds"]["generate"] > 0 and step["seconds"]["train"] > 0
        assert step["rollout_tokens_per_s"] > 0
    summary = run["summary"]
    steady = run["steps"][1]  # the median of the steps after the first
    assert abs(summary["step_s"] - sum(steady["seconds"].values())) < 1e-9
    assert abs(summary["step_tokens_per_s"] - steady["completion_tokens"] / summary["step_s"]) < 1e-9
    assert summary["ceiling_fraction"] is None and summary["mfu"] is None  # no device peaks on CPU
    assert result["info"]["device"] == "cpu" and result["config"]["tuning"] == "LoRA r16 all-linear"
    prof = run["torch_profile"]  # --torch-profile 2: step 2's rollout and update, op by op
    assert prof["step"] == 2 and set(prof) == {"step", "rollout", "update"}
    assert "aten::mm" in prof["update"]["by_host_time"] and "aten::" in prof["rollout"]["by_device_time"]


def test_torch_profile_keeps_only_the_windows_asked_for():
    import pytest
    import torch

    from bench.torch_profile import StepProfiler

    prof = StepProfiler(3, ["rollout"])
    for step in (2, 3):
        for event in ("step_start", "generate", "after_rollout", "after_update"):
            prof(event, step)
            torch.ones(4, 4) @ torch.ones(4, 4)
    assert set(prof.summary()) == {"step", "rollout"} and "aten::mm" in prof.summary()["rollout"]["by_host_time"]
    with pytest.raises(ValueError, match="--torch-profile-windows: unknown window"):
        StepProfiler(3, ["rolout"])


def test_find_max_T_goes_on_from_earlier_probes(tmp_path, monkeypatch):
    """--probes-from: outcomes recorded by earlier commands (a find-max-T probe list, plain runs that fit or ran out
    of memory) are reused, a probe cut short decides nothing, and a file of another configuration is refused."""
    import argparse

    import pytest

    from bench import bench_e2e as b

    config = {"shape": "s", "tuning": "LoRA r16 all-linear", "prompts": 16, "G": 8, "micro_batch": 8, "backend": "static",
              "memory_budget_gib": 24.0, "overrides": []}
    first = {"config": dict(config, steps=1), "runs": [
        {"system": "trl", "T": 1024, "steps": [{}], "error": None, "summary": {"peak_gib": 8.0}},
        {"system": "trl", "T": 4096, "steps": [], "error": "out of memory: CUDA out of memory."},
        {"system": "trl", "T": 3584, "steps": [], "error": "worker exited with 124"},  # cut short: undecided
        {"system": "logitless", "T": 4096, "steps": [{}], "error": None},
        {"system": "trl", "T": 5120, "steps": [{"oom_retries": 1.0}],  # fitted only with leaner settings
         "error": "out of memory with the settings asked for: the trainer retried leaner (steps[].oom_retries)"}]}
    second = {"config": config, "max_T": {"trl": {"probes": [
        {"T": 2048, "ok": True, "peak_gib": 12.2}, {"T": 3072, "ok": False}, {"T": 2560, "ok": None}]}}}
    paths = [tmp_path / "first.json", tmp_path / "second.json"]
    for path, res in zip(paths, (first, second)):
        path.write_text(json.dumps(res))
    known = b.known_probes([str(p) for p in paths], "trl", config)
    assert {T: e["ok"] for T, e in known.items()} == {1024: True, 4096: False, 2048: True, 3072: False, 5120: False}
    assert known[1024]["peak_gib"] == 8.0 and known[4096]["reused_from"] == str(paths[0])

    ran: list[int] = []
    def run_config(a, system, T, model_dir, steps=None):  # a probe's outcome without a GPU: T <= 2560 fits
        ran.append(T)
        return {"steps": [{}] if T <= 2560 else [], "summary": {"peak_gib": 1.0}}

    monkeypatch.setattr(b, "run_config", run_config)
    a = argparse.Namespace(probe_steps=1, resolution=256, max_T_cap=32_768)
    res = b.find_max_T(a, "trl", tmp_path, 1024, 2048, known)
    # 1024 and 2048 fit and 4096 does not (known); bisection runs only the unknown T: 3072 is known to fail,
    # 2560 (undecided before) fits, 2816 does not
    assert res["max_T"] == 2560 and ran == [2560, 2816]
    assert [p["T"] for p in res["probes"]] == [1024, 2048, 4096, 3072, 2560, 2816]

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"config": dict(config, memory_budget_gib=40.0), "runs": []}))
    with pytest.raises(SystemExit, match=r"config.memory_budget_gib=40.0 differs"):
        b.known_probes([str(other)], "trl", config)
    with pytest.raises(SystemExit, match=r"config.probe='full step' differs from this run's 'update-only'"):
        b.known_probes([str(paths[0])], "logitless", dict(config, probe="update-only"))  # (no probe: a full step)


def test_update_only_probe_runs_the_trainer_s_update_on_given_completions(tmp_path, qwen_tokenizer_dir):
    """--update-only on a tiny Qwen3 shape (CPU): no decode, one given row of T completion tokens per prompt and the
    group's other one token, the tiled MLP and checkpointing set; the results say it is an update-only probe."""
    T, P = 200, 30
    cmd = [
        sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tokenizer", str(qwen_tokenizer_dir),
        "--out", str(tmp_path), "--shape", "tiny-qwen3", "--systems", "logitless", "--update-only", "--one-long-row",
        "--T", str(T), "--prompt-tokens", str(P), "--steps", "1", "--prompts", "2", "--G", "2", "--micro", "1",
        "--set", "train.num_threads=1", "--set", "model.mlp_chunk_tokens=64",
    ]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=600)
    result = json.loads((tmp_path / "e2e_tiny-qwen3_update.json").read_text())
    assert result["config"]["probe"] == "update-only" and result["config"]["reward"] == "text_hash"
    assert result["config"]["backend"].startswith("none: completions given")
    (run,) = result["runs"]
    assert run["error"] is None and run["probe"] == "update-only" and run["row_tokens"] == P + T
    (step,) = run["steps"]
    assert step["completion_tokens"] == 2 * (T + 1)  # per prompt: one row of T tokens, one of 1
    assert step["seconds"]["train"] > 0 and step["mismatch_mean"] is not None  # the update ran on the given rows
    choices = {c["key"]: c["value"] for c in run["resolved"]["choices"]}
    assert choices["model.mlp_chunk_tokens"] == 64 and choices["model.gradient_checkpointing"] is True


def test_given_completions_and_the_probe_s_refusals(qwen_tokenizer):
    import argparse

    import pytest
    import torch

    from bench import update_probe as up
    from logitless.rollout.types import SamplingOptions

    engine = up.GivenCompletions(qwen_tokenizer, 151_936, prompt_tokens=5, completion_tokens=9, one_long_row=True)
    b = engine.generate(["a", "b"], SamplingOptions(num_generations=3, seed=4))
    assert b.prompt_ids.shape == (6, 5) and bool(b.prompt_mask.all()) and b.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(b.prompt_ids[0], b.prompt_ids[2]) and not torch.equal(b.prompt_ids[0], b.prompt_ids[3])
    assert b.completion_mask.sum(1).tolist() == [9, 1, 1, 9, 1, 1] and bool(b.finished.all()) and not b.truncated.any()
    assert int(b.completion_ids.max()) < len(qwen_tokenizer) and len(b.completions) == 6
    assert torch.allclose(b.sampler_logp[0], torch.full((9,), -math.log(151_936)))
    assert float(b.sampler_logp[1, 1:].abs().sum()) == 0  # padding
    rewards = up.text_hash([], b.completions)
    assert len(set(rewards)) == len(set(b.completions)) and all(0 <= r < 1 for r in rewards)

    def args(**kw):
        base = dict(full=False, qlora=False, systems="logitless", update_only=True, turns=1, prompt_tokens=8,
                    one_long_row=False)
        return argparse.Namespace(**{**base, **kw})

    assert up.refusal(args()) is None
    assert "drop trl from --systems" in up.refusal(args(systems="logitless,trl"))
    assert "drop --turns" in up.refusal(args(turns=2))
    assert "add --update-only" in up.refusal(args(update_only=False, one_long_row=True))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--qlora \(model.load_in_4bit=true\) needs bitsandbytes and a CUDA GPU"):
            up.refusal(args(qlora=True))


def test_family_shapes_have_the_published_parameter_counts():
    """Qwen3-8B and Llama-3.1-8B built on the meta device: 8,190,735,360 and 8,030,261,248 parameters."""
    import pytest
    import torch
    import transformers as tf

    from bench import update_probe as up

    for shape, params in (("qwen3-8b", 8_190_735_360), ("llama3.1-8b", 8_030_261_248)):
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(up.family_config(shape, 128_000))
        assert sum(p.numel() for p in model.parameters()) == params
    with pytest.raises(SystemExit, match=r"llama3.1-8b has a vocabulary of 128,256 tokens, the tokenizer 151,665"):
        up.family_config("llama3.1-8b", 151_665)
    assert up.family_config("llama3.1-8b", 151_665, any_tokenizer=True).vocab_size == 128_256  # update-only probes


def test_moe_shapes_are_the_published_models():
    """Qwen3-30B-A3B, gpt-oss-20b (bf16) and OLMoE-1B-7B built on the meta device: their published parameter
    counts, all and active per token (gpt-oss's 3.6B active leaves out its input embedding), experts and k."""
    import torch
    import transformers as tf

    from bench import update_probe as up
    from logitless.models.experts import moe_shape
    from logitless.trainer.config.schema import ModelConfig
    from logitless.trainer.memory.model import model_memory

    published = {"qwen3-30b-a3b": (30_532_122_624, 3.3e9, 128, 8), "gpt-oss-20b": (20_914_757_184, 3.6e9, 32, 4),
                 "olmoe-1b-7b": (6_919_161_856, 1.3e9, 64, 8)}
    for shape, (total, active, experts, k) in published.items():
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(up.family_config(shape, 50_000), dtype=torch.bfloat16)
        mem = model_memory(model, ModelConfig(lora=False), torch.bfloat16)
        assert mem.params == sum(p.numel() for p in model.parameters()) == total
        embedding = model.get_input_embeddings().weight.numel() if shape == "gpt-oss-20b" else 0
        assert abs(mem.active_params - embedding - active) < 0.06e9, shape
        shape_ = moe_shape(model.config)
        assert (shape_.experts, shape_.active) == (experts, k) and mem.expert_bytes > 0.9 * 2 * (total - 2e9) - 2e9


def test_trl_gets_the_adapters_logitless_trains_on_a_moe():
    """bench_e2e's TRL LoraConfig, applied as TRL applies it (peft's get_peft_model, its transformers-4 rewrite of
    the targets on), adapts the same parameters with the same shapes as logitless's model.lora settings: attention
    only, or the expert stacks too (never the router)."""
    import torch
    import transformers as tf
    from peft import get_peft_model

    from bench import update_probe as up
    from bench.bench_e2e import trl_lora
    from logitless.trainer.config.schema import ModelConfig
    from logitless.trainer.policy.lora_targets import add_lora

    def adapters(model) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}

    for experts in (False, True):
        torch.manual_seed(0)
        base = tf.AutoModelForCausalLM.from_config(up.family_config("tiny-qwen3-moe", 151_665))
        ours = adapters(add_lora(base, ModelConfig(lora_r=16, lora_alpha=32, lora_target_experts=experts)))
        torch.manual_seed(0)
        base = tf.AutoModelForCausalLM.from_config(up.family_config("tiny-qwen3-moe", 151_665))
        theirs = adapters(get_peft_model(base, trl_lora(base, experts)))
        assert ours == theirs and not any(".gate." in n for n in ours)
        assert any(".experts." in n for n in ours) is experts


def test_bench_e2e_trains_a_tiny_moe_with_expert_adapters(tmp_path, qwen_tokenizer_dir):
    """The logitless side of bench_e2e on a tiny Qwen3-MoE (CPU, hf rollout): LoRA on attention and experts trains."""
    result = tiny_logitless_run(tmp_path, qwen_tokenizer_dir, "tiny-qwen3-moe", 1, "--set", "model.lora_target_experts=true")
    (run,) = result["runs"]
    assert run["error"] is None and len(run["steps"]) == 1 and run["steps"][0]["seconds"]["train"] > 0
    assert result["config"]["tuning"] == "LoRA r16 all-linear + experts"
