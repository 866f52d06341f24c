"""The static backend's replica under torchrun, checked on one process (a plain tensor stands in for a DTensor
shard; the 2-rank path is in test_parallel.py): a merged LoRA replica samples what the PEFT policy computes,
follows adapter updates through `sync`, keeps its addresses, and holds no second copy of the LoRA layers."""

from __future__ import annotations

import pytest
import torch

from logitless.rollout import make_engine
from logitless.rollout.weights import lora_layers
from logitless.trainer.distributed.parallel import MergedRolloutCopy, RolloutCopy, make_replica

from tests.test_rollout_families import TOK
from tests.test_rollout_weights import OPTS, PROMPTS, TARGETS, lora_model, peft_logprobs, perturb


@pytest.mark.parametrize("family", list(TARGETS))
def test_merged_replica_samples_what_the_peft_policy_computes(family, one_thread):
    model = lora_model(family)
    replica = make_replica(model, merge_lora=None)
    assert isinstance(replica, MergedRolloutCopy) and not lora_layers(replica.model)
    # the size of the model without adapters: no copy of the LoRA layers beside the merged ones
    base_numel = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    assert sum(p.numel() for p in replica.model.parameters()) == base_numel
    addresses = [p.data_ptr() for p in replica.model.parameters()]
    eng = make_engine("static", replica.model, TOK, check_every=4)
    for step in range(2):
        replica.sync(model)
        b = eng.generate(PROMPTS, OPTS)
        lp = peft_logprobs(model, b)
        torch.testing.assert_close(b.sampler_logp, lp, atol=1e-4, rtol=0)
        with model.disable_adapter():  # the check can fail: unmerged base weights give other logprobs
            assert (peft_logprobs(model, b) - lp).abs().max() > 1e-2
        perturb(model, step + 1)  # an optimizer step; a replica not synced would sample the old policy
    assert [p.data_ptr() for p in replica.model.parameters()] == addresses


def test_replica_kind_follows_merge_lora_and_what_is_trainable():
    model = lora_model("llama")
    assert isinstance(make_replica(model, merge_lora=None), MergedRolloutCopy)
    assert isinstance(make_replica(model, merge_lora=True), MergedRolloutCopy)
    assert type(make_replica(model, merge_lora=False)) is RolloutCopy  # the user asked for unmerged adapters
    # a trainable parameter outside the adapters would be frozen in a merged replica: keep the policy as is
    next(p for n, p in model.named_parameters() if "embed_tokens" in n).requires_grad_(True)
    assert type(make_replica(model, merge_lora=None)) is RolloutCopy
    from tests.test_rollout_families import make_model

    assert type(make_replica(make_model("llama"), merge_lora=None)) is RolloutCopy  # full fine-tuning
