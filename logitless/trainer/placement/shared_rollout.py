"""`rollout.device` under torchrun: one GPU that no rank trains on decodes the whole step for every rank.

    torchrun --nproc-per-node 3 -m logitless train CONFIG rollout.backend=static rollout.device=cuda:3

At a fixed global batch each rank's own decode stops scaling with the rank count: a decode step over 128 rows costs
almost what one over 512 costs (it is bandwidth- and launch-bound), so on 4 GPUs the rollout ran 1.9-2.25x faster
than on one while the update ran 3.5x (bench/LOG.md). Here rank 0 keeps the policy's replica on the rollout's GPU,
and the other ranks keep none:

- `PeerSync`: the replica's sync reads the FSDP2 shards one unit at a time (`parallel.RolloutCopy.sync`,
  `MergedRolloutCopy.sync`); every rank joins each unit's all-gather, rank 0 alone writes the replica (merged in fp32
  on its training GPU, rounded once, sent to the rollout's GPU). `PeerSync` is the other ranks' side: the same units
  gathered in the same order, nothing written.
- `SharedDecode` is every rank's engine: `generate` gathers the ranks' prompts and sampling options on rank 0 (a gloo
  group of its own, host objects), whose decode process (`rollout_worker.py`: a static engine on the replica's own
  memory, in a process of its own so that it never takes turns with the update on rank 0's interpreter lock)
  decodes their union as one batch, each rank's part drawing from the random streams its own call would
  (`SamplingOptions.streams`: the rank's seed), so the tokens and logprobs are those each rank would sample alone
  from the same weights; then rank 0 hands every rank its rows (`tensor_parallel.prompt_rows`). An error (a decode
  process that failed or died) is handed to every rank and raised there, so no rank waits in a collective.
- With train.async_rollout the gather happens when the next step's rollout starts (every rank, main thread), the
  decode process decodes while the ranks update, and the hand-out happens when the step takes its rollout
  (`Handout`); the collectives stay on the main threads, in the same order on every rank.

An eval during training (eval.every_steps) gives every rank the same rows: the call is decoded once and every rank
gets all of it (rank 0 counts it, `evaluate.eval_in_run`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from logitless.rollout.engine import unwrap_model
from logitless.rollout.types import Prompt, RolloutBatch, SamplingOptions
from logitless.trainer.distributed.fsdp_units import Lend, by_unit, gathered, no_lend
from logitless.trainer.placement.tensor_parallel import joint_options, prompt_rows

KEY = "rollout.device"


def training_gpus() -> int:
    """GPUs of this node that torchrun's ranks train on (LOCAL_WORLD_SIZE: cuda:0 .. cuda:N-1)."""
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def check_shared_rollout(cfg: Any, ranks: int, local_ranks: int | None = None) -> None:
    """Refuse a rollout.device under torchrun (`ranks` > 1) that cannot be the step's shared rollout GPU, naming the
    setting and the fix. `local_ranks`: the ranks on rank 0's node (default: LOCAL_WORLD_SIZE)."""
    name = cfg.rollout.device
    if name is None or ranks < 2:
        return
    local = training_gpus() if local_ranks is None else local_ranks
    off = f"unset {KEY} (each rank then decodes its share on its own GPU)"
    device = torch.device(name)
    if device.type == "cuda" and (device.index is None or device.index < local):
        raise ValueError(
            f"{KEY}={name} under torchrun names a GPU a rank trains on (ranks use cuda:0..cuda:{local - 1}); name a "
            f"GPU no rank uses, e.g. {KEY}=cuda:{local} with --nproc-per-node {local} on a node with more GPUs, or {off}"
        )
    cpu_training = cfg.model.device == "cpu" or cfg.model.device == "auto" and not torch.cuda.is_available()
    if device.type == "cpu" and not cpu_training:
        raise ValueError(f"{KEY}=cpu under torchrun with ranks training on GPUs would decode the step on the host; "
                         f"name a GPU no rank trains on, or {off}")
    refused = [
        (cfg.rollout.tensor_parallel > 1, f"rollout.tensor_parallel={cfg.rollout.tensor_parallel}",
         "the shared rollout is one replica on one GPU", "rollout.tensor_parallel=1"),
        (cfg.agent.enabled, "agent.tools / agent.environment / agent.driver (multi-turn episodes)",
         "each rank's environments answer its own rows between turns, which the shared decode does not relay yet",
         "no agent"),
        (cfg.train.fsdp_offload, "train.fsdp_offload=true",
         "the shards live in host memory and the replica is built from them on each rank's GPU",
         "train.fsdp_offload=false"),
    ]
    for on, setting, why, fix in refused:
        if on:
            raise ValueError(f"{setting} cannot run with {KEY}={name} under torchrun: {why}; set {fix} or {off}")


