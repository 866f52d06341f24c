"""The per-GPU device memory of a step on N ranks (torchrun + FSDP2, trainer/distributed/parallel.py), as a function of N.

One process is `memory_plan.predict`. On N ranks each rank holds 1/N of the sharded state, its own share of the
step's rows, and a working set that does not shrink with N:

    shrinks (1/N)          the parameter shards (weights, fp32 LoRA adapters), the AdamW states, the gradients
                           (reduce-scattered, kept sharded between micro-batches); the KV cache, the sampler's
                           buffers and the prefill of the rank's rows (its prompts: the largest share)
    does not shrink        the root unit (embeddings, final norm, an untied lm_head), all-gathered from the start of
                           the forward to the end of the backward, and with full fine-tuning its unsharded gradient
                           over the whole backward; the decoder layers in flight (the one computed and the one
                           prefetched); the activations of the rank's micro-batches (their size is a setting, not a
                           share); the static backend's replica of the whole model during the rollout (`hf`: the
                           all-gathered model); the part of a merged-LoRA replica that stays mapped between
                           rollouts (everything outside its LoRA layers); a full fine-tuning reference copy
    at the replica's sync  the static backend's rollout starts by writing its replica from the shards, which stay on
                           the device until it ends (train.offload_during_rollout parks them before it and lends each
                           unit's back for its part): shards,
                           the whole (split) replica, one gathered FSDP unit and a merged LoRA weight in fp32, before
                           any KV cache (a moment of its own: the 32B split rollout's peak)
    at the backward's end  full fine-tuning reduces the root's gradient in fp32: its unsharded bf16 gradient and the
                           fp32 reduce-scatter input (4 bytes per root parameter) are alive together, after the
                           activations are freed (a moment of its own, the larger of the two sets the train peak)
    with async rollouts    (train.async_rollout) the next step's rollout decodes beside the update: the replica
                           stays resident and the rank's KV cache and sampler buffers add to the update's peak

With rollout.tensor_parallel = T (trainer/placement/tensor_parallel.py) the replica is 1/T per rank, and a rank decodes its
group's rows (T ranks' shares) with 1/T of the heads, MLP width and vocabulary: the same KV cache and sampler bytes
as its own rows whole (the logits stay split by vocabulary rows; top-k/top-p/min-p or a repetition penalty gather
them, which this does not count), T times the prefill's prompts.

Checked against every recorded 1- and 2-GPU run in bench/results of today's layout (1.5B shape, H200: full
fine-tuning with and without parked states, LoRA with 16-row and 32k-token micro-batches; `python
bench/bench_fsdp.py --check-recorded` prints predicted against measured per phase): the rollout and update peaks
are within 3 % (the largest miss -2.9 %), the bound tests/test_memory_ranks.py holds them to. `LAYERS_IN_FLIGHT`
is the one term set from the 2-GPU runs, and they pin it only loosely: a 1.5B layer is 0.09 GiB, about 1 % of a
2-GPU peak (1 layer misses by up to 3.9 %, 3 layers by up to 3.0 %); 2 is what FSDP2's prefetch holds. 4 and 8
ranks are extrapolation until measured. The root's fp32 reduction was not the peak of any recorded run. On
H100s (`bench_fsdp.RECORDED_H100`): 1.5B on 1 and 2 GPUs and 7B on 2 (one replica per GPU, and split over both),
rollouts within 2.2 %, updates -3.6 to -3.9 % (0.4 to 1 GiB unplaced); the 32B split rollout's sync -2.5 %
(modelled as the decode alone it was -35 %). Sizes are what torch's allocator holds, plus sleepable replica
memory, as `memory/peak_gb/<phase>`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from logitless.trainer.memory import plan as mp

# The decoder layers whose full parameters a rank holds at once during the update: the one computed (or
# recomputed) and the one FSDP2 prefetches (the 2-GPU full fine-tuning and LoRA runs at the 1.5B shape hold 0.60
# and 0.63 GiB above the sharded one-process terms, of which 0.435 GiB is the root's embedding).
LAYERS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Units:
    """FSDP2's units of a model (`parallel.shard_model`): every decoder layer, and the root with the rest."""

    root_params: int  # embeddings, final norm, an untied lm_head (a tied one counted once)
    layer_params: int  # one decoder layer's parameters (LoRA adapters excluded)


