"""model.lora_compute: LoRA adapters that compute in the model's dtype under autocast, their fp32 weights the
optimizer's masters; the same path for the update's forward, its recompute and the old-policy logprobs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.trainer.config.schema import ModelConfig, load_train_config
from logitless.trainer.loop import train
from logitless.trainer.policy.modeling import LoraCompute, prepare_for_training
from tests.conftest import TINY_LORA_QUIET, tiny_qwen2
from tests.test_trainer import VOCAB, tok  # noqa: F401 (fixture)


def _peft(dtype, lora_compute="auto", gc=False, lora=True):
    cfg = ModelConfig(lora=lora, lora_r=4, lora_alpha=8, gradient_checkpointing=gc, lora_compute=lora_compute)
    return prepare_for_training(tiny_qwen2(vocab_size=256, hidden=32, layers=2).to(dtype), cfg), cfg


def test_auto_autocasts_lora_on_a_half_precision_model_only():
    assert LoraCompute(*_peft(torch.float32)).dtype is None
    assert LoraCompute(*_peft(torch.bfloat16)).dtype == torch.bfloat16
    assert LoraCompute(*_peft(torch.float16)).dtype == torch.float16
    assert LoraCompute(*_peft(torch.bfloat16, "fp32")).dtype is None
    assert LoraCompute(*_peft(torch.bfloat16, lora=False)).dtype is None  # full fine-tuning: nothing to do


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"model.lora_compute=autocast .* float32 .* model.dtype=bfloat16"):
        LoraCompute(*_peft(torch.float32, "autocast"))
    with pytest.raises(ValueError, match=r"model.lora_compute=autocast .* model.lora=false"):
        ModelConfig(lora=False, lora_compute="autocast")


def _fwd_bwd(model, cfg):
    """Dtypes (input of lora_A, output of lora_B) seen in one forward + backward (the recompute included), and the
    adapter gradients."""
    seen = set()
    hooks = [m.register_forward_hook(lambda m, i, o: seen.add((i[0].dtype, o.dtype)))
             for n, m in model.named_modules() if n.endswith("lora_A.default")]
    hooks += [m.register_forward_hook(lambda m, i, o: seen.add(("out", o.dtype)))
              for n, m in model.named_modules() if n.endswith("lora_B.default")]
    g = torch.Generator().manual_seed(0)
    p_ids, c_ids = torch.randint(0, 256, (3, 5), generator=g), torch.randint(0, 256, (3, 7), generator=g)
    c_mask = torch.ones_like(c_ids, dtype=torch.bool)
    c_mask[1, 4:] = False
    compute = LoraCompute(model, cfg)
    model.train()
    with compute.stage():
        with compute.forward():
            logp, _ = completion_logprobs(model, p_ids, torch.ones_like(p_ids, dtype=torch.bool), c_ids, c_mask)
        (logp * torch.linspace(-1, 1, 7)).sum().backward()
    for h in hooks:
        h.remove()
    return seen, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "checkpointed"])
def test_adapters_compute_in_bf16_and_keep_fp32_masters(gc):
    model, cfg = _peft(torch.bfloat16, "autocast", gc=gc)
    with torch.no_grad():  # lora_B starts at 0; nonzero adapters make the bf16/fp32 paths differ measurably
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    reference = copy.deepcopy(model)
    seen, grads = _fwd_bwd(model, cfg)
    # the forward and (checkpointed) its recompute: bf16 inputs and outputs, no fp32 [N, out] result
    assert seen == {(torch.bfloat16, torch.bfloat16), ("out", torch.bfloat16)}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    assert all(grads[n].dtype == torch.float32 and grads[n].abs().max() > 0 for n in grads)
    seen32, grads32 = _fwd_bwd(reference, dataclasses.replace(cfg, lora_compute="fp32"))
    assert seen32 == {(torch.float32, torch.float32), ("out", torch.float32)}  # peft's own path
    for n in grads:  # the same gradients, to bf16 precision, and not bit-equal (the paths differ)
        torch.testing.assert_close(grads[n], grads32[n], rtol=0.1, atol=0.02 * float(grads32[n].abs().max()))
    assert any(not torch.equal(grads[n], grads32[n]) for n in grads)


def test_checkpointed_recompute_gives_the_same_gradients_under_autocast():
    plain, cfg = _peft(torch.bfloat16, "autocast", gc=False)
    ckpt_model, ckpt_cfg = _peft(torch.bfloat16, "autocast", gc=True)
    ckpt_model.load_state_dict(plain.state_dict())
    _, g1 = _fwd_bwd(plain, cfg)
    _, g2 = _fwd_bwd(ckpt_model, ckpt_cfg)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


@pytest.mark.parametrize("mode", ["autocast", "fp32"])
def test_old_policy_logprobs_take_the_update_path(tmp_path, tok, mode):
    """With a learning rate too small to move a bf16 forward, every μ = 2 pass sees the old policy: the ratio
    new / old is exactly 1 only if the old-policy logprobs ran the same (autocast or fp32) path as the update."""
    cfg = load_train_config(None, [
        f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1", "train.prompts_per_step=2",
        "train.micro_batch_size=3", "rollout.num_generations=4", "rollout.max_completion_length=6",
        "data.options={difficulty: 1, n: 8, chat: false}", "reward.reward_funcs=[numeric_answer]",
        "train.num_iterations=2", "optim.learning_rate=1e-30", "model.gradient_checkpointing=true",
        "train.skip_zero_advantage=false", f"model.lora_compute={mode}", *TINY_LORA_QUIET, "checkpoint.save_steps=0",
        "checkpoint.save_at_end=false",
    ])
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1).to(torch.bfloat16)
    seen = set()

    def lora_a_input(module, args, out):  # lora_A (rank 4, fp32 weight) of the trained forwards and recomputes
        if torch.is_grad_enabled() and type(module) is torch.nn.Linear and module.out_features == 4:
            seen.add(args[0].dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(lora_a_input)
    try:
        rec = train(cfg, model=model, tokenizer=tok).records[0]
    finally:
        hook.remove()
    assert rec["ratio/min"] == rec["ratio/max"] == 1.0
    assert seen == {torch.bfloat16 if mode == "autocast" else torch.float32}
