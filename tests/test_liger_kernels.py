"""model.liger_kernels: Liger-Kernel's layer kernels (RMSNorm, SwiGLU, RoPE) in the model. Bad input is refused
on CPU before anything is patched; on a GPU the patched model gives the same logprobs and LoRA gradients as the
plain one (in a fresh process: Liger patches the transformers module of the model type for the whole process)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitless.trainer.config import ModelConfig
from logitless.trainer.modeling import LIGER_INSTALL_HINT, apply_liger_kernels, prepare_for_training, require_cuda_package
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
from logitless.trainer.config import ModelConfig
from logitless.trainer.modeling import prepare_for_training, trainable_parameters
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
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mlp"] == [r["mlp"][0], "LigerSwiGLUMLP"] and r["mlp"][0] != "LigerSwiGLUMLP"  # the kernels are in place
    assert r["logp"] < 1e-4, r  # fp32: same math, other kernels
    assert r["grad"] < 1e-4 * max(r["grad_scale"], 1.0), r
