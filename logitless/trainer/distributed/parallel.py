"""Several processes under torchrun: the process group, FSDP2 sharding, each rank's prompts, the rollout's full
weights, and agreement on when to stop. On a single process every function here is the identity: no process
group, no wrapping; except with train.fsdp_offload=true, where the one process makes a 1-rank group and shards
its model with FSDP2 CPU offload (`trainer/distributed/fsdp_offload.py`), and everything below that keys on "the model is
sharded" (`World.sharded`) applies to it too.

    torchrun --nproc-per-node 2 -m logitless train CONFIG

Every rank runs the same loop on its own share of the step's prompts (`train.prompts_per_step` is global; shares
differ by at most one prompt where it does not divide by the rank count). The
step normalizer and the metrics are all-reduced in `distributed.py`, so gradients and logged values do not
depend on the number of ranks.

How the weights are handled:
- Every decoder layer is one FSDP2 unit; the root unit holds the embeddings, the final norm and the lm_head
  (tied or not). The fused logprob op runs inside the root unit's forward (`register_fsdp_forward_method`), so it
  sees the root's all-gathered lm_head weight, exactly the single-process weight, and its lm_head / embedding
  gradients are reduce-scattered by FSDP like any other.
- Gradients are summed across ranks (divide factor 1): the loss is already divided by the global normalizer.
- The rollout needs the full weights, by one of two paths (`rollout_weights`):
  - `hf` backend: `full_weights` all-gathers every unit once before `generate` and keeps them until it returns,
    so the decode loop runs no collective (ranks decode different lengths and never wait on each other); LoRA
    adapters stay unmerged, as on one process. Cost: one all-gather of the model per step, and the full weights'
    memory during the rollout only.
  - `static` backend (CUDA-graph decode, which needs weights at fixed addresses): a persistent replica updated
    in place before each rollout (`make_replica`). Cost: the replica's memory all the time, or, with
    rollout.weight_copy=sleep (the default under torchrun on CUDA), only during the rollout: the weights each sync
    rewrites live in `rollout.sleep.SleepableMemory`, freed after the rollout and mapped back at the same addresses before it.
    - `MergedRolloutCopy` (LoRA, unless rollout.merge_lora=false): a plain model whose LoRA layers hold
      W + ΔW. The sync all-gathers the LoRA layers' frozen base weights and the adapters and merges them, as
      the single-process merged copy does; the replica is the size of the model, with no second copy of the
      LoRA layers beside it.
    - `RolloutCopy` (full fine-tuning, or LoRA unmerged): a replica of the policy as it is (adapters
      unmerged, so it computes exactly what the trainer computes); the sync all-gathers the trainable
      parameters only.
    - With rollout.device naming a GPU no rank trains on, rank 0 alone keeps the replica, there, and decodes for
      every rank (`shared_rollout.py`); the other ranks join its syncs' all-gathers.
    - With rollout.fp8 the replica's projections are FP8 (`rollout.fp8.to_fp8`): each sync quantizes the whole
      weights (merged: W + ΔW in fp32) as it writes them (`fused.write_at`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from logitless.models import completion_logprobs
from logitless.models.lm_head import decoder_layers
from logitless.rollout.engine import unwrap_model
from logitless.rollout.fp8 import fp8_replica
from logitless.rollout.fused import fuse_projections, owners, write_at
from logitless.rollout.sleep import SleepableMemory
from logitless.rollout.weights import delta_weight, fresh_copy, lora_layers, merge_refusal, merge_targets
from logitless.trainer.config.schema import TrainerConfig
from logitless.trainer.distributed.collectives import is_distributed
from logitless.trainer.distributed.fsdp_offload import check_host_backend, device_full_tensor, offload_policy, one_rank_group
from logitless.trainer.distributed.fsdp_units import Lend, by_unit, gathered, no_lend
from logitless.trainer.distributed.fsdp_offload import backend as offload_backend

T = TypeVar("T")


TIMEOUT = timedelta(minutes=30)  # a rank that waits longer on a collective fails instead of hanging (the default)
LOGPROBS_METHOD = "logitless_completion_logprobs"
DISTRIBUTED_BACKENDS = ("hf", "static")
COPY_BACKENDS = ("static",)  # backends that sample from a persistent replica (`RolloutCopy`)


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place among torchrun's workers (rank 0 of 1 without torchrun), and whether its model is
    sharded with FSDP2 CPU offload (train.fsdp_offload)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    offload: bool = False

    @property
    def distributed(self) -> bool:
        """Several ranks."""
        return self.size > 1

    @property
    def sharded(self) -> bool:
        """The model is sharded with FSDP2: several ranks, or train.fsdp_offload on one (a 1-rank group)."""
        return self.distributed or self.offload

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_world() -> World:
    """The world torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def init_distributed(device: str, offload: bool = False, timeout_s: float | None = None) -> World:
    """Join torchrun's process group: on CUDA nccl for device tensors, one GPU per local rank, and gloo for host
    tensors; gloo on CPU (`device` is model.device). Without torchrun (WORLD_SIZE unset or 1) nothing is
    initialized, except with `offload` (train.fsdp_offload): a 1-rank group of this process.

    The group outlives the run (until `shutdown`), so a later run in the same process finds it as this run made
    it: gloo is joined even when this run keeps every tensor on the GPU, since a later one with train.fsdp_offload
    reduces its host gradients through it (an nccl-only group fails there: "No backend type associated with device
    type cpu"). A group the caller made is checked instead (`check_host_backend`). `timeout_s`: the collectives'
    timeout, a backstop behind the phases' watchdog (`watchdog.py`; default TIMEOUT)."""
    world = dataclasses.replace(launched_world(), offload=offload)
    timeout = TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s)
    if not world.sharded:
        return world
    if dist.is_initialized():
        check_host_backend(offload)
        return world
    cuda = device != "cpu" and torch.cuda.is_available()
    if not world.distributed:
        one_rank_group(torch.device("cuda" if device == "auto" else device) if cuda else torch.device("cpu"), timeout)
        return world
    if cuda:
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(offload_backend(torch.device("cuda" if cuda else "cpu")), timeout=timeout)
    return world


