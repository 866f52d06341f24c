"""train.fsdp_offload: PyTorch's ZeRO-3 offload (FSDP2 with `CPUOffloadPolicy`), on one process or under torchrun.

The parameters, their gradients and the AdamW states live in (pinned) host memory; the device holds only what
one FSDP unit needs while it runs. Before a unit's forward (and again for its backward) FSDP2 copies its
parameter shards to the device and all-gathers them; after the backward it reduce-scatters the unit's
gradients and copies them to the host, where they accumulate across micro-batches. The optimizer step runs on
the host (torch's fused CPU AdamW). The units are the same as without offload (`parallel.shard_model`): every
decoder layer, and the root with the embeddings, final norm and lm_head.

On one process the run makes a process group of its own (rank 0 of 1, an in-memory store: `one_rank_group`),
since FSDP2 needs one; no torchrun is needed. On CUDA the group has two backends: nccl for device tensors and
gloo for host tensors (the gradient norm is reduced over host DTensors).

The rollout reads whole weights on the device: the `static` backend's replica is synced from the host shards
(each shard copied to the device, then all-gathered there: `device_full_tensor`); the `hf` backend all-gathers
every unit onto the device for `generate` (`parallel.full_weights`), as without offload.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from logitless.trainer.config.schema import TrainerConfig

SETTING = "train.fsdp_offload=true"


def check_fsdp_offload(cfg: TrainerConfig) -> None:
    """Refuse, before the model loads, the settings that cannot run with train.fsdp_offload, naming both and the
    fix."""
    if not cfg.train.fsdp_offload:
        return
    off = "train.fsdp_offload=false"
    if cfg.optim.optimizer != "adamw":
        what = ("bitsandbytes' 8-bit AdamW runs on CUDA tensors" if cfg.optim.optimizer == "adamw_8bit" else
                "torchao's CPUOffloadOptimizer offloads plain device parameters itself")
        raise ValueError(
            f"optim.optimizer={cfg.optim.optimizer} cannot run with {SETTING}: the parameters, gradients and AdamW "
            f"step already live on the host (FSDP2 CPU offload), and {what}; set optim.optimizer=adamw (the states "
            f"are then on the host) or {off}"
        )
    device = cfg.model.device
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise ValueError(f"model.device={device!r}: {SETTING} shards with FSDP2, which runs on cpu or cuda; set "
                         f"model.device=cuda (or auto) or {off}")
    refused = [
        (cfg.model.load_in_4bit, "model.load_in_4bit=true (QLoRA)", "FSDP2 cannot shard bitsandbytes' 4-bit weights",
         "model.load_in_4bit=false"),
        (cfg.model.liger_kernels is True, "model.liger_kernels=true", "Liger's kernels are not tested on FSDP2 units yet",
         "model.liger_kernels=false"),
        (cfg.train.async_rollout, "train.async_rollout=true",
         "the async rollout decodes from the training model's merged weights during the update, which FSDP2 keeps "
         "sharded on the host", "train.async_rollout=false"),
        (cfg.rollout.backend not in ("hf", "static", "auto"), f"rollout.backend={cfg.rollout.backend}",
         "only the hf and static backends read a sharded model's weights", "rollout.backend=static (or hf)"),
        (cfg.rollout.weight_copy == "in_place", "rollout.weight_copy=in_place",
         "the merge would be written into the training weights, which FSDP2 keeps sharded on the host; the static "
         "backend decodes from a replica instead", "rollout.weight_copy=sleep (or unset it)"),
    ]
    for on, setting, why, fix in refused:
        if on:
            raise ValueError(f"{setting} cannot run with {SETTING}: {why}; set {fix} or {off}")


def backend(device: torch.device) -> str:
    """The process group's backend with host-offloaded shards: nccl for CUDA tensors and gloo for host ones on a
    GPU, gloo alone on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def reduces_host_tensors(config: str) -> bool:
    """Whether a process group of backend config `config` (`dist.get_backend_config()`: "nccl", "gloo",
    "cpu:gloo,cuda:nccl", ...) has a backend for CPU tensors."""
    for part in config.lower().replace(" ", "").split(","):
        device, _, name = part.rpartition(":")
        if device == "cpu" or (not device and "cpu" in dist.Backend.backend_capability.get(name, [])):
            return True
    return False


def check_host_backend(offload: bool) -> None:
    """Refuse train.fsdp_offload on an existing process group that cannot reduce host tensors (FSDP2 CPU offload
    keeps the gradients, whose norm is all-reduced, on the host), naming the fix."""
    config = dist.get_backend_config()
    if offload and not reduces_host_tensors(config):
        raise ValueError(
            f"train.fsdp_offload=true keeps the gradients on the host, but this process's process group "
            f"(backend {config!r}, made before the run) has no backend for CPU tensors; make it with "
            f"backend='cpu:gloo,cuda:nccl' (or let the run make it: do not call init_process_group first), or set "
            f"train.fsdp_offload=false"
        )


def one_rank_group(device: torch.device, timeout: timedelta) -> None:
    """Make this process a process group of its own (rank 0 of 1, an in-memory store) on `device`, so that FSDP2
    can shard without torchrun."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend(device), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def offload_policy(device: torch.device) -> Any:
    """FSDP2's CPUOffloadPolicy: pinned host shards on a GPU (asynchronous copies), plain host memory on CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def device_full_tensor(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of FSDP2 parameter `p` on `device`: a plain tensor as it is; a DTensor's shard copied to the
    device first when it lives elsewhere (the host, with offload), then all-gathered there (on one rank the
    shard is the whole tensor: no collective). A collective for a DTensor on several ranks."""
    if not hasattr(p, "full_tensor"):
        return p
    local = p.to_local()
    if local.device.type == device.type:
        return p.full_tensor()
    local = local.to(device, non_blocking=True)
    if p.device_mesh.size() == 1:
        return local
    from torch.distributed.tensor import DTensor

    moved = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return moved.full_tensor()
