"""model.liger_kernels: Liger-Kernel's layer kernels (RMSNorm, SwiGLU, RoPE) in the model. Bad input is refused
on CPU before anything is patched; on a GPU the patched model gives the same logprobs and LoRA gradients as the
plain one (in a fresh process: Liger swaps names in the transformers module of the model type; its functions
stay swapped, behind a dispatch that runs the plain code under torch.compile). The dispatch itself is tested on
CPU with a patch that does what Liger's does."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import LIGER_INSTALL_HINT, apply_liger_kernels, prepare_for_training, require_cuda_package
from tests.conftest import subprocess_env
from tests.test_packing import tiny

REPO = Path(__file__).resolve().parents[1]
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed")


@needs_liger
def test_refused_on_cpu_and_for_a_model_type_liger_lacks():
    model = tiny("qwen2")
    mlp_forward = model.model.layers[0].mlp.forward
    with pytest.raises(ValueError, match=r"model\.liger_kernels=true needs a CUDA GPU .*turn it off to train on cpu"):
        prepare_for_training(model, ModelConfig(liger_kernels=True, lora=False))
    assert model.model.layers[0].mlp.forward == mlp_forward  # nothing patched before the refusal
    with pytest.raises(ValueError, match=r"no kernels for model type 'gpt2'; it supports \[.*'qwen2'.*\]\. "
                                         r"Set model\.liger_kernels=false"):
        apply_liger_kernels(tiny("gpt2"))


def test_missing_package_names_the_extra():
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed")
    with pytest.raises(ImportError, match=r"model\.liger_kernels=true needs the `liger_kernel` package.*logitless\[liger\]"):
        apply_liger_kernels(tiny("qwen2"))


def test_install_hint_names_the_extra():
    with pytest.raises(ImportError, match=r"logitless\[liger\]"):
        require_cuda_package("no_such_package_xyz", "model.liger_kernels=true", LIGER_INSTALL_HINT, torch.device("cuda"))


SCRIPT = r"""
import json, sys, torch
from logitless.models import completion_logprobs
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import prepare_for_training, trainable_parameters
from tests.test_packing import batch, tiny

def run(liger):
    torch.manual_seed(0)
    model = tiny(sys.argv[1], hidden=64).cuda()
    cfg = ModelConfig(lora_r=4, lora_alpha=8, gradient_checkpointing=True, liger_kernels=liger)
    model = prepare_for_training(model, cfg).train()
    inputs = [t.cuda() for t in batch(seed=5)]
    logp, _ = completion_logprobs(model, *inputs)
    logp.sum().backward()
    grads = torch.cat([p.grad.flatten() for p in trainable_parameters(model)])
    mlp = model.get_base_model().model.layers[0].mlp._get_name()  # Liger renames the modules it patches
    return logp.detach().cpu(), grads.cpu(), mlp

plain, liger = run(False), run(True)
print(json.dumps({"logp": float((plain[0] - liger[0]).abs().max()), "grad": float((plain[1] - liger[1]).abs().max()),
                  "grad_scale": float(plain[1].abs().max()), "mlp": [plain[2], liger[2]]}))
"""


@pytest.mark.gpu
@needs_liger
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_liger_kernels_give_the_plain_models_logprobs_and_gradients(family):
    out = subprocess.run([sys.executable, "-c", SCRIPT, family], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mlp"] == [r["mlp"][0], "LigerSwiGLUMLP"] and r["mlp"][0] != "LigerSwiGLUMLP"  # the kernels are in place
    assert r["logp"] < 1e-4, r  # fp32: same math, other kernels
    assert r["grad"] < 1e-4 * max(r["grad_scale"], 1.0), r


def test_patched_forwards_run_only_outside_torch_compile(monkeypatch):
    """`outside_compile` around a patch that does what Liger's apply does (a forward bound on module instances, a
    function and a class replaced in the modeling module): eager calls run the patched code, traced calls the
    module's own, a deep copy dispatches on its own weights, and the class is put back."""
    import copy
    import types

    from logitless.trainer.policy.modeling import outside_compile

    model = tiny("qwen2")
    modeling = sys.modules[type(model).__module__]
    for name in ("apply_rotary_pos_emb", "Qwen2MLP"):  # restored after the test
        monkeypatch.setattr(modeling, name, getattr(modeling, name))
    plain_rope, plain_mlp_cls = modeling.apply_rotary_pos_emb, modeling.Qwen2MLP

    def kernel_mlp(self, x):
        return torch.full_like(x, 7.0)

    def patch():
        for layer in model.model.layers:
            layer.mlp.__dict__["forward"] = types.MethodType(kernel_mlp, layer.mlp)
        modeling.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: (q * 0 + 3, k * 0 + 3)
        modeling.Qwen2MLP = type("KernelMLP", (torch.nn.Module,), {})

    outside_compile(model, modeling, patch)
    assert modeling.Qwen2MLP is plain_mlp_cls  # models built later stay plain
    x = torch.randn(2, 3, 32)
    mlp = model.model.layers[0].mlp
    own = plain_mlp_cls.forward(mlp, x)
    assert torch.equal(mlp(x), torch.full_like(x, 7.0))  # eager: the kernel
    traced = torch.compile(lambda m, t: m(t), backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(mlp, x), own)  # traced: the module's own forward
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    assert torch.equal(modeling.apply_rotary_pos_emb(q, k, cos, sin)[0], q * 0 + 3)
    rope = torch.compile(lambda *a: modeling.apply_rotary_pos_emb(*a), backend="eager", fullgraph=True)
    torch.testing.assert_close(rope(q, k, cos, sin)[0], plain_rope(q, k, cos, sin)[0])
    twin = copy.deepcopy(model)
    twin_mlp = twin.model.layers[0].mlp
    with torch.no_grad():
        twin_mlp.down_proj.weight.mul_(2.0)
    assert twin_mlp.forward.__self__ is twin_mlp
    torch.testing.assert_close(traced(twin_mlp, x), plain_mlp_cls.forward(twin_mlp, x))
    assert not torch.allclose(traced(twin_mlp, x), own)  # the copy's own weights, not the original's