@contextmanager
def process_group(device: str, offload: bool = False, timeout_s: float | None = None) -> Iterator[World]:
    """`init_distributed` for the block; a 1-rank group it made (train.fsdp_offload on one process) is destroyed
    at the end, so that the process is as before. torchrun's group stays until `shutdown`."""
    made = dist.is_available() and not dist.is_initialized()
    world = init_distributed(device, offload, timeout_s)
    try:
        yield world
    finally:
        if made and not world.distributed:
            shutdown()


def shutdown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_distributed(cfg: TrainerConfig, world: World) -> None:
    """Refuse settings that cannot be sharded over `world.size` ranks, naming the setting and the fix (the
    rollout's placement is checked by `placement.check_placement`)."""
    if not world.distributed:
        return
    n, k = cfg.train.prompts_per_step, world.size
    if n < k:
        raise ValueError(
            f"train.prompts_per_step={n} is the global prompt count of a step, split across the {k} ranks, and each "
            f"rank needs at least one prompt; set it to at least {k} (a multiple of {k} keeps the ranks equally busy) "
            f"or launch torchrun with --nproc-per-node {n} or fewer"
        )
    if ":" in cfg.model.device:
        raise ValueError(
            f"model.device={cfg.model.device!r} puts every rank on the same device; under torchrun set "
            "model.device=auto (or cuda): each rank then uses the GPU of its LOCAL_RANK"
        )
    if cfg.rollout.backend not in (*DISTRIBUTED_BACKENDS, "auto"):
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend!r} cannot run under torchrun ({k} ranks) yet; set "
            "rollout.backend=hf (or static)"
        )
    not_yet = [
        (cfg.model.load_in_4bit, "model.load_in_4bit=true (QLoRA)", "model.load_in_4bit=false"),
        (cfg.optim.optimizer != "adamw", f"optim.optimizer={cfg.optim.optimizer}", "optim.optimizer=adamw"),
    ]
    for on, setting, fix in not_yet:
        if on:
            raise ValueError(f"{setting} is not supported with FSDP2 under torchrun yet; set {fix} or train on one process")
    if cfg.train.async_rollout and cfg.rollout.tensor_parallel > 1:
        raise ValueError(
            f"train.async_rollout=true with rollout.tensor_parallel={cfg.rollout.tensor_parallel}: the split "
            "rollout's all-reduces would run beside the update's collectives, which is not supported yet; set "
            "rollout.tensor_parallel=1 (each rank then decodes from a replica of its own beside the update) or "
            "train.async_rollout=false"
        )
    if cfg.model.liger_kernels is True and cfg.rollout.tensor_parallel > 1:
        raise ValueError(
            f"model.liger_kernels=true with rollout.tensor_parallel={cfg.rollout.tensor_parallel}: the split rollout's "
            "replica would run Liger's kernels on its slices, which is not tested yet; set model.liger_kernels=false "
            "or rollout.tensor_parallel=1 (Liger's kernels then run in the update, a replica per GPU decodes)"
        )
    if cfg.objective.top_entropy_quantile < 1.0:
        raise ValueError(
            f"objective.top_entropy_quantile={cfg.objective.top_entropy_quantile} takes a quantile over the whole "
            "step's tokens, which is not gathered across ranks yet; set objective.top_entropy_quantile=1.0 or "
            "train on one process"
        )
    if cfg.advantage.scale == "batch":
        raise ValueError(
            "advantage.scale='batch' needs the std of the whole step's rewards, which is not gathered across "
            "ranks yet; set advantage.scale=group (or none), or train on one process"
        )
    if cfg.advantage.multi_reward == "normalize_then_sum":
        raise ValueError(
            "advantage.multi_reward='normalize_then_sum' (GDPO) z-scores the weighted sum of the rewards over the "
            "whole step's rows, which are not gathered across ranks yet (each rank would normalize its own share); "
            "set advantage.multi_reward=sum_then_normalize, or train on one process"
        )


