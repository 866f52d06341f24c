"""`logitless export`: the adapter loads with plain peft, the merged model with plain transformers, and both give
the trained policy's logprobs (fp32, 1e-5); pushing is refused before any work when the hub cannot be used."""

from __future__ import annotations

import copy

import pytest
import torch

from logitless.cli import main
from logitless.models import completion_logprobs
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.export import export_run, load_policy, run_config
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.loop import train
from tests.conftest import TINY_LORA_QUIET, tiny_qwen2

VOCAB = 50_257


def _train_from_folder(root, tok, *overrides):
    """A tiny model saved as a user's base model folder `root/base`, trained 2 steps from that folder in `root/run`."""
    tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=2, tie=False).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    cfg = load_train_config(None, [
        f"model.name_or_path={root / 'base'}", "model.dtype=float32", f"train.output_dir={root / 'run'}",
        "train.max_steps=2", "train.prompts_per_step=2", "train.micro_batch_size=8", "rollout.num_generations=4",
        "rollout.max_completion_length=5", "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[length_target]", "reward.reward_options={length_target: {target: 30}}",
        "optim.learning_rate=0.05", *TINY_LORA_QUIET, "checkpoint.save_steps=0", *overrides,
    ])
    train(cfg)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, gpt2_tokenizer):
    """LoRA adapters trained from a base model folder."""
    tok = copy.deepcopy(gpt2_tokenizer)
    tok.pad_token = tok.eos_token
    return _train_from_folder(tmp_path_factory.mktemp("export"), tok)


def _ids(tok):
    rows = [tok(t)["input_ids"] for t in ("12 + 30 = 42\n7 - 3 =", "What is 5 + 9? It is 14, since")]
    return [torch.tensor([r]) for r in rows]


def _plain_logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _policy_logprobs(policy, ids):
    """The trainer's logprobs of the policy (the fused op over its hidden states), every token after the first."""
    one = torch.ones_like(ids[:, :1])
    with torch.no_grad():
        return completion_logprobs(policy, ids[:, :1], one, ids[:, 1:], torch.ones_like(ids[:, 1:]))[0]


def test_merged_model_and_adapter_give_the_policy_logprobs(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = export_run(trained / "run", output=tmp_path / "out", merged=True)
    assert result.adapter == tmp_path / "out" / "adapter" and result.merged == tmp_path / "out" / "merged"
    checkpoint = ckpt.resolve_checkpoint(trained / "run")
    policy, _ = load_policy(run_config(checkpoint), checkpoint)
    merged = AutoModelForCausalLM.from_pretrained(result.merged, dtype=torch.float32).eval()
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained / "base"), result.adapter).eval()
    base = AutoModelForCausalLM.from_pretrained(trained / "base").eval()
    tok = AutoTokenizer.from_pretrained(result.merged)
    assert sorted(p.name for p in result.merged.glob("*.safetensors")) == ["model.safetensors"]
    for ids in _ids(tok):
        want = _policy_logprobs(policy, ids)
        assert torch.allclose(_plain_logprobs(merged, ids), want, rtol=0, atol=1e-5)
        assert torch.allclose(_plain_logprobs(adapter, ids), want, rtol=0, atol=1e-5)
        assert (_plain_logprobs(base, ids) - want).abs().max() > 1e-3  # training moved the policy: the merge matters
    card = (result.merged / "README.md").read_text()
    assert f"base_model: {trained / 'base'}" in card and "library_name: transformers" in card and "steps: 2" in card
    assert "library_name: peft" in (result.adapter / "README.md").read_text()


def test_cli_export_and_default_folder(trained, capsys):
    assert main(["export", str(trained / "run")]) == 0
    assert f"adapter: {trained / 'run' / 'export' / 'adapter'}" in capsys.readouterr().out
    assert not (trained / "run" / "export" / "merged").exists()
    assert main(["export", str(trained / "run")]) == 1  # never over an earlier export
    assert "exists and is not empty; nothing was changed" in capsys.readouterr().err