@dataclass(frozen=True)
class Ranks:
    """How the step runs on `count` processes."""

    count: int = 1
    units: Units | None = None  # needed for count > 1
    weight_copy: str = "sleep"  # the static backend's replica: "sleep" (CUDA's default under torchrun) or "resident"
    merged_replica: bool = True  # LoRA on the static backend: a merged replica (rollout.merge_lora not false)
    # rollout.tensor_parallel: the replica split over groups of this many ranks (1/T of it on each, its norms aside),
    # each rank decoding its group's rows with 1/T of the attention heads and MLP width and the whole vocabulary
    tensor_parallel: int = 1
    # rollout.device under torchrun (trainer/placement/shared_rollout.py): rank 0 keeps the replica on a GPU no rank trains on
    # and decodes every rank's rows there; the training GPUs hold no replica and no KV cache
    rollout_gpu: bool = False
    fp8: bool = False  # rollout.fp8: the replica's projections are FP8 (`ModelMemory.fp8_bytes`)


def units_of(model: Any) -> Units:
    """The unit sizes of a causal LM (loaded, or a skeleton on the meta device), before PEFT wraps it."""
    from logitless.models.lm_head import decoder_layers

    layers = decoder_layers(model)
    inside = {id(p) for layer in layers for p in layer.parameters()}
    params = {id(p): p.numel() for n, p in model.named_parameters() if "lora_" not in n}
    root = sum(n for k, n in params.items() if k not in inside)
    layer = max(sum(p.numel() for n, p in layer.named_parameters() if "lora_" not in n) for layer in layers)
    return Units(root_params=root, layer_params=layer)