class PeerSync:
    """A rank without the replica: its `sync` joins the replica sync's all-gathers (the same FSDP2 units in the same
    order as rank 0's `RolloutCopy` / `MergedRolloutCopy`: `names` is that replica's `synced_names` of the same
    unsharded model; `merged`: a merged one, whose names are LoRA layers of the unwrapped model) and writes nothing."""

    model = None  # no replica here

    def __init__(self, names: list[str], merged: bool):
        self.names, self.merged = names, merged

    @torch.no_grad()
    def sync(self, sharded: nn.Module, lend: Lend = no_lend) -> None:
        base = unwrap_model(sharded) if self.merged else None
        for unit, _ in by_unit(sharded, self.names, base=base):
            with gathered(unit, lend):
                pass

    def release(self) -> None:
        pass


class DecodeError:
    """What rank 0 hands the ranks when its decode fails (the exception itself may not pickle)."""

    def __init__(self, error: BaseException):
        self.text, self.error = f"{type(error).__name__}: {error}", error

    def __getstate__(self) -> dict:
        return {"text": self.text, "error": None}  # (the exception itself stays on rank 0)


class SharedDecode:
    """Every rank's rollout engine when rank 0 decodes for all (see the module docstring). `worker`: rank 0's decode
    process (`rollout_worker.DecodeWorker`; None on the other ranks). Attributes the trainer sets on an engine (the
    async rollout's auto_sync, an OOM retry's max_kv_gib) are held here: the decode process's engine runs on the
    settings it was made with."""

    def __init__(self, worker: Any, group: Any, device: torch.device):
        self.worker, self.group, self.device = worker, group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    @property
    def device_peak_gib(self) -> float:
        """The decode process's allocator peak on the rollout GPU in the last rollout (0 on other ranks, on CPU)."""
        return self.worker.peak_gib if self.worker is not None else 0.0

    def gather(self, prompts: Sequence[Prompt], options: SamplingOptions) -> list[tuple[list, SamplingOptions]] | None:
        """Every rank's (prompts, options) on rank 0 (None on the others); a collective of every rank."""
        parts: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object((list(prompts), options), parts, dst=0, group=self.group)
        return parts

    @staticmethod
    def union(parts: list[tuple[list, SamplingOptions]]) -> tuple[list, SamplingOptions, bool]:
        """What rank 0 decodes: (prompts, options, shared). One call from every rank (an eval's rows): decoded once,
        `shared`; else the ranks' prompts in rank order, each part with its rank's random streams."""
        if all(p == parts[0] for p in parts):
            return parts[0][0], parts[0][1], True
        options = joint_options(parts, f"{KEY} under torchrun: rank 0 decodes the ranks' prompts together, so each "
                                "rank's rollout needs")
        return [p for mine, _ in parts for p in mine], options, False

    def submit(self, parts: list | None) -> bool | DecodeError | None:
        """Rank 0: start decoding the ranks' `parts` in the decode process; whether it is one shared call, or the
        error that kept it from starting (handed out by `hand_out`). None on the other ranks."""
        if parts is None:
            return None
        try:
            union, options, shared = self.union(parts)
            self.worker.submit(union, options)
            return shared
        except Exception as e:
            return DecodeError(e)

    def hand_out(self, parts: list | None, started: bool | DecodeError | None) -> RolloutBatch:
        """This rank's rows of the rollout `submit` started: rank 0 waits for its batch and scatters each rank its
        rows, or the error to every rank; a collective of every rank."""
        mine: list[Any] = [None]
        outs: list[Any] | None = None
        if self.rank == 0:
            assert parts is not None
            try:
                if isinstance(started, DecodeError):
                    raise started.error
                batch = self.worker.result()
                G = parts[0][1].num_generations
                starts = [sum(len(m) for m, _ in parts[:r]) for r in range(self.size)]
                outs = [batch if started else prompt_rows(batch, starts[r], len(parts[r][0]), G)
                        for r in range(self.size)]
            except Exception as e:  # every rank learns of it and raises, none waits in a collective
                outs = [DecodeError(e)] * self.size
        dist.scatter_object_list(mine, outs, src=0, group=self.group)
        if isinstance(mine[0], DecodeError):
            raise RuntimeError(f"{KEY}: rank 0's rollout of every rank's prompts failed: {mine[0].text}")
        return mine[0]

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions, episodes: Any = None) -> RolloutBatch:
        """This rank's rows of rank 0's decode of every rank's prompts (see the module docstring)."""
        if episodes is not None:
            raise ValueError(f"{KEY} under torchrun does not run multi-turn episodes yet")
        parts = self.gather(prompts, options)
        return self.hand_out(parts, self.submit(parts))

    def close(self) -> None:
        """End rank 0's decode process."""
        if self.worker is not None:
            self.worker.close()


class Handout:
    """A pending async rollout under a shared decode, started in rank 0's decode process: handed out on the first
    `result()`, which every rank calls at the same point (a collective)."""

    def __init__(self, engine: SharedDecode, parts: list | None, started: bool | DecodeError | None):
        self.engine, self.parts, self.started = engine, parts, started
        self.batch: RolloutBatch | None = None

    def result(self) -> RolloutBatch:
        if self.batch is None:
            self.batch = self.engine.hand_out(self.parts, self.started)
        return self.batch
