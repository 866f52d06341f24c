"""Atomic checkpoints: exact round trips (LoRA and full model), `latest` pointer, pruning, a full disk mid-write."""

from __future__ import annotations

import errno
import io
import random

import numpy as np
import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import make_optimizer, make_scheduler
from logitless.trainer.config.schema import ModelConfig, OptimConfig
from logitless.trainer.policy.modeling import prepare_for_training, trainable_parameters
from tests.conftest import tiny_qwen2


def _model(lora: bool, seed: int = 0):
    model = tiny_qwen2(vocab_size=96, hidden=32, layers=1, seed=seed)
    return prepare_for_training(model, ModelConfig(lora=lora, lora_r=4, lora_alpha=8))


def _train_a_bit(model, steps: int = 2):
    opt = make_optimizer(trainable_parameters(model), OptimConfig(learning_rate=1e-2))
    sched = make_scheduler(opt, 10, OptimConfig(learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lora", [True, False])
def test_roundtrip_is_exact(tmp_path, lora):
    model = _model(lora)
    opt, sched = _train_a_bit(model)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=sched, trainer_state={"data": {"i": 4}})
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(3))
    saved = _state(model)
    assert ckpt.read_latest(tmp_path) == path and path.name == "step-000003"

    other = _model(lora, seed=1)  # different init: loading must overwrite everything trainable
    opt2, sched2 = _train_a_bit(other, steps=1)
    state = ckpt.load_checkpoint(tmp_path, model=other, optimizer=opt2, scheduler=sched2)
    assert state["step"] == 3 and state["data"] == {"i": 4}
    loaded = _state(other)
    keys = [k for k in saved if "lora_" in k] if lora else list(saved)
    assert keys
    for k in keys:
        assert torch.equal(saved[k], loaded[k]), k
    assert sched2.state_dict() == sched.state_dict()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for i in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[i][name], s2[i][name])
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1] and torch.equal(draws[2], expected_draws[2])


def test_latest_pointer_prune_and_resolve(tmp_path):
    model = _model(True)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path / "checkpoints", step, model=model, optimizer=None, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000002", "step-000003"]
    # run folder, checkpoints folder and a step folder all resolve
    assert ckpt.resolve_checkpoint(tmp_path).name == "step-000003"
    assert ckpt.resolve_checkpoint(tmp_path / "checkpoints").name == "step-000003"
    assert ckpt.resolve_checkpoint(tmp_path / "checkpoints" / "step-000002").name == "step-000002"
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint found"):
        ckpt.resolve_checkpoint(tmp_path / "nothing")


class _FullDisk(io.FileIO):
    """A file whose writes fail with ENOSPC once `budget` bytes have been written (a disk filling up)."""

    budget = 1000

    def __init__(self, path):
        super().__init__(path, "wb")

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if n > _FullDisk.budget:
            super().write(memoryview(data).cast("B")[: _FullDisk.budget])
            _FullDisk.budget = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        _FullDisk.budget -= n
        return super().write(data)


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    model = _model(True)
    opt, sched = _train_a_bit(model)
    ckpt.save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=sched, trainer_state={"tag": "first"})
    saved = _state(model)
    _train_a_bit(model)  # the weights move on
    monkeypatch.setattr(ckpt, "_open_for_write", lambda path: _FullDisk(path))
    with pytest.raises(ckpt.CheckpointError, match="No space left.*step-000001 is still the latest"):
        ckpt.save_checkpoint(root, 2, model=model, optimizer=opt, scheduler=sched, trainer_state={"tag": "second"})
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # no temp folder left behind
    fresh = _model(True, seed=3)
    state = ckpt.load_checkpoint(root, model=fresh)
    assert state["tag"] == "first" and state["step"] == 1
    for k, v in _state(fresh).items():
        if "lora_" in k:
            assert torch.equal(v, saved[k]), k


def test_corrupt_latest_pointer_is_reported(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step-000009")
    with pytest.raises(ckpt.CheckpointError, match="step-000009.*not a complete checkpoint"):
        ckpt.resolve_checkpoint(root)