def decode_step(step: mp.StepShape, ranks: Ranks) -> mp.StepShape:
    """The rows one rank decodes: its own share, or with a split replica its group's (ranks / T groups)."""
    return rank_step(step, ranks.count // ranks.tensor_parallel)


def split_model(m: mp.ModelMemory, t: int) -> mp.ModelMemory:
    """The model as one rank of a tensor-parallel group of `t` decodes it: 1/t of the query, key/value heads and the
    MLP width (its KV cache and activations) and of the vocabulary (its logits and sampler buffers: the largest
    chunk), the whole hidden size."""
    if t == 1:
        return m
    return dataclasses.replace(m, q_dim=m.q_dim // t, kv_dim=m.kv_dim // t, intermediate=m.intermediate // t,
                               vocab=-(-m.vocab // t))


def rank_step(step: mp.StepShape, ranks: int) -> mp.StepShape:
    """One rank's share of a global step: the largest (prompts_per_step / ranks, rounded up)."""
    prompts = -(-step.prompts // ranks)
    return dataclasses.replace(step, prompts=prompts, rows=prompts * (step.rows // step.prompts))


def predict(m: mp.ModelMemory, step: mp.StepShape, facts: mp.RunFacts, knobs: mp.Knobs,
            ranks: Ranks) -> dict[str, dict[str, float]]:
    """Predicted bytes of each phase on one rank (the busiest), by part, for the global `step` on `ranks.count`
    processes; one process is `memory_plan.predict` itself."""
    if ranks.count == 1:
        return mp.predict(m, step, facts, knobs)
    if ranks.units is None:
        raise ValueError("the unit sizes (Ranks.units, from units_of(model)) are needed for more than one rank")
    n, u, mine = ranks.count, ranks.units, rank_step(step, ranks.count)
    one = dataclasses.replace(facts, decode_copy=False, async_rollout=False, rollout_elsewhere=False, fp8=False)
    if ranks.rollout_gpu:
        return _shared_rollout(m, step, mine, one, knobs, ranks)
    out = {"generate": _generate(m, step, one, knobs, ranks)}
    if facts.logprob_pass:
        out["logprobs"] = {**_sharded(m, facts, n), **_working_set(m, u, ranks, facts),
                           **_step_parts(mp.logprob_bytes(m, mine, one, knobs))}
    out["train"] = _train(m, mine, one, knobs, ranks)
    if facts.async_rollout and facts.backend == "static":  # the next step's rollout decodes beside the update
        rollout = mp.generate_bytes(split_model(m, ranks.tensor_parallel), decode_step(step, ranks), one, knobs)
        out["train"].update({f"rollout {k}": rollout.get(k, 0.0) for k in ("kv cache", "sampler")})
    return out


ROLLOUT_DEVICE = "rollout device"  # the phase of the shared rollout's own GPU (`Ranks.rollout_gpu`)


def _shared_rollout(m: mp.ModelMemory, step: mp.StepShape, mine: mp.StepShape, facts: mp.RunFacts, knobs: mp.Knobs,
                    ranks: Ranks) -> dict[str, dict[str, float]]:
    """The phases with the shared rollout GPU: on the training GPUs the replica's sync (rank 0 merges each LoRA weight
    in fp32 there before sending it) and the update, neither with a replica or KV cache; on the rollout's GPU
    (`ROLLOUT_DEVICE`) the resident replica and the whole step's KV cache, sampler and prefill."""
    n, u = ranks.count, ranks.units
    assert u is not None
    alone = dataclasses.replace(ranks, weight_copy="sleep", rollout_gpu=False)  # no replica mapped on a training GPU
    sync = {k: v for k, v in _sync(m, facts, alone).items() if not k.startswith("replica")}
    out = {"generate": sync}
    if facts.logprob_pass:
        out["logprobs"] = {**_sharded(m, facts, n), **_working_set(m, u, alone, facts),
                           **_step_parts(mp.logprob_bytes(m, mine, facts, knobs))}
    out["train"] = _train(m, mine, facts, knobs, alone)
    for phase in ("logprobs", "train"):  # (the working set's replica is on the rollout's GPU)
        out.get(phase, {}).pop("replica (mapped)", None)
    out[ROLLOUT_DEVICE] = {"replica (whole)": float(_replica_bytes(m, ranks)),
                           **_step_parts(mp.generate_bytes(m, step, facts, knobs))}
    return out


def training_peak(phases: dict[str, dict[str, float]]) -> float:
    """The step's peak on a training GPU: the largest phase but the shared rollout GPU's."""
    return max(sum(p.values()) for name, p in phases.items() if name != ROLLOUT_DEVICE)


def peak(phases: dict[str, dict[str, float]]) -> float:
    """The step's peak: the largest phase's bytes."""
    return max(sum(p.values()) for p in phases.values())


RESIDENT = ("weights", "adapters", "optimizer", "reference", "gradients", "offload residue")


def _step_parts(parts: dict[str, float]) -> dict[str, float]:
    """A one-process phase's parts that belong to the rank's own rows and micro-batches (the rest is resident)."""
    return {k: v for k, v in parts.items() if k not in RESIDENT}


def _sharded(m: mp.ModelMemory, facts: mp.RunFacts, n: int, *, parked: bool = False) -> dict[str, float]:
    """The rank's shards: 1/n of the weights, adapters and optimizer states (none while parked); a full
    fine-tuning reference copy whole (it is made before sharding)."""
    parts = {f"{k} (1/{n})": 0.0 if parked else v / n for k, v in mp.resident_bytes(m, facts).items() if k != "reference"}
    if facts.reference_copy:
        parts["reference"] = float(m.weight_bytes)
    return parts


def _replica_mapped(m: mp.ModelMemory, facts: mp.RunFacts, ranks: Ranks) -> float:
    """Bytes of the static backend's replica that stay on the device between rollouts."""
    if facts.backend != "static":
        return 0.0
    if ranks.weight_copy == "resident":
        return float(_replica_bytes(m, ranks))
    if m.lora and ranks.merged_replica:  # the LoRA layers' merged weights sleep; embeddings, norms, lm_head stay
        merged = m.fp8_merge_bytes if ranks.fp8 else m.merge_copy_bytes
        return float(_replica_bytes(m, ranks) - merged / ranks.tensor_parallel)
    return float(m.weight_bytes) if m.lora else 0.0  # unmerged LoRA: only the adapters sleep; full: every weight


def _replica_bytes(m: mp.ModelMemory, ranks: Ranks) -> float:
    """The rank's replica: the model's size (merged LoRA), or with its fp32 adapters (unmerged); 1/T of it split.
    With fp8 its projections take 1 byte per weight and a scale per row instead of their bytes in the model."""
    whole = m.weight_bytes - m.fp8_source_bytes + m.fp8_bytes if ranks.fp8 else m.weight_bytes
    return (whole + (4 * m.trainable if m.lora and not ranks.merged_replica else 0)) / ranks.tensor_parallel


def _working_set(m: mp.ModelMemory, u: Units, ranks: Ranks, facts: mp.RunFacts) -> dict[str, float]:
    """What a rank holds whole during a forward (and backward): the root unit, the layers in flight, and the
    replica's mapped part."""
    layer = u.layer_params * m.dtype_bytes + (4 * m.trainable // m.layers if m.lora else 0)
    return {"root unit (whole)": float(u.root_params * m.dtype_bytes),
            "layers in flight": float(LAYERS_IN_FLIGHT * layer),
            "replica (mapped)": _replica_mapped(m, facts, ranks)}


def _generate(m: mp.ModelMemory, step: mp.StepShape, facts: mp.RunFacts, knobs: mp.Knobs,
              ranks: Ranks) -> dict[str, float]:
    """The rollout: shards (the static backend parks them with the optimizer states under
    train.offload_during_rollout), the whole decode weights (1/T with a split replica), the rank's KV cache,
    sampler and prefill (with a split replica: of its group's rows, 1/T of the heads)."""
    parked = bool(knobs.offload_during_rollout)
    parts = _sharded(m, facts, ranks.count, parked=parked and facts.backend == "static")
    if parked and facts.backend != "static":  # hf decodes from the sharded model: only the AdamW states go
        parts[f"optimizer (1/{ranks.count})"] = 0.0
    t = ranks.tensor_parallel
    if facts.backend == "static":
        parts["replica (whole)" if t == 1 else f"replica (1/{t})"] = float(_replica_bytes(m, ranks))
    else:  # every unit all-gathered for generate
        parts["gathered weights (whole)"] = float(m.weight_bytes + (4 * m.trainable if m.lora else 0))
    parts.update(_step_parts(mp.generate_bytes(split_model(m, t), decode_step(step, ranks), facts, knobs)))
    if facts.backend != "static":
        return parts
    sync = _sync(m, facts, ranks, parked)  # the rollout's other moment: the larger of the two is its peak
    return sync if sum(sync.values()) > sum(parts.values()) else parts


def _sync(m: mp.ModelMemory, facts: mp.RunFacts, ranks: Ranks, parked: bool = False) -> dict[str, float]:
    """The replica's sync at the rollout's start, before any KV cache: the whole replica (1/T split) beside the
    shards, while one FSDP unit is gathered whole at a time (a decoder layer; the root too where it holds trained
    weights, full fine-tuning, or when a split replica fills the first time) and a merged LoRA weight is formed in
    fp32 (its base, B @ A scaled, and their sum: three fp32 copies of a slice). parked
    (train.offload_during_rollout): the shards and optimizer states are in host memory and only the gathered
    unit's shards are lent back."""
    t, u = ranks.tensor_parallel, ranks.units
    assert u is not None
    parts = _sharded(m, facts, ranks.count, parked=parked)
    parts["replica (whole)" if t == 1 else f"replica (1/{t})"] = float(_replica_bytes(m, ranks))
    layer = max(m.intermediate, m.q_dim) * m.hidden  # the largest weight a LoRA layer merges (an MLP projection)
    merged = m.lora and ranks.merged_replica
    gathered = max(u.root_params, u.layer_params) if t > 1 or not m.lora else u.layer_params
    parts["sync: gathered"] = float(gathered * m.dtype_bytes)
    if parked:
        parts["sync: lent shard"] = float(gathered * m.dtype_bytes) / ranks.count
    if merged:
        parts["sync: fp32 merge"] = float(3 * 4 * layer // t)
    return parts


def _train(m: mp.ModelMemory, mine: mp.StepShape, facts: mp.RunFacts, knobs: mp.Knobs, ranks: Ranks) -> dict[str, float]:
    """The update's larger moment: the activation peak (shards, sharded gradients, the working set, the rank's
    micro-batch) or, with full fine-tuning, the root's fp32 gradient reduction at the backward's end."""
    n, u = ranks.count, ranks.units
    assert u is not None
    grads = float(m.trainable * (4 if m.lora else m.dtype_bytes)) / n
    base = {**_sharded(m, facts, n), f"gradients (1/{n})": grads}
    parts = {**base, **_working_set(m, u, ranks, facts), **_step_parts(mp.train_bytes(m, mine, facts, knobs))}
    if m.lora:
        return parts
    # full fine-tuning: the root's unsharded gradient lives from the lm_head's backward to the end; it replaces the
    # one-process transient the trainable head's workspace counts (a new [V, H] gradient added into .grad)
    root_grad = float(u.root_params * m.dtype_bytes)
    parts["lm head"] = parts.get("lm head", 0.0) - mp.HEAD_WORKSPACE_TRAINABLE + mp.HEAD_WORKSPACE
    parts["root gradient (whole)"] = root_grad
    layer_grad = u.layer_params * (m.dtype_bytes + 4)  # one layer's unsharded gradient and its fp32 reduce input
    recompute = parts.get("recompute", parts.get("activations", 0.0))
    parts["layer gradient reduction"] = max(0.0, layer_grad - recompute)  # after its activations are freed
    reduction = {**base, "replica (mapped)": _replica_mapped(m, facts, ranks), "root gradient (whole)": root_grad,
                 "root fp32 reduce-scatter input": float(4 * u.root_params)}
    return reduction if sum(reduction.values()) > sum(parts.values()) else parts
