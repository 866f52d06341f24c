"""What the model's config and the data's first rows can tell is refused before the model loads and before the run
folder is claimed, naming the config key and the fix; `--dry-run` makes every one of these checks and says so.

The model here is a folder holding only a config.json (a tiny Qwen2 of 512 positions): any attempt to load its
weights fails the test (`no_model_load`), so each refusal must come from the config alone.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from logitless.cli import main
from logitless.trainer.config.schema import load_train_config
from tests.conftest import tiny_qwen2

context_mod = importlib.import_module("logitless.trainer.context")
evaluate_mod = importlib.import_module("logitless.trainer.evaluate")


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(context_mod, "load_model_and_tokenizer", fail)
    monkeypatch.setattr(evaluate_mod, "load_model_and_tokenizer", fail)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A saved model's config.json and nothing else: Qwen2, 2 layers, 512 positions."""
    folder = tmp_path / "model"
    folder.mkdir()
    tiny_qwen2(vocab_size=96, hidden=32, layers=2).config.to_json_file(folder / "config.json")
    return folder


def _train(capsys, tmp_path, model_dir, *overrides, dry_run=False) -> tuple[int, str]:
    base = [f"model.name_or_path={model_dir}", f"train.output_dir={tmp_path / 'run'}", "model.lora_r=4",
            "data.options={difficulty: 1, n: 40, chat: false}"]
    code = main(["train", *(["--dry-run"] if dry_run else []), *base, *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["rollout.max_completion_length=512"],
         ["rollout.max_completion_length=512 leaves no room for a prompt in the 512 positions", "max_position_embeddings",
          "Set rollout.max_completion_length below 512"]),
        (["model.lora_target_modules=[q_proj, q_prj]"],
         ["model.lora_target_modules=['q_proj', 'q_prj']: 'q_prj' matches no module", "did you mean 'q_proj'?",
          "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"]),
        (["model.lora_target_modules=attention"],  # a string is a regular expression over the full module names
         ["model.lora_target_modules='attention' matches no module of this model (Qwen2ForCausalLM)",
          "Its linear layers are down_proj, gate_proj", "or use all-linear"]),
        (["model.attn_implementation=sdpaa"],
         ["model.attn_implementation='sdpaa' is not an attention implementation; did you mean 'sdpa'?",
          "logitless_varlen"]),
        (["data.task=jsonl", "data.options={path: DATA}"],
         ["reward.reward_funcs: 'numeric_answer' reads the row field 'answer'", "row 0 of data.task='jsonl'",
          "its fields: solution", "data.options.answer_field=<column>"]),
        (["data.task=jsonl", "data.options={path: DATA, answer_field: solution}", "reward.reward_funcs=[code_tests]"],
         ["'code_tests' reads the row field 'tests'", "data.options.field_map={tests: <column>}"]),
    ],
)
def test_refused_from_the_model_config_and_first_rows_before_the_run_folder(
    tmp_path, model_dir, capsys, no_model_load, overrides, needles
):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "solution": str(i + 1)}) + "\n" for i in range(3)))
    overrides = [o.replace("DATA", str(data)) for o in overrides]
    for dry_run in (True, False):
        code, err = _train(capsys, tmp_path, model_dir, *overrides, dry_run=dry_run)
        assert code == 1 and all(n in err for n in needles), err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not (tmp_path / "run").exists()  # refused before the run folder is claimed


def test_flash_attention_that_transformers_refuses_names_the_key(tmp_path, model_dir, capsys, no_model_load):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    code, err = _train(capsys, tmp_path, model_dir, "model.attn_implementation=flash_attention_2")
    assert code == 1 and "model.attn_implementation='flash_attention_2' cannot be used with this model" in err
    assert "FlashAttention2" in err and "Set model.attn_implementation=sdpa" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("overrides, setting", [
    (["optim.optimizer=adamw_8bit"], "optim.optimizer='adamw_8bit'"),
])
def test_cuda_only_settings_on_cpu_leave_no_run_folder(tmp_path, model_dir, capsys, no_model_load, overrides, setting):
    code, err = _train(capsys, tmp_path, model_dir, *overrides)
    assert code == 1 and f"{setting} needs a CUDA GPU" in err and "no CUDA GPU is usable here" in err, err
    assert "turn it off" in err
    assert not (tmp_path / "run").exists()  # no folder, no .lock


