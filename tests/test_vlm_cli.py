"""`logitless train` with a vision-language model: a tiny local Qwen2.5-VL, Qwen3-VL or Gemma 3 folder and the
count_shapes task, two steps end to end on CPU (rollout with images on hf, or static for Qwen3-VL, rewards, the
update, checkpoints)."""

from __future__ import annotations

import json

import pytest
import yaml

from logitless.cli import main
from vlm_fixtures import FAMILIES, build_tiny_vlm


def vlm_config(tmp_path, folder, **train):
    cfg = {
        "model": {"name_or_path": str(folder), "lora_r": 4, "lora_alpha": 8, "dtype": "float32"},
        "data": {"task": "count_shapes", "options": {"n": 16, "size": 56}, "eval_options": {"n": 4}},
        # numeric_answer is the task's reward (0 for a random model); length_target varies with the random texts, so
        # groups have advantages and the update trains every row
        "reward": {"reward_funcs": ["numeric_answer", "length_target"],
                   "reward_options": {"length_target": {"target": 10}}},
        "objective": {"beta": 0.01},  # the reference forward (adapters off) runs with the images too
        "rollout": {"backend": "hf", "num_generations": 2, "max_completion_length": 5},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "prompts_per_step": 2, **train},
        "logging": {"tensorboard": False, "progress": False, "log_completions": True, "completions_steps": 1},
        "checkpoint": {"save_steps": 2},
        "eval": {"every_steps": 2, "num_prompts": 2, "batch_size": 2},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen_tokenizer_dir):
    """One tiny folder per family for the module's runs (each run writes only to its own output folder), built on
    first use."""
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_vlm(qwen_tokenizer_dir, tmp_path_factory.mktemp(family), family=family)
        return built[family]

    return get


@pytest.fixture(scope="module")
def folder(folders):
    """The tiny Qwen2.5-VL folder."""
    return folders("qwen2_5_vl")


@pytest.mark.parametrize("family", FAMILIES)
def test_train_a_vision_language_model_for_two_steps(tmp_path, folders, family):
    """Qwen2.5-VL's run packs its micro-batches (train.packed=true: each row its own M-RoPE positions), the others
    pad them; Qwen3-VL's rollout and its eval during training decode on the static engine, from the merged-LoRA
    copy; the sampler's logprobs are the trainer's either way."""
    folder = folders(family)
    packed = {"packed": True} if family == "qwen2_5_vl" else {}
    backend = ["rollout.backend=static"] if family == "qwen3_vl" else []
    assert main(["train", str(vlm_config(tmp_path, folder, **packed)), *backend]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "loss" in str(sorted(r))]
    assert steps and max(r["step"] for r in steps) == 2
    last = steps[-1]
    assert all(r["trained_rows"] > 0 for r in steps)
    mismatch = [v for k, v in last.items() if k.endswith("mismatch_max")]
    assert mismatch and mismatch[0] < 1e-4  # the trainer's forward with images reproduces the sampler (fp32)
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert any(k.startswith("eval/") for r in records for k in r)  # the held-out eval decodes the images too
    assert main(["eval", str(vlm_config(tmp_path, folder)), "--checkpoint", str(tmp_path / "run"),
                 "--output", str(tmp_path / "eval.json")]) == 0  # `logitless eval` loads the processor


@pytest.mark.parametrize("family, override, message", [
    ("gemma3", "train.packed=true", "train.packed=true: Gemma3Model's image tokens attend to each other both ways"),
    ("qwen2_5_vl", "rollout.backend=continuous", "rollout.backend=continuous: rows with images"),
])
def test_vlm_settings_that_cannot_train_images_are_refused(tmp_path, folders, family, override, message, capsys):
    assert main(["train", str(vlm_config(tmp_path, folders(family))), override]) != 0
    assert message in capsys.readouterr().err


def test_a_step_that_trains_no_row_measures_the_mismatch_with_the_rows_images(tmp_path, folder):
    """Equal rewards in every group (a random model scores 0 on numeric_answer) and no KL term: no row trains, and
    the mismatch is measured on a sample of rows (train.mismatch_sample_rows), whose forward needs their images."""
    path = vlm_config(tmp_path, folder)
    cfg = yaml.safe_load(path.read_text())
    cfg["reward"], cfg["objective"], cfg["eval"] = {"reward_funcs": ["numeric_answer"]}, {"beta": 0.0}, {}
    cfg["train"]["max_steps"] = 1
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 0
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if "trained_rows" in line]
    assert step["trained_rows"] == 0 and step["rollout/mismatch_max"] < 1e-4
