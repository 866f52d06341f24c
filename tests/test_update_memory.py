"""The memory options of the update: activation offload, QLoRA loading, optimizer choice, and their bad input.

CPU tests check exactness (offload changes where saved tensors live, never the gradients) and that every
CUDA-only option refuses clearly on CPU; the `gpu` tests run the real 4-bit, 8-bit and offload paths.
"""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import (
    OFFLOAD_INSTALL_HINT,
    clip_offloaded_grads,
    make_optimizer,
    make_scheduler,
    sync_offloaded_params,
)
from logitless.trainer.config.schema import ModelConfig, OptimConfig
from logitless.trainer.policy.modeling import (
    QLORA_INSTALL_HINT,
    load_model,
    prepare_for_training,
    require_cuda_package,
    trainable_parameters,
)
from logitless.trainer.policy import offload as offload_module
from logitless.trainer.policy.offload import ActivationOffload
from tests.test_packing import batch, tiny
from tests.test_trainer import _cfg, _lora, _train, rewards_module, tok  # noqa: F401 (fixtures)


def _lora_model(family: str, device: str = "cpu", dtype=torch.float32, **size):
    model = tiny(family, **size).to(device=device, dtype=dtype)
    cfg = ModelConfig(lora_r=4, lora_alpha=8, gradient_checkpointing=True, lora_target_modules="all-linear")
    return prepare_for_training(model, cfg).train()


def _grads(model, inputs, offload: ActivationOffload | None, packed: bool = False) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with offload if offload is not None else torch.enable_grad():
        logp, ent = completion_logprobs(model, *inputs, with_entropy=True, packed=packed)
    w = torch.linspace(-1, 1, logp.numel(), device=logp.device).view_as(logp)
    ((logp * w).sum() + 0.1 * ent.sum()).backward()
    return [p.grad.clone() for p in trainable_parameters(model)]


@pytest.mark.parametrize("family,packed", [("qwen2", False), ("llama", True), ("gpt2", False)])
def test_activation_offload_gives_identical_gradients(family, packed, one_thread):
    model = _lora_model(family)
    inputs = batch(B=5, seed=7)
    plain = _grads(model, inputs, None, packed)
    shapes = []

    class Recording(ActivationOffload):
        def _pack(self, t):
            if self._offloads(t):
                shapes.append(tuple(t.shape))
            return super()._pack(t)

    offload = Recording(model, min_bytes=0)
    gc.disable()  # the host copies must go with the backward, not with a later garbage collection
    try:
        offloaded = _grads(model, inputs, offload, packed)
        # the layer inputs went through the host stash (one per checkpointed layer at least), no parameter did
        assert len(offload.stash) >= 2 and offload.packed_bytes > 0 and len(shapes) == len(offload.stash)
        # once the backward has run, no host copy is left, although the offload object is still alive
        assert offload.live() == []
    finally:
        gc.enable()
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    assert not any(s in param_shapes and len(s) == 2 for s in shapes)
    assert any(g.abs().max() > 0 for g in plain)
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)


def test_activation_offload_needs_gradient_checkpointing():
    with pytest.raises(ValueError, match=r"model\.activation_offload=true .*model\.gradient_checkpointing=true"):
        ModelConfig(activation_offload=True, gradient_checkpointing=False)


def test_trainer_with_offload_packing_and_token_budget_trains_like_the_plain_run(tmp_path, tok, rewards_module,
                                                                                 monkeypatch):
    over = ["train.max_steps=2", "rollout.max_prompt_length=40", "model.gradient_checkpointing=true"]
    plain = _train(_cfg(tmp_path / "plain", *over), tok)
    monkeypatch.setattr(offload_module, "MIN_BYTES", 0)  # the tiny model's tensors are all small: offload them all
    fetched = []
    real_fetch = ActivationOffload._fetch
    monkeypatch.setattr(ActivationOffload, "_fetch", lambda self, key: fetched.append(key) or real_fetch(self, key))
    lean = _train(_cfg(tmp_path / "lean", *over, "model.activation_offload=true", "train.packed=true",
                       "train.micro_batch_tokens=60"), tok)
    assert len(fetched) > 0  # the update's saved tensors went through the host stash
    assert [r["loss"] for r in lean.records] == pytest.approx([r["loss"] for r in plain.records], rel=1e-5, abs=1e-7)
    a, b = _lora(tmp_path / "plain"), _lora(tmp_path / "lean")
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)  # Adam amplifies fp32 rounding of the split


