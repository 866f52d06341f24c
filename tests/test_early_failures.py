"""A run that fails early leaves no debris and its folder is taken over by the same command; mistakes that can be
seen before the weights load fail there (issue 51's probe cases, each failing on the code before the fix)."""

from __future__ import annotations

import json

import pytest

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.rundir import LOCK_FILE, claim_run_dir, restart_advice
from tests.conftest import TINY_LORA_QUIET, tiny_qwen2
from tests.test_rundir import _cli, _run_cfg, no_model_load  # noqa: F401 (fixture)
from tests.test_trainer import tok  # noqa: F401 (fixture: GPT-2, left padding, pad = EOS)

VOCAB = 50_257


def _tiny_cfg(run_dir, *overrides):
    from logitless.trainer.config.schema import load_train_config

    return load_train_config(None, [
        f"train.output_dir={run_dir}", "train.max_steps=1", "train.prompts_per_step=2", "rollout.num_generations=2",
        "rollout.max_completion_length=2", "data.options={difficulty: 1, n: 20, chat: false}", *TINY_LORA_QUIET,
        *overrides,
    ])


def _train(cfg, tok, **kw):
    from logitless.trainer.loop import train

    return train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok, **kw)


def _left(run):
    return sorted(p.name for p in run.iterdir() if p.name != LOCK_FILE)


# ---- item 5: a run that fails in step 1


def test_a_failure_in_step_1_leaves_no_debris_and_the_same_command_runs_again(tmp_path, tok, one_thread):
    run = tmp_path / "run"

    def crash(event, step):
        if event == "after_update":
            raise RuntimeError("crash in step 1")

    with pytest.raises(RuntimeError, match="crash in step 1"):
        _train(_tiny_cfg(run), tok, hook=crash)
    assert _left(run) == []  # no config.yaml, resolved.json or empty metrics.jsonl
    assert restart_advice(run).endswith("start again with the same command")
    assert _train(_tiny_cfg(run), tok).step == 1  # no --overwrite needed
    assert ckpt.resolve_checkpoint(run).name == "step-000001"


