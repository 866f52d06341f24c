"""A run reads its model's config once: the preflight's read and the memory plan's skeleton share it, and a folder
saved anew is read anew."""

from __future__ import annotations

import os

import torch
import transformers
from transformers import Qwen2Config

from logitless.trainer.checks.model import read_model_config
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.memory.model import model_skeleton


def test_the_model_config_is_read_once_per_process(tmp_path, monkeypatch):
    Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    reads = []
    real = transformers.AutoConfig.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads.append(args[0])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(counted))
    cfg = ModelConfig(name_or_path=str(tmp_path))
    first = read_model_config(cfg)
    first.num_hidden_layers = 7  # a caller's change stays its own
    skeleton = model_skeleton(cfg, dtype=torch.float32)
    assert len(skeleton.model.layers) == 1 and read_model_config(cfg).num_hidden_layers == 1
    assert reads == [str(tmp_path)]

    Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    later = os.stat(tmp_path / "config.json").st_mtime + 5
    os.utime(tmp_path / "config.json", (later, later))
    assert read_model_config(cfg).num_hidden_layers == 3 and len(reads) == 2
