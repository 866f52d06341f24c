"""train.fsdp_offload: FSDP2 with CPU offload (ZeRO-3 offload), on one process through a 1-rank group it makes
itself (trainer/distributed/fsdp_offload.py).

CPU (gloo): a step with the option leaves the same parameters and logs the same metrics as without it, for full
fine-tuning (static backend's replica, reference copy, μ = 2, clipping, gradient checkpointing) and LoRA (hf
backend's all-gather, packed micro-batches, activation offload, parked state; the static backend's merged-LoRA
replica); an interrupted run resumes exactly
from its sharded checkpoint; a checkpoint of the other layout is refused; every setting that cannot run with it
is refused before the model loads, naming both settings and the fix. The 2-rank run with the option is a mode of
tests/test_parallel.py. GPU (`python -m pytest -m gpu tests/test_fsdp_offload.py`): one step on one GPU (nccl +
gloo 1-rank group, host shards synced into the static backend's replica) trains like the plain run and its update
peaks lower.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch
import torch.distributed as dist

from logitless.trainer import checkpoint as ckpt
from logitless.trainer import dcp
from logitless.trainer.distributed.fsdp_offload import check_fsdp_offload
from logitless.trainer.loop import train
from logitless.trainer.distributed.fsdp_offload import reduces_host_tensors
from logitless.trainer.distributed.parallel import init_distributed
from tests import dist_worker as w
from tests.test_parallel import close, weights

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
OFFLOAD = "train.fsdp_offload=true"
MODES = {
    "full": ["model.lora=false", "optim.learning_rate=0.002", "model.gradient_checkpointing=true",
             "objective.beta=0.04", "train.num_iterations=2", "rollout.backend=static",
             "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"],
    "lora": ["train.packed=true", "rollout.max_prompt_length=48", "train.micro_batch_tokens=160",
             "model.gradient_checkpointing=true", "model.activation_offload=true", "train.offload_during_rollout=true"],
    # the merged-LoRA replica, its base weights and adapters gathered from the host shards
    "lora_static": ["rollout.backend=static", "objective.sampler_is_mode=token_truncate",
                    "objective.sampler_is_clip_max=2.0"],
    # the same replica on rollout.device (here the training device itself: the path without the cross-GPU copies)
    "lora_static_rollout_device": ["rollout.backend=static", "objective.sampler_is_mode=token_truncate",
                                   "objective.sampler_is_clip_max=2.0", "rollout.device=cpu"],
}
REPLICA = ("rollout/replica_gib", "rollout/weights_copy_gib")  # what the engine decodes from differs by design


@pytest.fixture(scope="module")
def tok(gpt2_tokenizer_dir):
    return w.tokenizer(gpt2_tokenizer_dir)


def _run(path, tok, *overrides, model=None, **kw):
    return train(w.config(path, *overrides), model=model if model is not None else w.model(), tokenizer=tok, **kw)


@pytest.mark.parametrize("mode", list(MODES))
def test_one_process_with_fsdp_offload_trains_like_without(tmp_path, tok, mode, one_thread):
    plain = _run(tmp_path / "plain", tok, *MODES[mode])
    off = _run(tmp_path / "offload", tok, *MODES[mode], OFFLOAD)
    assert not dist.is_initialized()  # the run's own 1-rank group is gone with the run
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "offload")
    assert a.keys() == b.keys() and a
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    before = w.model().state_dict()
    assert any(("lora_B" in k and a[k].abs().max() > 0) or (k in before and not torch.equal(a[k], before[k]))
               for k in a)  # the step changed the weights
    one, two = w.untimed(plain.records), w.untimed(off.records)
    assert len(one) == len(two) == 1 and one[0].keys() == two[0].keys()
    diff = {k: (one[0][k], two[0][k]) for k in one[0] if k not in REPLICA and not close(one[0][k], two[0][k])}
    assert not diff
    assert one[0]["grad_norm"] > 0.05  # clipping was active (max_grad_norm=0.05) on the host gradients
    if "rollout.backend=static" in MODES[mode]:  # decoded from a replica synced from the host shards
        assert two[0]["rollout/replica_gib"] > 0 and two[0]["is/logp_diff/max"] < 1e-4
    assert mode != "full" or two[0]["kl"] > 0  # the reference copy and the second optimizer step took part
    step = ckpt.resolve_checkpoint(tmp_path / "offload")
    assert (step / dcp.DCP_DIR).is_dir() and dcp.saved_world_size(step) == 1  # sharded, by one rank


def test_sigterm_and_resume_with_fsdp_offload_continue_like_an_uninterrupted_run(tmp_path, tok, one_thread):
    over = [*MODES["full"][:3], *MODES["full"][5:], "train.max_steps=3", OFFLOAD]  # static backend, no KL, μ = 1
    full = _run(tmp_path / "full", tok, *over)
    # the replica is synced from the host shards before every rollout: the sampler's logprobs are the trainer's
    assert all(r["is/logp_diff/max"] < 1e-4 for r in full.records)

    def hook(event, step):
        if event == "after_rollout" and step == 2:
            signal.raise_signal(signal.SIGTERM)

    cut = _run(tmp_path / "cut", tok, *over, hook=hook)
    assert cut.interrupted == signal.SIGTERM and cut.step == 1
    resumed = _run(tmp_path / "cut", tok, *over, resume=tmp_path / "cut")
    assert w.untimed(cut.records + resumed.records) == w.untimed(full.records) and len(full.records) == 3
    a, b = weights(tmp_path / "full"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


def test_a_checkpoint_of_the_other_layout_is_refused_naming_the_setting(tmp_path, tok, one_thread):
    """One process with the option writes sharded (DCP) checkpoints, without it plain ones; a resume across is
    refused, naming the value of train.fsdp_offload that reads the checkpoint."""
    over = [*MODES["full"][:2], "train.max_steps=1"]
    _run(tmp_path / "sharded", tok, *over, OFFLOAD)
    _run(tmp_path / "plain", tok, *over)
    with pytest.raises(ckpt.CheckpointError, match=r"is sharded \(written with train.fsdp_offload=true\).*resume it "
                                                   r"with train.fsdp_offload=true"):
        _run(tmp_path / "sharded", tok, *over, "train.max_steps=2", resume=tmp_path / "sharded")
    assert not dist.is_initialized()
    with pytest.raises(ckpt.CheckpointError, match=r"holds one process's unsharded state.*resume it with "
                                                   r"train.fsdp_offload=false"):
        _run(tmp_path / "plain", tok, *over, "train.max_steps=2", OFFLOAD, resume=tmp_path / "plain")
    assert not dist.is_initialized()  # the run's own group is gone after a failure too


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["optim.optimizer=adamw_8bit"], r"optim.optimizer=adamw_8bit cannot run with train.fsdp_offload=true: .*; "
                                         r"set optim.optimizer=adamw .* or train.fsdp_offload=false"),
        (["optim.optimizer=adamw_cpu_offload"], r"optim.optimizer=adamw_cpu_offload cannot run with "
                                                r"train.fsdp_offload=true: .*set optim.optimizer=adamw"),
        (["model.load_in_4bit=true"], r"model.load_in_4bit=true \(QLoRA\) cannot run with train.fsdp_offload=true: "
                                      r".*; set model.load_in_4bit=false or train.fsdp_offload=false"),
        (["model.liger_kernels=true"], r"model.liger_kernels=true cannot run with train.fsdp_offload=true: .*; set "
                                       r"model.liger_kernels=false or train.fsdp_offload=false"),
        (["train.async_rollout=true", "rollout.backend=static"],
         r"train.async_rollout=true cannot run with train.fsdp_offload=true: .*; set train.async_rollout=false"),
        (["rollout.backend=continuous"], r"rollout.backend=continuous cannot run with train.fsdp_offload=true: .*; "
                                         r"set rollout.backend=static \(or hf\) or train.fsdp_offload=false"),
        (["rollout.backend=static", "rollout.weight_copy=in_place"],
         r"rollout.weight_copy=in_place cannot run with train.fsdp_offload=true: .*; set rollout.weight_copy=sleep"),
        (["model.device=mps"], r"model.device='mps': train.fsdp_offload=true shards with FSDP2, which runs on cpu or "
                               r"cuda; set model.device=cuda \(or auto\) or train.fsdp_offload=false"),
    ],
)
def test_settings_that_cannot_run_with_fsdp_offload_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_fsdp_offload(w.config("unused", *overrides, OFFLOAD))
    check_fsdp_offload(w.config("unused", *overrides))  # without the option: not this check's business


def test_a_refused_setting_fails_before_the_run_folder_is_claimed(tmp_path, tok):
    with pytest.raises(ValueError, match=r"optim.optimizer=adamw_8bit cannot run with train.fsdp_offload=true"):
        _run(tmp_path / "run", tok, "model.lora=false", "optim.optimizer=adamw_8bit", OFFLOAD)
    assert not (tmp_path / "run").exists() and not dist.is_initialized()


@pytest.mark.parametrize("config, host", [("nccl", False), ("cuda:nccl", False), ("cuda:gloo", False), ("gloo", True),
                                          ("cpu:gloo,cuda:nccl", True), ("cuda:nccl, cpu:gloo", True), ("mpi", True)])
def test_which_process_groups_reduce_host_tensors(config, host):
    assert reduces_host_tensors(config) is host


def test_torchruns_group_on_cuda_can_reduce_a_later_offloaded_runs_host_gradients(monkeypatch):
    """Under torchrun the group outlives the run that made it. On 2 GPUs the equivalence worker's first run (no
    offload) made an nccl-only group, and its train.fsdp_offload run then failed at the gradient norm of its host
    DTensors ("No backend type associated with device type cpu"): a run on CUDA joins gloo for host tensors too.
    (The decision only, with torch.distributed's init recorded: this machine may have no GPU.)"""
    made: list[str] = []
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(backend))
    init_distributed("auto", offload=False)
    assert len(made) == 1 and "cuda:nccl" in made[0] and reduces_host_tensors(made[0])


