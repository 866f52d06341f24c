"""rollout.device: the rollout decodes from a replica of the policy on a device of its own (merged for LoRA), synced
from the trainer before every rollout.

CPU: naming the training device itself keeps the replica there, which runs every part of the path but the
cross-device copies. A run with the replica samples exactly what the engine's own weights sample and makes the
same updates (merged LoRA, unmerged LoRA, full fine-tuning); the replica is a copy (no storage shared with the
model, tied weights still tied) that follows the trainer only through its sync; with train.async_rollout it
feeds the stale sampler's real logprobs, full fine-tuning included (no merged LoRA copy needed), and a stopped run
resumes exactly (tests/test_trainer_async.py); every setting that cannot go with it is refused before the model
loads, naming both and the fix.
GPU (2 GPUs, `python -m pytest -m gpu tests/test_rollout_device.py`): a step decoding on cuda:1 trains like one
decoding on cuda:0, and the training GPU's generate phase holds neither the cache nor the decode weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitless.trainer.preflight import check_world
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.distributed.parallel import World, copy_to, make_replica
from logitless.trainer.preflight import validate_config
from tests.conftest import tiny_qwen2
from tests.test_trainer import VOCAB, _cfg, _train, _untimed, rewards_module, tok  # noqa: F401 (fixtures)

STATIC = ["rollout.backend=static", "train.max_steps=2", "objective.sampler_is_mode=token_truncate",
          "objective.sampler_is_clip_max=2.0"]
ON_CPU = "rollout.device=cpu"
MODES = {
    "lora_merged": [],
    "lora_unmerged": ["rollout.merge_lora=false"],
    "full": ["model.lora=false", "optim.learning_rate=0.002"],
}
DIFFER = ("rollout/replica_gib", "rollout/weights_copy_gib")  # what the engine decodes from differs by design
TIMED = ("rollout/ceiling_fraction", "train/mfu", "train/tflops_per_s", "step/x_limit")  # ratios to seconds (GPU only)


def _weights(path):
    from safetensors.torch import load_file

    folder = ckpt.resolve_checkpoint(path) / "model"
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _near(value):
    """What a record's value must equal in the other run: a number to 1e-5 (relative), a warning's text exactly."""
    return value if isinstance(value, str) else pytest.approx(value, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_replica_on_the_rollout_device_trains_like_the_engines_own_weights(tmp_path, tok, rewards_module, mode):  # noqa: F811
    own = _train(_cfg(tmp_path / "own", *STATIC, *MODES[mode]), tok)
    rep = _train(_cfg(tmp_path / "rep", *STATIC, *MODES[mode], ON_CPU), tok)
    one, two = _untimed(own.records), _untimed(rep.records)
    assert len(one) == len(two) == 2 and one[0].keys() == two[0].keys()
    assert all(r["rollout/replica_gib"] > 0 for r in two) and all(r["rollout/replica_gib"] == 0 for r in one)
    for a, b in zip(one, two):
        diff = {k: (a[k], b[k]) for k in a if k not in DIFFER and a[k] != _near(b[k])}
        assert not diff
    # the replica is synced before every rollout: the sampler's logprobs are the trainer's (on policy)
    assert all(r["is/logp_diff/max"] < 1e-4 for r in two)
    a, b = _weights(tmp_path / "own"), _weights(tmp_path / "rep")
    assert a.keys() == b.keys() and a
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) <= 1e-6
    assert any(float(v.abs().max()) > 0 for k, v in b.items() if "lora_B" in k or mode == "full")


@pytest.mark.parametrize("merge", [None, False])
def test_the_replica_is_a_copy_that_follows_the_model_only_through_sync(merge):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=2, tie=True),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    replica = make_replica(model, merge, device=torch.device("cpu"))
    source = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert not any(t.untyped_storage().data_ptr() in source for t in [*replica.model.parameters(),
                                                                      *replica.model.buffers()])
    inner = replica.model.get_base_model() if hasattr(replica.model, "get_base_model") else replica.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # tied weights stay tied
    assert not any(p.requires_grad for p in replica.model.parameters())
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        for p in model.parameters():  # a trained adapter: B != 0
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        want = model(input_ids=ids).logits
        stale = replica.model(input_ids=ids).logits
        replica.sync(model)
        got = replica.model(input_ids=ids).logits
    assert (stale - want).abs().max() > 1e-3  # before the sync the replica decodes the old weights
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_copy_to_copies_each_tensor_once_and_keeps_ties():
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1, tie=True)
    copy = copy_to(model, torch.device("meta"))  # straight to the device: nothing materialized on the source's
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu" and not copy.training


ASYNC = ["rollout.backend=static", "train.async_rollout=true", "train.max_steps=4", ON_CPU,
         "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]


def test_async_from_a_replica_samples_and_trains_like_async_from_the_merged_copy(tmp_path, tok, rewards_module):  # noqa: F811
    """The replica is synced where the merged copy is (before update k - 1 for rollout k): same samples, same
    updates, so the stale-sampler correction sees the same logprobs."""
    copy = _train(_cfg(tmp_path / "copy", *[o for o in ASYNC if o != ON_CPU]), tok)
    rep = _train(_cfg(tmp_path / "rep", *ASYNC), tok)
    one, two = _untimed(copy.records), _untimed(rep.records)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        diff = {k: (a[k], b[k]) for k in a if k not in DIFFER and a[k] != _near(b[k])}
        assert not diff
    assert min(r["is/logp_diff"] for r in two[1:]) > 1e-3  # one step off policy from step 2 on


def test_async_full_fine_tuning_samples_from_the_replica_one_step_behind(tmp_path, tok, rewards_module):  # noqa: F811
    run = _train(_cfg(tmp_path / "async", *ASYNC, *MODES["full"]), tok)
    diffs = [r["is/logp_diff"] for r in run.records]
    # step 1 samples the initial weights and trains them; from step 2 on the samples are one update behind
    assert len(diffs) == 4 and diffs[0] < 1e-4 and min(diffs[1:]) > 1e-4, diffs


@pytest.mark.parametrize("overrides, match", [
    (["rollout.backend=hf", "rollout.device=cpu"],  # (with backend auto it means static)
     r"rollout\.device='cpu' needs rollout\.backend=static"),
    (["rollout.backend=static", "rollout.device=auto"], r"rollout\.device=auto: unset rollout\.device"),
    (["rollout.backend=static", "rollout.device=gpu:1"], r"rollout\.device='gpu:1' is not a device"),
    (["rollout.backend=static", "rollout.device=cpu", "rollout.weight_copy=sleep"],
     r"rollout\.weight_copy=sleep cannot run with rollout\.device=cpu: .* set rollout\.weight_copy=resident"),
    (["rollout.backend=static", "rollout.device=cpu", "train.offload_during_rollout=true"],
     r"train\.offload_during_rollout=true cannot run with rollout\.device=cpu: .* saves nothing"),
    (["rollout.backend=static", "rollout.device=cpu", "model.load_in_4bit=true"],
     r"model\.load_in_4bit=true \(QLoRA\) cannot run with rollout\.device=cpu"),
])
def test_settings_that_cannot_go_with_a_rollout_device_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate_config(load_train_config(None, overrides))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 1, reason="needs at most one GPU")
def test_a_missing_rollout_gpu_is_refused_naming_the_devices_there_are():
    overrides = ["rollout.backend=static", f"rollout.device=cuda:{max(torch.cuda.device_count(), 1)}"]
    with pytest.raises(ValueError, match=r"rollout\.device='cuda:\d' but (this machine has no usable CUDA GPU|only)"):
        validate_config(load_train_config(None, overrides))


def test_async_needs_no_merged_lora_copy_with_a_replica_but_does_without():
    full = ["rollout.backend=static", "train.async_rollout=true", "model.lora=false"]
    validate_config(load_train_config(None, [*full, ON_CPU]))  # a replica on its own: accepted
    with pytest.raises(ValueError, match=r"train\.async_rollout=true .* or a replica on its own device"):
        validate_config(load_train_config(None, full))


def test_torchrun_takes_a_rollout_device_no_rank_trains_on_and_refuses_a_training_gpu():
    """Under torchrun rollout.device is the shared rollout GPU (trainer/placement/shared_rollout.py,
    tests/test_shared_rollout.py): a GPU a rank trains on is refused, naming the fix."""
    cfg = load_train_config(None, ["rollout.backend=static", "rollout.device=cpu", "train.prompts_per_step=2",
                                   "model.device=cpu"])
    check_world(cfg, World(rank=0, size=2))
    gpu = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, device="cuda:0"),
                              model=dataclasses.replace(cfg.model, device="auto"))
    with pytest.raises(ValueError, match=r"rollout\.device=cuda:0 under torchrun names a GPU a rank trains on"):
        check_world(gpu, World(rank=0, size=2))


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_a_step_decoding_on_the_second_trains_like_one_decoding_on_the_first(tmp_path, tok, rewards_module):  # noqa: F811
    from logitless.trainer.loop import train

    def run(path, *overrides):  # the model on cuda:0 trains there
        import gc

        gc.collect()  # the run before's compiled model (a reference cycle) is not this run's generate-phase memory
        model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1).to("cuda:0")
        return train(_cfg(path, *overrides), model=model, tokenizer=tok)

    gpu = ["rollout.max_completion_length=32", "train.max_steps=1"]
    one = run(tmp_path / "one", *STATIC, *gpu)
    two = run(tmp_path / "two", *STATIC, *gpu, "rollout.device=cuda:1")
    a, b = _untimed(one.records)[0], _untimed(two.records)[0]
    diff = {k: (a[k], b[k]) for k in a if k not in DIFFER + TIMED and a[k] != pytest.approx(b[k], rel=1e-3, abs=1e-4)}
    assert not diff, diff
    assert two.records[0]["memory/rollout_device_peak_gb"] > 0
    # the training GPU's generate phase holds neither the decode's cache nor its weights
    assert two.records[0]["memory/peak_gb/generate"] < one.records[0]["memory/peak_gb/generate"]
    run3 = run(tmp_path / "async", *ASYNC[:2], gpu[0], "train.max_steps=3", "rollout.device=cuda:1", *ASYNC[4:])
    assert run3.step == 3 and min(r["is/logp_diff"] for r in run3.records[1:]) > 1e-4