@pytest.mark.parametrize("setup, match", [
    ({"HF_HUB_OFFLINE": "1"}, r"switched off here \(HF_HUB_OFFLINE\); nothing was exported"),
    ({"HF_TOKEN": "hf_test", "ENDPOINT": "http://127.0.0.1:9"}, r"cannot be reached \(ConnectError\); nothing was exported"),
])
def test_push_is_refused_before_any_work_when_the_hub_cannot_be_used(trained, tmp_path, monkeypatch, setup, match):
    from huggingface_hub import constants

    for k, v in setup.items():
        if k == "ENDPOINT":
            monkeypatch.setattr(constants, "ENDPOINT", v)
        else:
            monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        export_run(trained / "run", output=tmp_path / "out", merged=True, push_to_hub="me/model")
    assert not (tmp_path / "out").exists()


def test_full_fine_tuning_exports_the_merged_model_only(tmp_path, gpt2_tokenizer, one_thread):
    from transformers import AutoModelForCausalLM

    tok = copy.deepcopy(gpt2_tokenizer)
    tok.pad_token = tok.eos_token
    root = _train_from_folder(tmp_path, tok, "model.lora=false", "optim.learning_rate=0.001")
    result = export_run(root / "run")
    assert result.adapter is None and result.merged == root / "run" / "export" / "merged"
    checkpoint = ckpt.resolve_checkpoint(root / "run")
    policy, _ = load_policy(run_config(checkpoint), checkpoint)
    merged = AutoModelForCausalLM.from_pretrained(result.merged, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(root / "base").eval()
    for ids in _ids(tok):
        want = _policy_logprobs(policy, ids)
        assert torch.allclose(_plain_logprobs(merged, ids), want, rtol=0, atol=1e-5)
        assert (_plain_logprobs(base, ids) - want).abs().max() > 1e-4
    assert "full fine-tuning" in (result.merged / "README.md").read_text()


def test_a_bad_output_is_refused_before_loading_and_a_failed_export_leaves_nothing(trained, tmp_path, capsys):
    """--output naming a file is refused at once; an export the OS cannot write (here: paths past PATH_MAX under
    the output folder) is one line naming the OS error, and removes the folders it made, so a rerun is not refused."""
    (tmp_path / "file").write_text("x")
    assert main(["export", str(trained / "run"), "--output", str(tmp_path / "file")]) == 1
    assert "--output" in (err := capsys.readouterr().err) and "is a file" in err
    deep = tmp_path
    while len(str(deep)) < 4096 - 20:  # adapter/ fits in PATH_MAX (4096), adapter/adapter_model.safetensors does not
        deep = deep / ("d" * min(200, 4096 - 20 - len(str(deep)) - 1))
    deep.mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"export to .* failed: File name too long \(ENAMETOOLONG\).*nothing was left"):
        export_run(trained / "run", output=deep, merged=True)
    assert list(deep.iterdir()) == []


def test_a_model_dequantized_from_gguf_saves_as_plain_safetensors(tmp_path):
    """What transformers leaves on a model it loaded from a GGUF file and dequantized (the demo's SmolLM2 Q4_1:
    its GgufHfQuantizer with no packed module, and the GgufConfig): save_pretrained refuses it ("quantized with
    GGUF... not serializable"); `dense` drops those marks and the saved model computes the same logits. (On the demo
    GGUF itself, the merged model saved this way gave logits equal to the loaded one's, max |diff| 0.0.)"""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    from logitless.trainer.export import dense

    model = tiny_qwen2(vocab_size=96, hidden=32, layers=1)
    model.config.quantization_config = GgufConfig(gguf_file="model.Q4_1.gguf")
    model.hf_quantizer, model.is_quantized = GgufHfQuantizer(model.config.quantization_config), True
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    dense(model).save_pretrained(tmp_path / "merged")
    ids = torch.tensor([[1, 5, 9, 2]])
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_the_card_of_a_gguf_run_names_the_gguf_it_trained_on(trained):
    from logitless.trainer.demo import demo_config
    from logitless.trainer.export import gguf_source, model_card
    from logitless.trainer.policy.modeling import DEMO_GGUF_FILE

    checkpoint = ckpt.resolve_checkpoint(trained / "run")
    assert gguf_source(run_config(checkpoint)) is None  # a model folder
    card = model_card(demo_config([]), checkpoint, merged=False)
    assert f"Trained on `{DEMO_GGUF_FILE}`, a GGUF quantization of `HuggingFaceTB/SmolLM2-135M-Instruct`" in card
    assert "this adapter on the weights of" in card