def test_token_budget_smaller_than_the_longest_row_is_refused_before_loading(tmp_path, tok, rewards_module):
    cfg = _cfg(tmp_path / "run", "rollout.max_prompt_length=40", "train.micro_batch_tokens=45")
    with pytest.raises(ValueError, match=r"train\.micro_batch_tokens=45 .* >= 46"):
        _train(cfg, tok)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_cpu_offload"])
def test_cuda_optimizers_refuse_cpu_with_the_fix(name):
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match=rf"optim\.optimizer='{name}' needs a CUDA GPU.*turn it off"):
        make_optimizer(params, OptimConfig(optimizer=name))


@pytest.mark.parametrize("package,setting,hint,extra", [
    ("bitsandbytes", "optim.optimizer='adamw_8bit'", QLORA_INSTALL_HINT, "qlora"),
    ("torchao", "optim.optimizer='adamw_cpu_offload'", OFFLOAD_INSTALL_HINT, "offload"),
])
def test_missing_optional_package_names_the_extra(package, setting, hint, extra, monkeypatch):
    find = importlib.util.find_spec  # the package as if not installed (the test setup installs both)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find(name, *a))
    with pytest.raises(ImportError, match=rf"{setting} needs the `{package}` package.*logitless\[{extra}\]"):
        require_cuda_package(package, setting, hint, torch.device("cuda"))  # a CUDA device, to reach the check


def test_qlora_bad_input_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"model\.load_in_4bit=true .*needs model\.lora=true"):
        ModelConfig(load_in_4bit=True, lora=False)
    missing = tmp_path / "no-such-model"  # never opened: the device check comes first
    with pytest.raises(ValueError, match=r"model\.load_in_4bit=true runs bitsandbytes' 4-bit kernels on a CUDA GPU "
                                         r"or the CPU, but the model is on meta"):
        load_model(ModelConfig(name_or_path=str(missing), load_in_4bit=True, dtype="bfloat16"), torch.device("meta"))
    with pytest.raises(ValueError, match=r"not 4-bit quantized"):
        prepare_for_training(tiny("qwen2"), ModelConfig(load_in_4bit=True))


def test_optimizer_state_checkpoint_round_trip(tmp_path, one_thread):
    model = _lora_model("qwen2")
    cfg = OptimConfig(optimizer="adamw", learning_rate=1e-2)
    opt = make_optimizer(trainable_parameters(model), cfg)
    sched = make_scheduler(opt, 10, cfg)
    inputs = batch(B=3, seed=8)
    for _ in range(2):
        _grads(model, inputs, None)
        opt.step(), sched.step()
    ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched)
    fresh = _lora_model("qwen2")
    opt2 = make_optimizer(trainable_parameters(fresh), cfg)
    sched2 = make_scheduler(opt2, 10, cfg)
    ckpt.load_checkpoint(tmp_path, model=fresh, optimizer=opt2, scheduler=sched2)
    for m, o in ((model, opt), (fresh, opt2)):
        _grads(m, inputs, None)
        o.step()
    for a, b in zip(trainable_parameters(model), trainable_parameters(fresh)):
        assert torch.equal(a, b)


