"""rollout.device under torchrun (trainer/placement/shared_rollout.py): rank 0 decodes every rank's prompts on a device no rank
trains on and hands each rank its rows. Against the same runs where every rank decodes its own share from a replica of
its own (same seeds, so the same samples): the same metrics and weights, LoRA with an eval, full fine-tuning with
uneven shares, async rollouts with an exact resume; a failed decode ending every rank; refusals; the memory model's
phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from logitless.trainer.preflight import check_world
from logitless.trainer import dcp
from logitless.trainer.memory import plan as mp
from logitless.trainer.memory import ranks as mr
from logitless.trainer.distributed.parallel import World
from logitless.trainer.placement.shared_rollout import check_shared_rollout
from logitless.trainer.memory.auto import model_memory
from logitless.trainer.config.schema import load_train_config
from tests import dist_worker as w
from tests.conftest import tiny_qwen2
from tests.test_parallel import close, torchrun, weights

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
RANK_ONLY = ("rollout/replica_gib",)  # rank 0 holds the replica, the others none


@pytest.fixture(scope="module")
def tok_dir(gpt2_tokenizer_dir):
    return gpt2_tokenizer_dir


def check_shared(out: Path, rel: float = 0.0, abs_: float = 0.0, cuda: bool = False) -> None:
    """The "shared" scenario (`dist_worker.shared_runs`): each run with rank 0 decoding for both ranks logs what the
    run with a replica per rank logs (exactly; within `rel`/`abs_` where given), but the eval after step 2 (each rank
    evaluated its own rows there, in other chunks); the eval before training is one process's eval; the async run
    stopped after step 3's rollout and resumed continues like the uninterrupted one, each rank's pending rows in its
    own checkpoint file. On GPUs (`cuda`) the scenario runs LoRA and async only, without the resume."""
    names = ("lora", "async") if cuda else ("lora", "full", "async")
    same = (lambda a, b: a == b) if not rel else (lambda a, b: close(a, b, rel=rel, abs_=abs_))
    for rank in (0, 1):
        r = json.loads((out / f"shared_rank{rank}.json").read_text())
        for name in names:
            own, shared = w.untimed(r[f"{name}_own"]), w.untimed(r[f"{name}_shared"])
            assert len(own) == len(shared) == {"lora": 4, "full": 3, "async": 4}[name]  # lora: an eval at step 0
            for a, b in zip(own, shared):
                keys = [k for k in a if k not in RANK_ONLY and not (k.startswith("eval/") and a["step"] > 0)]
                assert a.keys() == b.keys()
                diff = {k: (a[k], b[k]) for k in keys if not same(a[k], b[k])}
                assert not diff, (name, a["step"], diff)
            replica = [x["rollout/replica_gib"] for x in shared if x["step"] > 0]
            assert all(x > 0 for x in replica) if rank == 0 else replica == [0.0] * len(replica)
        assert r["lora_shared"][-1]["kl"] > 1e-3 and (cuda or r["full_shared"][-1]["kl"] > 0)  # the policies moved
        diffs = [x["is/logp_diff"] for x in r["async_shared"]]  # one update behind from step 2 on
        assert diffs[0] < 1e-4 and min(diffs[1:]) > 1e-3, diffs
        evals = [x for x in r["lora_shared"] if "eval/reward" in x]
        assert [x["step"] for x in evals] == [0, 2, 3]  # before training, every 2 steps and at the end
        if rank == 0:
            one = r["one_process_eval"]
            assert one.keys() <= evals[0].keys() and all(same(one[k], evals[0][k]) for k in one), (one, evals[0])
        if cuda:
            continue
        assert r["cut_step"] == 2
        assert len(r["cut"]) + len(r["resumed"]) == 4
        for a, b in zip(w.untimed(r["cut"] + r["resumed"]), w.untimed(r["async_shared"]), strict=True):
            assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a), (a, b)
    if not cuda:
        step = out / "async_cut" / "checkpoints" / "step-000002"
        pending = [json.loads((step / dcp.rank_state_file(k)).read_text())["prefetch"] for k in (0, 1)]
        assert [p["step"] for p in pending] == [3, 3] and pending[0]["batch"] != pending[1]["batch"]
    for name in names:
        a, b = weights(out / f"{name}_own"), weights(out / f"{name}_shared")
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) if not rel else torch.allclose(a[k], b[k], rtol=rel, atol=abs_) for k in a)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory, tok_dir, one_thread):
    """One launch of 2 ranks for the "shared" and "shared_failure" scenarios (one process start for both)."""
    out = tmp_path_factory.mktemp("shared")
    proc = torchrun("shared,shared_failure", out, tok_dir, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out


def test_two_ranks_with_rank0_decoding_for_both_train_as_with_a_replica_each(shared_runs):
    """On CPU (gloo), rollout.device=cpu: the union decode draws each rank's rows from that rank's streams, so the
    samples, metrics and weights are bitwise those of each rank decoding its own share."""
    check_shared(shared_runs)


@pytest.mark.gpu
@pytest.mark.three_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs")
def test_three_gpus_rank0_decoding_on_the_third_trains_as_with_a_replica_each(tmp_path, tok_dir, monkeypatch):
    """2 ranks on GPUs 0 and 1 (nccl), rollout.device=cuda:2: rank 0's decode process (its compiled decode and step
    graphs on the third GPU, from the replica shared by CUDA IPC; Liger's kernels in the trained model) against each
    rank's own compiled decode, LoRA with an eval and async rollouts. Within 1e-4: the union batch's kernels are not
    the shares' (batch sizes pick other GEMM tilings)."""
    monkeypatch.setenv("LOGITLESS_TEST_CUDA", "1")
    proc = torchrun("shared", tmp_path, tok_dir, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_shared(tmp_path, rel=1e-4, abs_=1e-5, cuda=True)


def test_a_decode_process_that_dies_fails_every_rank_with_the_reason(shared_runs):
    for rank in (0, 1):
        assert (shared_runs / f"failure_rank{rank}.txt").read_text() == (
            "rollout.device: rank 0's rollout of every rank's prompts failed: RuntimeError: the rollout's decode "
            "process ended (exit code -9)")


def _cfg(*overrides):
    return w.config("unused", "rollout.backend=static", *overrides)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.device=cuda:1"], r"rollout.device=cuda:1 under torchrun names a GPU a rank trains on \(ranks use "
                                r"cuda:0..cuda:2\); name a GPU no rank uses, e.g. rollout.device=cuda:3"),
    (["rollout.device=cuda"], r"rollout.device=cuda under torchrun names a GPU a rank trains on"),
    (["rollout.device=cpu", "model.device=cuda"], r"rollout.device=cpu under torchrun with ranks training on GPUs"),
    (["rollout.device=cuda:3", "rollout.tensor_parallel=3"], r"rollout.tensor_parallel=3 cannot run with"),
    (["rollout.device=cuda:3", "agent.tools=[calculator]"], r"agent.tools / agent.environment .* cannot run with"),
    (["rollout.device=cuda:3", "train.fsdp_offload=true"], r"train.fsdp_offload=true cannot run with"),
])
def test_a_shared_rollout_device_that_cannot_work_is_refused(overrides, match):
    if "cuda" in " ".join(overrides) and "model.device=cuda" not in overrides:
        overrides = [*overrides, "model.device=auto"]
    with pytest.raises(ValueError, match=match):
        check_shared_rollout(_cfg(*overrides), ranks=3, local_ranks=3)


