"""The trainer's rollout on backend "static": a merged-LoRA copy synced after every optimizer step (the
sampler's logprobs equal the trained model's), rows in waves under rollout.max_kv_gib, per-part timings, and the
config checks of the static-only settings."""

from __future__ import annotations

import pytest

from logitless.rollout.weights import MergedLoraWeights
from tests.test_trainer import _cfg, _train, rewards_module, tok  # noqa: F401 (fixtures)

STATIC = ["rollout.backend=static", "rollout.merge_lora=true", "rollout.max_kv_gib=0.00004",  # 2 rows of 16 KiB a wave
          "rollout.profile=true", "rollout.length_buckets=3", "rollout.compact_finished=true", "train.max_steps=3",
          "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]


def logp_diff(record: dict) -> float:
    return record["is/logp_diff"]


def test_static_merged_rollout_in_training(tmp_path, tok, rewards_module):  # noqa: F811
    run = _train(_cfg(tmp_path / "run", *STATIC), tok)
    assert run.step == 3
    for r in run.records:
        # the objective's |logp_train - sampler_logp| at the update: the merged copy followed every optimizer step
        assert logp_diff(r) < 1e-4, r
        assert r["rollout/weights_copy_gib"] > 0
        assert {"rollout/prefill_s", "rollout/forward_s", "rollout/sample_s"} <= r.keys()


def test_a_stale_merged_copy_is_detected(tmp_path, tok, rewards_module, monkeypatch):  # noqa: F811
    """The check above can fail: a copy that is never synced after the first rollout lags the trained model."""
    real = MergedLoraWeights.sync
    calls = []

    def once(self):
        if not calls:
            real(self)
        calls.append(1)

    monkeypatch.setattr(MergedLoraWeights, "sync", once)
    run = _train(_cfg(tmp_path / "stale", *STATIC), tok)
    assert logp_diff(run.records[0]) < 1e-4 and max(logp_diff(r) for r in run.records[1:]) > 1e-3


@pytest.mark.parametrize("setting", ["rollout.max_kv_gib=1", "rollout.merge_lora=true", "rollout.profile=true",
                                     "rollout.length_buckets=4", "rollout.compact_finished=true"])
def test_static_only_settings_need_the_static_backend(tmp_path, setting):
    name = setting.split("=")[0]
    with pytest.raises(ValueError, match=rf"{name}=.* needs rollout\.backend=static"):
        _cfg(tmp_path / "x", "rollout.backend=hf", setting)