def test_offload_on_a_group_without_a_host_backend_is_refused_before_the_run_starts(tmp_path, tok):
    """A process group made before the run (here by the caller) that cannot reduce host tensors: refused, naming
    the fix, before the run folder is claimed. "cuda:gloo" stands for an nccl-only group (no CPU backend)."""
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"train.fsdp_offload=true keeps the gradients on the host, but .*\(backend "
                                             r"'cuda:gloo', made before the run\).*backend='cpu:gloo,cuda:nccl'"):
            _run(tmp_path / "run", tok, "model.lora=false", OFFLOAD)
        assert not (tmp_path / "run").exists()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- GPU


def offload_memory_bound(model: torch.nn.Module) -> tuple[int, int]:
    """(state, kept) bytes of an fp32 full fine-tuning of `model`: `state` = 4 x its weights, what the plain update
    holds on the GPU at its first optimizer step (weights, gradients, both AdamW states) and train.fsdp_offload
    keeps on the host; `kept` = what the offloaded update holds there by design: the root unit (embeddings, final
    norm, lm_head) unsharded, its gradient, and FSDP2's copy-in and reduce-scatter buffers of it (4 x the root),
    and the weights and gradients of two decoder layers in flight (4 x the largest layer)."""
    from logitless.models.lm_head import decoder_layers

    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    root = size(p for p in model.parameters() if id(p) not in in_layers)
    return 4 * size(model.parameters()), 4 * root + 4 * max(size(layer.parameters()) for layer in layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["static", "hf"])