def test_a_shared_rollout_device_that_can_work_passes():
    check_shared_rollout(_cfg("rollout.device=cuda:3", "model.device=auto"), ranks=3, local_ranks=3)
    check_shared_rollout(_cfg("rollout.device=cuda:1"), ranks=1, local_ranks=1)  # one process: rollout.device as ever
    check_shared_rollout(_cfg("rollout.device=cpu", "model.device=cpu"), ranks=2, local_ranks=2)
    check_world(_cfg("rollout.device=cpu", "model.device=cpu"), World(rank=0, size=2))


def test_the_memory_model_puts_the_replica_and_kv_cache_on_the_rollout_gpu():
    """Ranks(rollout_gpu=True): the training GPUs hold no replica and no KV cache (their rollout phase is the sync's
    gathered unit and fp32 merge beside the shards), the rollout GPU the replica and the whole step's KV cache."""
    model = tiny_qwen2(vocab_size=1000, hidden=48, layers=3, tie=False).to(torch.bfloat16)
    cfg = load_train_config(None, ["model.lora=true", "model.lora_r=4"])
    m, units = model_memory(model, cfg.model, torch.bfloat16), mr.units_of(model)
    step = mp.StepShape(prompts=6, rows=24, prompt_len=37, completion_len=50)
    facts, knobs = mp.RunFacts(backend="static"), mp.Knobs(micro_batch_size=3, by_rows=True)
    plain = mr.predict(m, step, facts, knobs, mr.Ranks(3, units, weight_copy="resident"))
    shared = mr.predict(m, step, facts, knobs, mr.Ranks(3, units, weight_copy="resident", rollout_gpu=True))
    assert set(shared) == {"generate", "train", mr.ROLLOUT_DEVICE}
    assert not any(k.startswith(("replica", "kv")) for p in ("generate", "train") for k in shared[p])
    device = shared[mr.ROLLOUT_DEVICE]
    assert device["replica (whole)"] == m.weight_bytes
    whole = mp.generate_bytes(m, step, facts, knobs)["kv cache"]
    assert device["kv cache"] == whole and whole >= 3 * plain["generate"]["kv cache"]  # the step's, not a third
    assert mr.training_peak(shared) < mr.training_peak(plain)
    assert shared["train"] == {k: v for k, v in plain["train"].items() if k != "replica (mapped)"}


