"""bench/bench_plan.py: its variants, and one tiny run end to end on CPU (the GPU measurements use the same code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import bench_plan

REPO = Path(__file__).resolve().parents[1]


def test_variant_overrides_size_micro_batches_to_the_longest_row():
    name, over = bench_plan.variant_overrides("lean", 16384)
    assert name == "lean" and "train.micro_batch_tokens=16896" in over  # 512 + T beats 16,384
    assert "train.micro_batch_tokens=16384" in bench_plan.variant_overrides("hand", 1024)[1]
    assert bench_plan.variant_overrides("mine=a.b=1,c.d={longest}", 100) == ("mine", ["a.b=1", "c.d=612"])
    assert bench_plan.variant_overrides("auto", 1024) == ("auto", [])


def test_bench_plan_tiny_auto_against_a_variant(tmp_path, qwen_tokenizer_dir):
    cmd = [sys.executable, str(REPO / "bench" / "bench_plan.py"), "--tokenizer", str(qwen_tokenizer_dir),
           "--out", str(tmp_path), "--shape", "tiny", "--T", "6", "--steps", "2", "--prompts", "2", "--G", "2",
           "--variants", "auto", "--custom", "rows=train.micro_batch_size=4", "--memory-budget", "4",
           "--set", "train.num_threads=1"]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=900)
    result = json.loads((tmp_path / "plan_tiny_budget4_auto-rows.json").read_text())
    auto, rows = result["runs"]
    assert auto["variant"] == "auto" and rows["variant"] == "rows" and not auto["error"] and len(auto["steps"]) == 2
    choices = {c["key"]: c for c in auto["resolved"]["choices"]}
    assert choices["rollout.backend"]["value"] == "hf" and choices["train.memory_budget_gib"]["value"] == 4.0
    assert auto["summary"]["plan_gib"]["train"] > 0 and auto["summary"]["step_predicted_gib_train"] > 0
    assert rows["resolved"]["plan"] is None  # no budget set for the other variants: no plan on CPU
    checks = result["checks"]["6"]
    assert checks["auto_vs_fastest_hand"]["fastest"] == "rows" and "auto_peak_vs_plan" in checks
    merged = bench_plan.compare([str(tmp_path / "plan_tiny_budget4_auto-rows.json")])
    assert merged["checks"][6]["auto_vs_fastest_hand"] == checks["auto_vs_fastest_hand"]


def test_predicted_longest_T_in_24_gib(capsys):
    """The plan's own longest T for the 1.5B shape under 24 GiB (no GPU): the bench shape's context bounds it."""
    import argparse

    a = argparse.Namespace(shape="1.5b", memory_budget=24.0, resolution=8192, max_T_cap=32_256, set=[], prompts=16, G=8)
    best = bench_plan.predict_max_T(a)["max_T"]
    assert best["T"] >= 16384 and best["settings"]["rollout.backend"] == "static"
    assert max(best["predicted_gib"].values()) <= 0.9 * 24


def test_probe_decode_decodes_n_tokens_into_the_full_cache_and_fills_the_rest(monkeypatch):
    """--probe-decode 4 at 12 tokens: each wave decodes 4 steps (the same tokens and logprobs as a full decode of
    the same seed) into a cache as long as a full decode's, and the rows still carry 12 tokens: the rest drawn
    from the regular vocabulary, never an end-of-sequence id, at the row's mean logprob."""
    from logitless.rollout import static_rows
    from logitless.rollout.static import StaticEngine
    from logitless.rollout.types import SamplingOptions
    from tests.test_rollout_families import TOK, make_model

    model = make_model("llama")
    caches: list[int] = []
    start = static_rows.DecodeRows.start
    monkeypatch.setattr(static_rows.DecodeRows, "start",
                        staticmethod(lambda call, src, keys, L: caches.append(L) or start(call, src, keys, L)))
    monkeypatch.setattr(StaticEngine, "_decode_wave", StaticEngine._decode_wave)  # undone after the test
    opts = SamplingOptions(num_generations=2, max_new_tokens=12, seed=3, ignore_eos=True)
    full = StaticEngine(model, TOK).generate(["ab", "cde"], opts)
    bench_plan.truncate_decode(4)
    short = StaticEngine(model, TOK).generate(["ab", "cde"], opts)
    assert caches[0] == caches[1] and caches[0] >= 3 + 12  # the probe's cache is the full decode's
    assert torch.equal(short.completion_ids[:, :4], full.completion_ids[:, :4])
    torch.testing.assert_close(short.sampler_logp[:, :4], full.sampler_logp[:, :4])
    assert short.completion_mask.sum(1).tolist() == [12] * 4 and not torch.equal(short.completion_ids, full.completion_ids)
    assert int(short.completion_ids.max()) < TOK.vocab_size
    torch.testing.assert_close(short.sampler_logp[:, 4:], short.sampler_logp[:, :4].mean(1, keepdim=True).expand(-1, 8))
    with_eos = StaticEngine(model, TOK).generate(["ab"] * 8, SamplingOptions(num_generations=4, max_new_tokens=64, seed=0))
    early = with_eos.completion_mask[:, :4].sum(1) < 4  # rows ended by EOS within the 4 decoded steps
    assert (~early).sum() >= 16 and (with_eos.completion_mask[~early].sum(1) == 64).all()
    assert (with_eos.completion_ids[~early, 4:] != TOK.eos_token_id).all()


def test_fits_T_probes_each_T_with_full_length_rows(tmp_path, qwen_tokenizer_dir):
    cmd = [sys.executable, str(REPO / "bench" / "bench_plan.py"), "--tokenizer", str(qwen_tokenizer_dir),
           "--out", str(tmp_path), "--shape", "tiny", "--fits-T", "20", "--probe-decode", "4", "--prompts", "2",
           "--G", "2", "--variants", "static=rollout.backend=static", "--set", "train.num_threads=1"]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=900)
    result = json.loads((tmp_path / "plan_tiny_fits_static.json").read_text())
    probe = result["fits"]["static"]["20"]
    assert result["config"]["probe_decode"] == 4 and probe["ok"] and probe["resolved"]["rollout.backend"] == "static"
    assert probe["completion_tokens"] == 20 * 2 * 2 and probe["peak_gib_per_phase"]["train"] > 0