def test_one_gpu_step_with_fsdp_offload_trains_like_without_and_peaks_lower(tmp_path, tok, backend):
    """fp32 model whose decoder layers outweigh its root unit (the embedding): with the option the update holds the
    root and a layer or two at a time, no optimizer state (the replica sleeps through it), so its peak is the
    plain update's less its training state, plus what offload keeps on the GPU by design (`offload_memory_bound`).

    Each run starts from a full garbage collection: the static engine compiles the model through transformers'
    `get_compiled_call`, which stores the compiled call on the model (a reference cycle), and the engine no longer
    collects garbage that is not its own after a rollout (5a3f8fc), so the plain run's model was alive in the
    offloaded run's update (0.057 GiB at hidden 256, 4 layers: its peak 0.335 GiB against a bound of 0.300)."""
    import gc

    from tests.conftest import tiny_qwen2

    over = ["model.lora=false", "optim.learning_rate=0.002", "model.gradient_checkpointing=true",
            f"rollout.backend={backend}", "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]
    runs = {}
    for tag, extra in (("plain", []), ("offload", [OFFLOAD])):
        gc.collect()  # the previous run's model (see above) is not this run's memory
        torch.cuda.empty_cache()
        model = tiny_qwen2(vocab_size=w.VOCAB, hidden=512, layers=16).cuda()
        state, kept = offload_memory_bound(model)
        runs[tag] = _run(tmp_path / tag, tok, *over, *extra, model=model).records[0]
        del model
        assert not dist.is_initialized()
    plain, off = runs["plain"], runs["offload"]
    # an on-policy step's loss is 0 up to rounding (every ratio is 1): bf16 noise of ~1e-7; the parameters are the test
    assert off["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    assert off["reward/mean"] == plain["reward/mean"]  # the replica / all-gathered weights sampled the same tokens
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "offload")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    gib = 2**30
    peak_plain, peak_off = plain["memory/peak_gb/train"], off["memory/peak_gb/train"]
    assert peak_plain >= state / gib  # the baseline held its training state on the GPU
    # the plain update's activations and transients (its peak less the state) are the offloaded update's too
    memory = {t: {k: round(v, 4) for k, v in r.items() if k.startswith(("memory/peak", "rollout/replica"))}
              for t, r in runs.items()}
    assert peak_off <= peak_plain - state / gib + kept / gib, (peak_off, peak_plain, state / gib, kept / gib, memory)
    assert off["is/logp_diff/max"] < 1e-3  # the sampler decoded the trainer's weights
    if backend == "static":
        assert off["rollout/replica_gib"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_offload_loads_the_model_into_host_memory(tmp_path, tok):
    """The model is loaded into host memory, the rollout's replica is built on the GPU from it, and FSDP2 moves
    one unit at a time to the GPU to shard it; loading it onto the GPU first put the replica's copy beside it.
    The replica is built by torch (once the weights' size) and then moved into CUDA virtual memory (not torch's),
    so torch's peak over the run stays near one model's size (1.52x at e884df8, before the change)."""
    from tests.conftest import tiny_qwen2

    model = tiny_qwen2(vocab_size=w.VOCAB, hidden=512, layers=16)  # the layers outweigh the root's embedding
    size = sum(p.numel() * 4 for p in model.parameters())  # fp32
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    over = ["model.lora=false", "rollout.backend=static", "model.dtype=float32", "model.device=cuda", OFFLOAD,
            f"model.name_or_path={folder}"]
    run = train(w.config(tmp_path / "run", *over))
    assert run.step == 1 and run.records[0]["rollout/replica_gib"] * 2**30 > 0.9 * size
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 1.5 * size, (peak / size)