def test_the_decode_process_decodes_what_an_engine_in_this_process_decodes(tok_dir):
    """rank 0's decode process (`rollout_worker.DecodeWorker`) on a model whose MLP forwards a kernel patch rebound
    (`modeling.outside_compile`, as Liger's kernels are), whose layers were compiled in place and whose embedding
    has gradient checkpointing's input hook: the same tokens and
    logprobs as the static engine on the plain model in this process; the replica's later in-place writes are seen
    there (its memory is shared, not copied)."""
    import types

    from logitless.models.lm_head import decoder_layers
    from logitless.trainer.policy import modeling
    from logitless.trainer.placement.engines import make_rollout_engine, sampling_options
    from logitless.trainer.placement.rollout_worker import DecodeWorker

    tok, cfg = w.tokenizer(tok_dir), w.config("unused", "rollout.backend=static").rollout
    options = sampling_options(cfg, seed=11, chat_template_kwargs=None)
    prompts = ["12+7=", "3*4=", "100-1="]
    plain = w.model()
    patched = w.model()
    patched.load_state_dict(plain.state_dict())

    def patch():  # as Liger's kernels bind their forwards, and lambdas as `_get_name`
        for layer in decoder_layers(patched):
            layer.mlp.forward = types.MethodType(type(layer.mlp).forward, layer.mlp)
            layer.mlp._get_name = types.MethodType(lambda self: "KernelMLP", layer.mlp)

    modeling.outside_compile(patched, types.ModuleType("unused"), patch)
    modeling.compile_layers(patched)
    patched.gradient_checkpointing_enable()
    patched.enable_input_require_grads()  # a forward hook that is a local function
    worker = DecodeWorker(patched, cfg, tok, timeout_s=600)
    try:
        for _ in range(2):
            worker.submit(prompts, options)
            got, want = worker.result(), make_rollout_engine(cfg, plain, tok).generate(prompts, options)
            assert torch.equal(got.completion_ids, want.completion_ids) and got.completions == want.completions
            assert torch.equal(got.sampler_logp, want.sampler_logp)
            with torch.no_grad():  # the next "sync": both weights moved alike, in place
                for a, b in zip(plain.parameters(), patched.parameters()):
                    a.mul_(1.5)
                    b.mul_(1.5)
        assert not torch.equal(got.sampler_logp, make_rollout_engine(cfg, plain, tok).generate(prompts, options).sampler_logp)
    finally:
        worker.close()
    assert worker.proc.returncode == 0


def test_a_decode_process_that_hangs_is_ended_within_its_bound_with_the_reason(tok_dir, capfd):
    """A decode past its bound prints its stacks and ends (faulthandler in the child); one that cannot (stopped, or
    stuck in native code) is ended by rank 0 a second later. Either way result() raises naming the setting, which
    every rank then raises (`test_a_decode_process_that_dies_fails_every_rank_with_the_reason`)."""
    import dataclasses
    import os
    import signal
    import time

    from logitless.trainer.placement.engines import sampling_options
    from logitless.trainer.placement.rollout_worker import DecodeWorker

    tok = w.tokenizer(tok_dir)
    cfg = dataclasses.replace(w.config("unused", "rollout.backend=static").rollout, max_completion_length=64)
    options = sampling_options(cfg, seed=11, chat_template_kwargs=None)
    for how, bound, why in [("slow", 0.01, r"did not answer within 0.01 s \(half of train.collective_timeout_s; "
                                           r"raise it for longer rollouts\) and ended, printing its stacks"),
                            ("stopped", 1.0, r"did not answer within 1 s .*; it was ended \(exit code -9\)")]:
        worker = DecodeWorker(w.model(), cfg, tok, timeout_s=600)
        try:
            worker.submit(["1+1="], options)  # the process started and ready: the bound is the decode's alone
            worker.result()
            worker.timeout_s = bound
            worker.submit(["12+7=", "3*4="] * 8, options)
            if how == "stopped":
                os.kill(worker.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="the rollout's decode process " + why):
                worker.result()
            assert time.monotonic() - t0 < bound + 10.0
        finally:
            worker.close()
    assert "Thread 0x" in capfd.readouterr().err  # the slow decode's stacks, from the child