def test_a_folder_whose_run_saved_no_checkpoint_is_taken_over(tmp_path):
    """As a run killed before its first checkpoint leaves it: its config and metrics, no checkpoint. A new run takes
    the folder (the old files go once it finished a step, and come back if it does not); --resume says what to do."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {max_steps: 5}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ckpt.CheckpointError, match=r"saved no checkpoint, so there is nothing to resume; start it "
                                                   r"anew with the same command without --resume"):
        claim_run_dir(_run_cfg(run), resume=run)
    with pytest.warns(UserWarning, match="holds a run that saved no checkpoint .*metrics.jsonl with 1 records.*starting "
                                         "anew"):
        claim = claim_run_dir(_run_cfg(run))
    with claim:
        assert _left(run) == [next(p.name for p in run.iterdir() if p.name.startswith(".replaced-"))]
        claim.save_config(claim.cfg)
        claim.first_step_done()
    assert _left(run) == ["config.yaml"] and "max_steps: 2" in (run / "config.yaml").read_text()


# ---- item 4: agent mistakes are caught by preflight (and --dry-run), before weights load and before the claim

AGENT_MODULE = '''
def search(query: str) -> str:
    """Look a word up.

    Args:
        query: the word
    """
    return query


def undocumented(query: str) -> str:
    return query


class NoStep:
    def reset(self, row):
        return "start"


class Game:
    def __init__(self, size: int = 3):
        self.size = size

    def reset(self, row):
        return "start"

    def step(self, text):
        return None, 0.0, True
'''


@pytest.fixture
def agent_modules(tmp_path, monkeypatch):
    from tests.conftest import reward_module

    reward_module(tmp_path, monkeypatch, "probe_tools", AGENT_MODULE)
    reward_module(tmp_path, monkeypatch, "probe_tools2", "from probe_tools import search\n")


@pytest.mark.parametrize("overrides, match", [
    (["agent.tools=[nosuch_module:search]"], r"agent.tools.*nosuch_module"),
    (["agent.tools=[probe_tools:search, probe_tools2:search]"], r"search"),
    (["agent.tools=[probe_tools:undocumented]"], r"docstring"),
    (["agent.environment=probe_tools:NoStep"], r"agent.environment: NoStep has no method step\(\)"),
    (["agent.environment=probe_tools:Game", "agent.env_options={colour: red}"], r"agent.env_options: Game\(colour"),
    (["agent.tools=[calculator]", "agent.format=hermes"], r"agent.format=hermes needs a chat template"),
])
def test_agent_mistakes_fail_before_the_weights_load(tmp_path, tok, agent_modules, overrides, match):
    from logitless.trainer.loop import train

    run = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        train(_tiny_cfg(run, *overrides), model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1), tokenizer=tok)
    assert not run.exists()  # refused before the run folder was claimed: no .lock


def test_dry_run_checks_the_agent_with_the_models_tokenizer(tmp_path, tok, agent_modules, capsys, no_model_load):
    model = tmp_path / "model"
    model.mkdir()
    tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1).config.to_json_file(model / "config.json")
    tok.save_pretrained(model)
    args = ["train", "--dry-run", f"model.name_or_path={model}", "data.options={difficulty: 1, n: 20, chat: false}"]
    code, err = _cli(capsys, *args, "agent.environment=probe_tools:NoStep")
    assert code == 1 and "agent.environment: NoStep has no method step()" in err
    code, err = _cli(capsys, *args, "agent.environment=probe_tools:Game")
    assert code == 0 and "checked: agent:" in err


# ---- items 2, 3, 8: reward models and judges are checked from their config and tokenizer before the policy loads


@pytest.fixture(scope="module")
def reward_folders(tmp_path_factory, gpt2_tokenizer):
    """A tiny causal LM and a tiny sequence classifier (no score-head weights missing), each with GPT-2's tokenizer
    (no pad token)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    root = tmp_path_factory.mktemp("reward_models")
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1)
    out = {}
    for name, cls in (("lm", Qwen2ForCausalLM), ("rm", Qwen2ForSequenceClassification)):
        cls(config).save_pretrained(root / name)
        gpt2_tokenizer.save_pretrained(root / name)
        out[name] = root / name
    return out


def test_a_causal_lm_named_as_reward_model_is_refused_before_the_policy_loads(tmp_path, tok, reward_folders):
    from logitless.trainer.preflight import preflight

    spec = f"model:{reward_folders['lm']}"
    with pytest.raises(ValueError, match=rf"'{spec}': its config names the architecture\(s\) \['Qwen2ForCausalLM'\], "
                                         r"not a sequence-classification reward model.*'judge:"):
        preflight(_tiny_cfg(tmp_path / "run", f"reward.reward_funcs=['{spec}']"), model_given=True, tokenizer=tok)
    judge = f"judge:{reward_folders['rm']}"
    with pytest.raises(ValueError, match=r"without a language-model head.*use 'model:"):
        preflight(_tiny_cfg(tmp_path / "run", f"reward.reward_funcs=['{judge}']"), model_given=True, tokenizer=tok)
    lines = preflight(_tiny_cfg(tmp_path / "run", f"reward.reward_funcs=['model:{reward_folders['rm']}']"),
                      model_given=True, tokenizer=tok)
    assert any(line.startswith("reward models and judges") for line in lines)