@contextmanager
def claimed_on_rank0(world: World, claim: Callable[[], Any]) -> Iterator[tuple[TrainerConfig, Any, Any]]:
    """Rank 0 claims the run folder (`claim()`, a context manager giving `.cfg` and `.resume_from`) for the whole
    run; every rank gets its config (absolute paths) and checkpoint, and rank 0 the claim itself (None on the other
    ranks). One process: just `claim()`."""
    if not world.distributed:
        with claim() as run:
            yield run.cfg, run.resume_from, run
        return
    if world.main:
        with claim() as run:
            shared = [run.cfg, run.resume_from]
            dist.broadcast_object_list(shared, src=0)
            yield run.cfg, run.resume_from, run
        return
    shared = [None, None]  # rank 0 fails alone if the claim fails; torchrun then ends this rank
    dist.broadcast_object_list(shared, src=0)
    yield shared[0], shared[1], None


def rank_share(rows: Sequence[T], world: World) -> list[T]:
    """This rank's contiguous share of the step's prompts: len(rows) // ranks each, one more on the first
    len(rows) % ranks ranks; the ranks' shares in rank order are all of them."""
    k, extra = divmod(len(rows), world.size)
    start = world.rank * k + min(world.rank, extra)
    return list(rows[start : start + k + (world.rank < extra)])


def rank_seed(seed: int, world: World) -> int:
    """A seed of its own for each rank; rank 0 keeps the single-process seed."""
    return seed + 1_000_000_007 * world.rank


# ----------------------------------------------------------------------------------------------------------
# FSDP2


def shard_model(model: nn.Module, device: torch.device, offload: bool = False) -> nn.Module:
    """FSDP2 (`fully_shard`) on every decoder layer and on the root, over every rank of the process group; fp32
    gradient reduction on CUDA across several ranks (on one, the "reduction" is a copy: the gradients keep their
    dtype, exactly the fp32 round trip's values, without its transient fp32 copies). offload: the shards,
    gradients and optimizer step on the host (train.fsdp_offload).

    Parameters keep the model's dtype (bf16 by default on CUDA). The root gains a forward method that computes
    `completion_logprobs` with the root's weights all-gathered (see the module docstring).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    options: dict[str, Any] = {
        "mesh": init_device_mesh(device.type, (dist.get_world_size(),)),
        "mp_policy": MixedPrecisionPolicy(
            reduce_dtype=torch.float32 if device.type == "cuda" and dist.get_world_size() > 1 else None),
    }
    if offload:
        options["offload_policy"] = offload_policy(device)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for unit in _fsdp_modules(model):  # (these two setters act on one unit each)
        unit.set_gradient_divide_factor(1.0)  # sum: each rank's loss is already divided by the global normalizer
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    def logprobs(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return completion_logprobs(self, *args, **kwargs)

    setattr(model, LOGPROBS_METHOD, types.MethodType(logprobs, model))
    register_fsdp_forward_method(model, LOGPROBS_METHOD)
    register_fsdp_forward_method(model, "generate")  # the rollout enters through the root too (FSDP's lazy init)
    return model


def model_logprobs(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logprobs(model, ...)`, through the FSDP root's forward when the model is sharded."""
    method = getattr(model, LOGPROBS_METHOD, None)
    return method(*args, **kwargs) if method is not None else completion_logprobs(model, *args, **kwargs)


def _fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def full_weights(model: nn.Module) -> Iterator[None]:
    """Inside: every parameter of a sharded model is whole on every rank (all-gathered once, unit by unit), and
    forwards reshard nothing, so `generate` runs no collective. Outside: sharded again. No-op when not sharded."""
    units = _fsdp_modules(model)
    if not units:
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        with torch.no_grad():
            for unit in units:
                unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:  # the layers reshard after forward again; the root keeps its weights until
                unit.set_reshard_after_forward(True, recurse=False)  # the backward, as FSDP sets up a root