@pytest.mark.parametrize("override, needle", [
    ("optim.adam_beta1=1.0", "optim.adam_beta1 must be in [0, 1)"),
    ("optim.adam_beta2=-0.1", "optim.adam_beta2 must be in [0, 1)"),
    ("optim.weight_decay=-0.01", "optim.weight_decay must be >= 0"),
    ("optim.adam_epsilon=0", "optim.adam_epsilon must be > 0"),
])
def test_adam_options_out_of_range_are_config_errors(tmp_path, model_dir, capsys, no_model_load, override, needle):
    code, err = _train(capsys, tmp_path, model_dir, override)
    assert code == 2 and needle in err, err
    assert not (tmp_path / "run").exists()


def test_dry_run_says_what_it_checked(tmp_path, model_dir, capsys, no_model_load):
    code = main(["train", "--dry-run", f"model.name_or_path={model_dir}", "rollout.max_completion_length=100",
                 "rollout.max_prompt_length=400", "model.lora_target_modules=[q_proj, v_proj]",
                 "data.options={difficulty: 1, n: 40, chat: false}"])
    captured = capsys.readouterr()
    assert code == 0 and "max_completion_length: 100" in captured.out  # the resolved config, as YAML
    checked = [line for line in captured.err.splitlines() if line.startswith("checked: ")]
    for needle in ["model config of", "Qwen2ForCausalLM, 2 layers, 512 positions",
                   "rollout.max_prompt_length + rollout.max_completion_length = 400 + 100 = 500 <= the model's 512",
                   "attention: transformers' default (sdpa)",
                   "model.lora_target_modules=['q_proj', 'v_proj'] adds LoRA adapters to 4 layers (q_proj, v_proj)",
                   "the first 40 rows have the fields the rewards read (numeric_answer: answer)",
                   "sources: model"]:
        assert any(needle in line for line in checked), (needle, checked)
    assert not (tmp_path / "run").exists()


def test_dry_run_of_packed_training_checks_the_varlen_attention(tmp_path, model_dir, capsys, no_model_load):
    assert main(["train", "--dry-run", f"model.name_or_path={model_dir}", "train.packed=true"]) == 0
    assert "model.attn_implementation='logitless_varlen': transformers builds" in capsys.readouterr().err


def test_a_prompt_limit_beyond_the_positions_is_reported_not_refused():
    from logitless.trainer.checks.model import check_positions

    # the rollout limits prompts to the positions the completion leaves, and every prompt is checked before training
    line = check_positions(512, 100, 512, prompt_key="rollout.max_prompt_length",
                           completion_key="rollout.max_completion_length", model="m")
    assert "prompts may have up to 412 tokens" in line and "below rollout.max_prompt_length=512" in line
    with pytest.raises(ValueError, match=r"rollout.max_completion_length=512 leaves no room.*e.g. "
                                         r"rollout.max_completion_length=256"):
        check_positions(None, 512, 512, prompt_key="rollout.max_prompt_length",
                        completion_key="rollout.max_completion_length", model="m")


def test_eval_checks_its_own_completion_length(tmp_path, model_dir, capsys, no_model_load):
    code = main(["eval", f"model.name_or_path={model_dir}", "eval.max_completion_length=600",
                 "data.options={difficulty: 2, n: 40, chat: false}"])
    err = capsys.readouterr().err
    assert code == 1 and "eval.max_completion_length=600 leaves no room for a prompt in the 512 positions" in err


def test_a_hub_model_neither_cached_nor_reachable_gives_the_sources_error(tmp_path, capsys, monkeypatch, no_model_load):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["train", "--dry-run", "model.name_or_path=logitless-test/no-such-model"])
    err = capsys.readouterr().err
    assert code == 1 and "model 'logitless-test/no-such-model' is not in the local Hugging Face cache" in err
    assert "offline mode is on" in err and len(err.strip().splitlines()) == 1


def test_a_folder_whose_config_is_not_a_model_is_named(tmp_path, capsys, no_model_load):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    code = main(["train", "--dry-run", f"model.name_or_path={folder}"])
    err = capsys.readouterr().err
    assert code == 1 and f"model.name_or_path='{folder}': its model config cannot be read" in err
    assert "config.json naming its model_type" in err


def test_library_preflight_returns_its_checks_and_skips_the_model_config_for_a_given_model(model_dir):
    from logitless.trainer.preflight import preflight

    cfg = load_train_config(None, [f"model.name_or_path={model_dir}", "data.options={difficulty: 1, n: 40, chat: false}"])
    assert any("512 positions" in line for line in preflight(cfg))
    given = preflight(load_train_config(None, ["model.name_or_path=/nowhere", "data.options={difficulty: 1, n: 40}"]),
                      model_given=True)  # train(model=...): no source or config to read
    assert not any("positions" in line for line in given) and "numeric_answer: answer" in given[-1]
