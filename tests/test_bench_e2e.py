"""bench/bench_e2e.py runs end to end on a tiny shape (CPU, logitless only; TRL's part needs a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_e2e_tiny_logitless(tmp_path, shared_dir):
    cmd = [
        sys.executable, str(REPO / "bench" / "bench_e2e.py"), "--tokenizer", str(shared_dir / "tokenizers" / "qwen2.5"),
        "--out", str(tmp_path), "--shape", "tiny", "--systems", "logitless", "--T", "6", "--steps", "2",
        "--prompts", "2", "--G", "2", "--micro", "2", "--backend", "hf", "--set", "train.num_threads=1",
    ]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=600)
    result = json.loads((tmp_path / "e2e_tiny.json").read_text())
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
        {"system": "logitless", "T": 4096, "steps": [{}], "error": None}]}
    second = {"config": config, "max_T": {"trl": {"probes": [
        {"T": 2048, "ok": True, "peak_gib": 12.2}, {"T": 3072, "ok": False}, {"T": 2560, "ok": None}]}}}
    paths = [tmp_path / "first.json", tmp_path / "second.json"]
    for path, res in zip(paths, (first, second)):
        path.write_text(json.dumps(res))
    known = b.known_probes([str(p) for p in paths], "trl", config)
    assert {T: e["ok"] for T, e in known.items()} == {1024: True, 4096: False, 2048: True, 3072: False}
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