def test_a_causal_lm_without_architectures_is_refused_at_load(tmp_path, reward_folders):
    """A config that names no architecture gets past the config check; the missing score weights are caught."""
    import shutil

    from logitless.rewards.models import RewardModel

    folder = tmp_path / "lm"
    shutil.copytree(reward_folders["lm"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"its weights hold no score head \(score.weight is missing\)"):
        RewardModel(str(folder)).load("cpu")


def test_a_reward_model_tokenizer_without_pad_token_scores_batches(reward_folders):
    from logitless.rewards.models import RewardModel

    rm = RewardModel(str(reward_folders["rm"]), batch_size=4)
    scores = rm(["1 + 1 =", "2 + 2 ="], [" 2", " four and more"])
    assert len(scores) == 2 and all(isinstance(x, float) for x in scores)
    assert rm.model.config.pad_token_id == rm.tokenizer.eos_token_id


def test_reward_device_and_judge_template_fields_are_checked_by_dry_run(tmp_path, tok, reward_folders):
    import torch

    from logitless.trainer.preflight import preflight

    judge = f"judge:{reward_folders['lm']}"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"reward.reward_options\['{judge}'\].device='cuda:7' but this machine "
                                             r"has no usable CUDA GPU"):
            preflight(_tiny_cfg(tmp_path / "run", f"reward.reward_funcs=['{judge}']",
                                f"reward.reward_options={{'{judge}': {{device: 'cuda:7'}}}}"), model_given=True,
                      tokenizer=tok)
    with pytest.raises(ValueError, match=rf"'{judge}' reads the row field 'rubric', which row 0 .* does not have"):
        preflight(_tiny_cfg(tmp_path / "run", f"reward.reward_funcs=['{judge}']",
                            f"reward.reward_options={{'{judge}': {{template: '{{completion}} {{rubric}}'}}}}"),
                  model_given=True, tokenizer=tok)


def test_wandb_without_a_key_is_refused_by_dry_run(tmp_path, monkeypatch, capsys, no_model_load):
    pytest.importorskip("wandb")
    from logitless.trainer.preflight import validate_config

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    cfg = _run_cfg(tmp_path / "run", "logging.report_to=wandb", "logging.tensorboard=null")
    with pytest.raises(ValueError, match=r"logging.report_to includes wandb, but no W&B API key is set .*wandb "
                                         r"login.*WANDB_MODE=offline"):
        validate_config(cfg)
    code, err = _cli(capsys, "train", "--dry-run", f"train.output_dir={tmp_path / 'run'}", "logging.report_to=wandb")
    assert code == 1 and "no W&B API key" in err and not (tmp_path / "run").exists()
    validate_config(_run_cfg(tmp_path / "run", "logging.report_to=wandb", "logging.tensorboard=null",
                             "logging.tracker_options={wandb: {mode: offline}}"))
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    validate_config(cfg)


# ---- item 6: a full disk names the file and says what to do


def test_a_full_disk_names_the_metrics_file_and_the_resume(tmp_path):
    from logitless.trainer.context import write_error_advice
    from logitless.trainer.report.metrics import MetricsLogger

    run = tmp_path / "run"
    logger = MetricsLogger(run, tensorboard=False, progress=False, write_error=write_error_advice(run))
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    logger._file.close()
    logger._file = open("/dev/full", "w")  # the OS's own always-full device: every flush fails with ENOSPC
    with pytest.raises(RuntimeError, match=rf"could not write step 4's record to {run / 'metrics.jsonl'}: No space "
                                           rf"left on device \(ENOSPC\).*continue it with: logitless train --resume"):
        logger.log(4, {"loss": 1.0})


# ---- item 8: data mistakes name the key


def test_chat_prompts_without_a_chat_template_fail_on_the_first_rows(tmp_path, tok):
    """GPT-2's tokenizer has no chat template; a large JSON-lines file of plain strings read as chat (the default) is
    refused after its first rows, naming data.options.chat=false."""
    from logitless.trainer.preflight import preflight

    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(20_000)))
    cfg = _tiny_cfg(tmp_path / "run", "data.task=jsonl", f"data.options={{path: {data}}}")
    with pytest.raises(ValueError, match=r"gives chat-message prompts, but the tokenizer .* has no chat template.*set "
                                         r"data.options.chat=false"):
        preflight(cfg, model_given=True, tokenizer=tok)
    preflight(_tiny_cfg(tmp_path / "run", "data.task=jsonl", f"data.options={{path: {data}, chat: false}}"),
              model_given=True, tokenizer=tok)


@pytest.mark.parametrize("override, key", [("eval.split=nosuch", "eval.split"), ("data.eval_split=nosuch", "data.eval_split")])
def test_a_bad_eval_split_names_its_key(override, key):
    from logitless.trainer.builders import load_rows
    from logitless.trainer.config.schema import load_train_config

    cfg = load_train_config(None, [override])
    with pytest.raises(ValueError, match=rf"^{key}='nosuch': .*set {key} to a split"):
        load_rows(cfg.data, cfg.eval.split or cfg.data.eval_split, eval=True)