def test_model_shape_counts_4bit_weights_by_their_own_shape():
    """MFU counts a QLoRA weight's FLOPs from its real shape; bitsandbytes stores it packed (4 values per bf16)."""
    from types import SimpleNamespace

    from logitless.trainer.report.accounting import ModelShape

    model = tiny("qwen2")
    before = ModelShape.of(model)
    proj = model.model.layers[0].mlp.up_proj
    n = proj.weight.numel()
    packed = torch.nn.Parameter(torch.zeros(n // 4, 1, dtype=torch.bfloat16), requires_grad=False)
    packed.quant_state = SimpleNamespace(shape=proj.weight.shape)
    proj.weight = packed
    after = ModelShape.of(model)
    assert after.body_params == before.body_params
    assert after.decode_weight_bytes == before.decode_weight_bytes - n * 2 + packed.numel() * 2


# ---------------------------------------------------------------------------------------------------------------
# GPU: run with `python -m pytest -q -m gpu tests/test_update_memory.py` on a CUDA machine with `logitless[qlora,offload]`


@pytest.mark.gpu
def test_activation_offload_gpu_same_gradients_and_lower_peak():
    layers, rows, length, hidden = 8, 8, 2048, 256
    model = _lora_model("qwen2", "cuda", torch.bfloat16, hidden=hidden, layers=layers)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 300, (rows, length), generator=g).cuda()  # 8 rows x (1024 prompt + 1024 completion)
    mask = torch.ones_like(ids)
    inputs = (ids[:, :1024], mask[:, :1024], ids[:, 1024:], mask[:, 1024:])
    peaks, grads = [], []
    for offload in (None, None, ActivationOffload(model)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads.append(_grads(model, inputs, offload))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    # The bf16 backward on a GPU is not bitwise deterministic: measured over 12 repeats of this test's step (H200),
    # two plain runs differ by up to 7e-4 of the gradient's norm, plain and offloaded alike, while one saved layer
    # input shifted by a row (a stale or misplaced copy) moves it by 0.25. So: within 1e-2 of the norm.
    def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return float(torch.cat([(x - y).flatten() for x, y in zip(a, b)]).norm() / torch.cat([x.flatten() for x in a]).norm())

    assert rel(grads[0], grads[1]) < 1e-2 and rel(grads[0], grads[2]) < 1e-2, (rel(grads[0], grads[1]), rel(grads[0], grads[2]))
    layer_inputs = layers * rows * length * hidden * 2  # bytes the checkpointed layers save without offload
    assert peaks[2] < peaks[0] - layer_inputs / 2, (peaks, layer_inputs)


@pytest.mark.gpu
def test_packed_forward_gpu_matches_padded():
    model = tiny("qwen2").cuda()
    inputs = [t.cuda() for t in batch(seed=10)]
    torch.testing.assert_close(completion_logprobs(model, *inputs, packed=True)[0],
                               completion_logprobs(model, *inputs)[0], atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_qlora_loads_nf4_with_an_unquantized_head_and_trains_lora(tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from logitless.models import lm_head_of

    tiny("qwen2").save_pretrained(tmp_path / "m")
    cfg = ModelConfig(name_or_path=str(tmp_path / "m"), load_in_4bit=True, dtype="bfloat16", lora_r=4,
                      gradient_checkpointing=True)
    model = prepare_for_training(load_model(cfg, torch.device("cuda")), cfg).train()
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    head = lm_head_of(model)
    assert head.weight.dtype == torch.bfloat16 and head.weight.shape[0] == 300
    grads = _grads(model, [t.cuda() for t in batch(seed=11)], ActivationOffload(model, min_bytes=0))
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("name,package", [("adamw_8bit", "bitsandbytes"), ("adamw_cpu_offload", "torchao")])
def test_memory_optimizers_step_clip_and_resume_gpu(name, package, tmp_path):
    """A clipped step matches torch AdamW (8-bit states: within their rounding), and a resumed optimizer continues
    exactly. adam_epsilon=1 makes the step follow the gradient's scale, so a missed clip would show."""
    pytest.importorskip(package)
    inputs = [t.cuda() for t in batch(B=4, seed=12)]
    cfg = OptimConfig(optimizer=name, learning_rate=1.0, adam_epsilon=1.0)
    models = [tiny("qwen2").cuda().train() for _ in range(2)]
    before = [p.detach().clone() for p in models[0].parameters()]
    opts = [make_optimizer(list(models[0].parameters()), cfg),
            make_optimizer(list(models[1].parameters()), OptimConfig(learning_rate=1.0, adam_epsilon=1.0))]
    for m, o in zip(models, opts):
        _grads(m, inputs, None)
        norm = float(torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1e-3))
        assert norm > 1e-2  # clipping scales the gradients down by > 10x
        clip_offloaded_grads(o, norm, 1e-3)
        o.step()
        o.zero_grad(set_to_none=True)
    moved = max(float((p - b).abs().max()) for p, b in zip(models[1].parameters(), before))
    assert 1e-6 < moved < 1e-2
    tol = dict(atol=moved * 1e-3, rtol=0) if name == "adamw_cpu_offload" else dict(atol=moved * 0.1, rtol=0)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, **tol)
    ckpt.save_checkpoint(tmp_path, 1, model=models[0], optimizer=opts[0])
    fresh = tiny("qwen2", seed=1).cuda().train()  # other initial weights: the checkpoint must replace them
    opt2 = make_optimizer(list(fresh.parameters()), cfg)
    ckpt.load_checkpoint(tmp_path, model=fresh, optimizer=opt2)
    sync_offloaded_params(opt2)  # as build_context does on --resume
    for m, o in ((models[0], opts[0]), (fresh, opt2)):
        _grads(m, inputs, None)
        o.step()
    for a, b in zip(models[0].parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
