"""train.async_rollout: the next step's rollout runs during the update, one step off policy. The objective gets
the rollout's real sampler logprobs (stale by one update, so |logp - sampler_logp| > 0 where the synchronous run
has 0), the samples of step k come from the weights after update k - 2, and a run stopped and resumed takes
exactly the samples and makes exactly the updates of the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch

from logitless.rollout.static import StaticEngine
from logitless.rollout.weights import MergedLoraWeights
from logitless.trainer import checkpoint as ckpt
from tests.test_trainer import _cfg, _lora, _train, _untimed, rewards_module, tok  # noqa: F401 (fixtures)

ASYNC = ["rollout.backend=static", "train.async_rollout=true", "train.max_steps=4",
         "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]


def test_async_rollout_feeds_the_stale_samplers_real_logprobs(tmp_path, tok, rewards_module, monkeypatch):  # noqa: F811
    batches, synced = [], []
    real_generate, real_sync = StaticEngine.generate, MergedLoraWeights.sync

    def generate(self, prompts, options):  # records what the engine returned, unchanged
        b = real_generate(self, prompts, options)
        batches.append(b)
        return b

    def sync(self):  # records the adapter weights each rollout samples from
        real_sync(self)
        synced.append({id(layer): [p.detach().clone() for p in layer.parameters() if p.requires_grad]
                       for layer, _ in self._pairs})

    monkeypatch.setattr(StaticEngine, "generate", generate)
    monkeypatch.setattr(MergedLoraWeights, "sync", sync)
    run = _train(_cfg(tmp_path / "async", *ASYNC, "checkpoint.save_steps=1"), tok)
    async_syncs = synced[:]  # the async run's syncs only
    sync_run = _train(_cfg(tmp_path / "sync", *ASYNC[:1], *ASYNC[2:]), tok)
    assert run.step == 4 and len(batches) == 4 + 4  # 4 async rollouts, then the synchronous run's 4
    diffs = [r["is/logp_diff"] for r in run.records]
    # step 1 samples the initial weights and trains them; from step 2 on the samples are one update behind
    assert diffs[0] < 1e-4 and min(diffs[1:]) > 1e-3, diffs
    assert max(r["is/logp_diff"] for r in sync_run.records) < 1e-4
    # rollout k (k >= 2) was synced before update k - 1: its adapters are those of checkpoint k - 2
    assert len(async_syncs) == 1 + 4  # the copy's construction, then one sync per rollout (synced[k]: rollout k)
    for k in (3, 4):
        saved = _lora(tmp_path / "async" / "checkpoints" / f"step-{k - 2:06d}")
        flat = sorted(float(v.double().sum()) for v in saved.values())
        seen = sorted(float(p.double().sum()) for ps in async_syncs[k].values() for p in ps)
        assert flat == pytest.approx(seen, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("where", [[], ["rollout.device=cpu"]], ids=["merged_copy", "replica_on_rollout_device"])
def test_async_resume_after_a_stop_is_exact(tmp_path, tok, rewards_module, where):  # noqa: F811
    run = [*ASYNC, *where]  # the engine's merged-LoRA copy, or a replica on rollout.device (tests/test_rollout_device.py)
    full = _train(_cfg(tmp_path / "full", *run), tok)

    def hook(event, step):
        if event == "after_rollout" and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    cut = _train(_cfg(tmp_path / "cut", *run), tok, hook=hook)
    assert cut.step == 2 and ckpt.read_latest(tmp_path / "cut" / "checkpoints").name == "step-000002"
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["prefetch"]["step"] == 3  # the dropped step's rollout travels with the checkpoint
    resumed = _train(_cfg(tmp_path / "cut", *run), tok, resume=tmp_path / "cut")
    assert resumed.step == 4
    assert _untimed(cut.records + resumed.records) == _untimed(full.records)
    a, b = _lora(tmp_path / "full"), _lora(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_rollout_needs_a_weight_copy(tmp_path, tok, rewards_module):  # noqa: F811
    with pytest.raises(ValueError, match=r"train\.async_rollout=true .* rollout\.backend=static"):
        _train(_cfg(tmp_path / "x", "train.async_rollout=true", "rollout.backend=hf"), tok)  # (auto: static)
    with pytest.raises(ValueError, match=r"train\.async_rollout=true"):
        _train(_cfg(tmp_path / "y", *ASYNC, "rollout.merge_lora=false"), tok)


def test_a_compile_on_one_thread_does_not_fail_a_compiled_call_on_the_other():
    """torch.compile's FX tracing sets a process-wide flag; a compiled function (the decode step, the sampler)
    called on the rollout thread while the update's thread traces (model.compile_layers' first micro-batch)
    raised "Detected that you are using FX to symbolically trace a dynamo-optimized function" (seen on a GPU).
    Here the main thread is inside a real FX trace while the rollout runs a compiled function and finishes."""
    from logitless.data import PromptRow, PromptSampler
    from logitless.rollout import SamplingOptions
    from logitless.trainer.placement.async_rollout import AsyncRollout

    double = torch.compile(lambda x: x * 2, backend="eager")

    class Weights:  # a weight copy of its own (not LiveWeights), as the real engine's merged copy
        def sync(self):
            pass

    class Engine:
        weights = Weights()

        def generate(self, prompts, options):
            return double(torch.arange(len(prompts)))

    rows = [PromptRow(prompt=f"p{i}", fields={"answer": str(i)}) for i in range(4)]
    prefetch = AsyncRollout(Engine(), PromptSampler(rows, seed=0), 2, torch.device("cpu"))

    class TracedWhileTheRolloutRuns(torch.nn.Module):
        def forward(self, x):
            prefetch.start(1, SamplingOptions(max_new_tokens=4))
            prefetch.pending.future.result()  # the rollout runs to its end inside this trace
            return x + 1

    tracing, called = threading.Event(), threading.Event()

    class WaitsForTheMainThread(torch.nn.Module):
        def forward(self, x):
            tracing.set()
            called.wait(timeout=60)
            return x

    try:
        torch.fx.symbolic_trace(TracedWhileTheRolloutRuns())
        _, batch, _ = prefetch.take(1)
        # and the other way round: the rollout thread traces while the main thread (the update) calls
        Engine.generate = lambda self, prompts, options: torch.fx.symbolic_trace(WaitsForTheMainThread())
        prefetch.start(2, SamplingOptions(max_new_tokens=4))
        assert tracing.wait(timeout=60)
        main = double(torch.ones(2))
        called.set()
        prefetch.take(2)
    finally:
        called.set()
        prefetch.close()
    assert batch.tolist() == [0, 2] and main.tolist() == [2.0, 2.0]
    assert torch._dynamo.config.error_on_nested_fx_trace  # the process's setting is back after the run
    torch._dynamo.reset()


@pytest.mark.gpu
def test_async_rollout_runs_on_a_high_priority_stream():
    """The rollout beside the update runs on a CUDA stream of the highest priority (the GPU starts its queued
    decode kernels before the update's), not on the default stream."""
    from logitless.data import PromptRow, PromptSampler
    from logitless.rollout import SamplingOptions
    from logitless.trainer.placement.async_rollout import ROLLOUT_STREAM_PRIORITY, AsyncRollout

    seen = []

    class Weights:  # a weight copy of its own (not LiveWeights), as the real engine's merged copy
        def sync(self):
            pass

    class Engine:
        weights, max_kv_gib = Weights(), 1.0

        def generate(self, prompts, options):
            s = torch.cuda.current_stream()
            seen.append((s.priority, s == torch.cuda.default_stream()))
            return "batch"

    device = torch.device("cuda")
    rows = [PromptRow(prompt=f"p{i}", fields={"answer": str(i)}) for i in range(4)]
    low, high = torch.cuda.Stream.priority_range()
    assert high <= ROLLOUT_STREAM_PRIORITY < low  # a priority above the default stream's (0)
    prefetch = AsyncRollout(Engine(), PromptSampler(rows, seed=0), 2, device)
    try:
        prefetch.start(1, SamplingOptions(max_new_tokens=4))
        _, batch, _ = prefetch.take(1)
    finally:
        prefetch.close()
    assert batch == "batch" and seen == [(ROLLOUT_STREAM_PRIORITY, False)]


def test_under_torchrun_async_rollouts_need_the_static_backend_only(monkeypatch, rewards_module):  # noqa: F811
    """Under torchrun every rank decodes from a replica of its own, so full fine-tuning and an unmerged LoRA
    replica may run async too; the hf rollout (which all-gathers the sharded model) is refused, naming the fix."""
    from logitless.trainer.preflight import validate_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    for extra in (["model.lora=false"], ["rollout.merge_lora=false"]):
        validate_config(_cfg("unused", *ASYNC, *extra))
    with pytest.raises(ValueError, match=r"train\.async_rollout=true .* rollout\.backend=static \(got 'hf'\)"):
        validate_config(_cfg("unused", *ASYNC, "rollout.backend=hf"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"train\.async_rollout=true .* model\.lora=true \(got False\)"):
        validate_config(_cfg("unused", *ASYNC, "model.lora=false"))
