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