def copy_to(module: nn.Module, device: torch.device | None) -> nn.Module:
    """A frozen eval-mode copy of `module` on `device` (None: where each tensor is). Each parameter and buffer is
    copied straight to `device`, so the device `module` lives on never holds a second copy of its weights (a replica
    on the rollout's own GPU, rollout.device); tied tensors stay tied."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in memo:
            c = t.detach().to(device if device is not None else t.device, copy=True)
            memo[id(t)] = nn.Parameter(c, requires_grad=False) if isinstance(t, nn.Parameter) else c
    return fresh_copy(module, memo).eval().requires_grad_(False)


class _Replica:
    """What both replicas share: with sleep, the weights each `sync` rewrites in full live in sleepable memory,
    mapped back at the start of a sync and freed by `release` after the rollout. A sync reads the sharded model one
    FSDP2 unit at a time (`by_unit`): one all-gather per decoder layer, not one per weight."""

    memory: SleepableMemory | None = None

    def release(self) -> None:
        """Free the synced weights until the next `sync` (with sleep)."""
        if self.memory is not None:
            self.memory.sleep()

    def _wake(self) -> None:
        if self.memory is not None:
            self.memory.wake()


class RolloutCopy(_Replica):
    """A full replica of the policy for the rollout engine, at fixed addresses (built before sharding).

    `sync` copies the trainable parameters of the sharded model into it in place (an all-gather each); frozen
    weights never change, so a LoRA sync moves only the adapters. The replica runs the same modules (adapters
    unmerged) in the same dtype, so its logprobs are the trainer's. fp8 (full fine-tuning): its projections are FP8,
    quantized from the whole weights at every sync (`rollout.fp8`).
    """

    def __init__(self, model: nn.Module, sleep: bool = False, device: torch.device | None = None, fuse: bool = False,
                 fp8: bool = False):
        self.model = copy_to(model, device)
        self.device = next(self.model.parameters()).device
        self.trainable = self.synced_names(model)
        # plain q/k/v, gate/up (full fine-tuning), in FP8 with fp8
        self.groups = fp8_replica(self.model, fuse) if fp8 else fuse_projections(self.model) if fuse else []
        self.memory = SleepableMemory(owners(self.model, self.trainable)) if sleep else None

    @staticmethod
    def synced_names(model: nn.Module) -> list[str]:
        """What `sync` copies, in its order: the trainable parameters of `model` (unsharded)."""
        return [n for n, p in model.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def sync(self, sharded: nn.Module, lend: Lend = no_lend) -> None:
        """Copy the trainable parameters in, one FSDP2 unit at a time (its shards read within `lend`)."""
        self._wake()
        for unit, names in by_unit(sharded, self.trainable):  # the same units in the same order on every rank
            with gathered(unit, lend):
                for name in names:  # (the unit's parameters whole inside; read after the unshard swapped them in)
                    # a fused layer's: its group's rows; an FP8 layer's: quantized (not sharded: as it is)
                    write_at(self.model, name, device_full_tensor(sharded.get_parameter(name), self.device))


class MergedRolloutCopy(_Replica):
    """The replica of a PEFT LoRA policy as a plain model, its LoRA layers merged (built before sharding).

    `sync` sets every LoRA layer's weight to W + ΔW: W, the frozen base weight, and the adapters all-gathered
    from the sharded model; ΔW = (B @ A) * scaling summed over the active adapters, formed as peft's
    `get_delta_weight` does, the sum in fp32 and rounded once (as `rollout.weights.MergedLoraWeights`). The
    other parameters are frozen and copied once. The weights keep their addresses across syncs.
    """

    def __init__(self, peft_model: nn.Module, sleep: bool = False, device: torch.device | None = None,
                 fuse: bool = False, fp8: bool = False):
        self.model = copy_to(unwrap_model(peft_model), device)
        self.names = self.synced_names(peft_model)
        self.targets = [(path, param) for path, param, _ in merge_targets(unwrap_model(peft_model))]
        for path in dict.fromkeys(path for path, _ in self.targets):  # each LoRA layer (or nest of expert
            self.model.set_submodule(path, self.model.get_submodule(path).get_base_layer())  # wrappers): its base
        if fp8:  # every projection FP8; the frozen ones quantized once here, the merged ones at every sync
            self.groups = fp8_replica(self.model, fuse)
        else:
            self.groups = fuse_projections(self.model, [path for path, _ in self.targets]) if fuse else []
        merged = owners(self.model, [f"{path}.{param}" for path, param in self.targets])  # rewritten at every sync
        self.memory = SleepableMemory(merged) if sleep else None

    @staticmethod
    def synced_names(peft_model: nn.Module) -> list[str]:
        """What `sync` merges, in its order: the LoRA layers of `peft_model` (unsharded; nested expert wrappers one
        each)."""
        return [name for name, _ in lora_layers(unwrap_model(peft_model))]

    @staticmethod
    def applies(model: nn.Module, merge_lora: bool | None) -> bool:
        """Whether the replica of `model` can be merged: LoRA adapters that `MergedLoraWeights` accepts, nothing
        else trainable, and rollout.merge_lora not false."""
        if merge_lora is False or not hasattr(model, "peft_config") or merge_refusal(model) is not None:
            return False
        return all(".lora_A." in n or ".lora_B." in n for n, p in model.named_parameters() if p.requires_grad)

    @torch.no_grad()
    def sync(self, sharded: nn.Module, lend: Lend = no_lend) -> None:
        """Merge every LoRA layer from its all-gathered base weight and adapters (its shards read within `lend`)."""
        self._wake()
        src = unwrap_model(sharded)
        device = next(self.model.parameters()).device
        full = lambda p: device_full_tensor(p, device)  # noqa: E731  (host shards with train.fsdp_offload: moved first)
        where = dict(zip(self.names, self.targets))  # LoRA layer name -> (path, parameter) in the replica
        for unit, names in by_unit(sharded, self.names, base=src):  # the same units in the same order on every rank
            with gathered(unit, lend):
                for name in names:
                    layer = src.get_submodule(name)
                    path, param = where[name]
                    base = full(getattr(layer.get_base_layer(), param))
                    w = base.float()
                    for adapter in layer.active_adapters:
                        if adapter in layer.lora_A:
                            a, b = full(layer.lora_A[adapter].weight), full(layer.lora_B[adapter].weight)
                            w = w + delta_weight(layer, adapter, a, b).float()
                    # another GPU: rounded once, sent; an FP8 layer quantizes W + ΔW as it writes it
                    write_at(self.model, f"{path}.{param}", w if w.device == device else w.to(base.dtype))


def make_replica(model: nn.Module, merge_lora: bool | None, sleep: bool = False,
                 device: torch.device | None = None, fuse: bool = False,
                 fp8: bool = False) -> RolloutCopy | MergedRolloutCopy:
    """The static backend's replica under torchrun: merged for LoRA when it can be, else the policy as is.
    sleep: its synced weights are freed between rollouts (rollout.weight_copy=sleep). device: where the replica
    lives (None: the model's device; train.fsdp_offload builds it on the GPU from a model in host memory).
    fuse: q/k/v and gate/up projections as one product each (`rollout/fused.py`), where they are plain layers.
    fp8: its projections in FP8, quantized at every sync (rollout.fp8, `rollout/fp8.py`)."""
    if MergedRolloutCopy.applies(model, merge_lora):
        return MergedRolloutCopy(model, sleep=sleep, device=device, fuse=fuse, fp8=fp8)
    return RolloutCopy(model, sleep=sleep, device=device, fuse=fuse, fp8=fp8)



@contextmanager
def rollout_weights(model: nn.Module, replica: RolloutCopy | MergedRolloutCopy | None,
                    lend: Lend = no_lend) -> Iterator[None]:
    """The weights the engine samples from, current for the duration of a rollout: the replica synced (reading
    the shards within `lend`: parked ones are lent back a unit at a time), or the sharded model's full weights
    (`full_weights`); nothing to do on one process."""
    from logitless.trainer.distributed.watchdog import phase

    if replica is not None:
        with phase("sync"):
            replica.sync(model, lend=lend)
        try:
            yield
        finally:
            replica.release()
    else:
        with ExitStack() as gathered_weights:
            with phase("sync"):  # the all-gather; the weights are released again at the end of the rollout
                gathered_weights.enter_context(full_weights(model))
            yield


def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None) -> float:
    """Clip the gradients (plain or FSDP2 DTensor shards) to `max_norm`; the total norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def agree(flag: int | None, device: torch.device) -> int | None:
    """The largest of the ranks' flags (a signal number, 1 for "out of time"), so that every rank stops after
    the same step; the flag itself on one process."""
    if not is_distributed():
        return flag
    t = torch.tensor([flag or 0], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) or None


class QuietLogger:
    """The metrics logger of ranks other than 0: only rank 0 prints, plots and writes metrics."""

    def __init__(self) -> None:
        self.console = Console(stderr=True, quiet=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def advance(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def print(self, *args: Any) -> None:
        pass

    def completions_table(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass
