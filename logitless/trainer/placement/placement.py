"""Where and how a run's rollout decodes, decided once per run in one place (`RolloutPlacement`):

    engine     the backend that decodes (`engines.make_rollout_engine`), with the decisions of `EngineChoice`
    replica    the engine's own copy of the policy, synced from the trained model before each rollout: a full
               replica of a sharded model (torchrun, train.fsdp_offload) or on rollout.device, one split over a
               group of ranks (rollout.tensor_parallel), or none on a rank that only joins rank 0's syncs (a shared
               rollout: rollout.device under torchrun, `PeerSync`)
    prefetch   train.async_rollout: the next step's rollout in flight (`AsyncRollout`)
    shared     one GPU decodes every rank's rows (rank 0's decode process, `shared_rollout.py`)

It is built in two steps, because a replica copies the full weights before the model is sharded
(`RolloutPlacement.plan`) and the engine decodes from what is there once it is (`RolloutPlacement.start`). The
stages use it through `generate`, `weights`, `metrics` and `close`, never through the engine's type.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from logitless.data import PromptSampler
from logitless.rollout import RolloutBatch, RolloutEngine, SamplingOptions
from logitless.rollout.engine import same_device, unwrap_model
from logitless.trainer.config.schema import TrainerConfig
from logitless.trainer.distributed.fsdp_units import Lend, no_lend
from logitless.trainer.distributed.parallel import (
    COPY_BACKENDS,
    MergedRolloutCopy,
    RolloutCopy,
    World,
    make_replica,
    rank_share,
    rollout_weights,
)
from logitless.trainer.placement.async_rollout import AsyncRollout
from logitless.trainer.placement.engines import (
    EngineChoice,
    check_fused,
    decode_attention_for,
    make_rollout_engine,
    routing_replay_on,
    weight_copy,
)
from logitless.trainer.placement.rollout_worker import DecodeWorker
from logitless.trainer.placement.shared_rollout import PeerSync, SharedDecode
from logitless.trainer.placement.tensor_parallel import (
    TensorParallelCopy,
    check_tensor_parallel,
    group_decode,
    local_bytes,
    tp_mesh,
)

Replica = RolloutCopy | MergedRolloutCopy | TensorParallelCopy | PeerSync


@dataclass
class RolloutPlacement:
    """The run's rollout: what decodes, from which weights, where, and whether ahead of the step."""

    replica: Replica | None = None  # the engine's own weights, synced before each rollout; None: the model's
    device: torch.device | None = None  # rollout.device (rank 0's, with a shared rollout), None: the training device's
    shared: bool = False  # one GPU decodes every rank's rows as one batch
    split: int = 1  # ranks a replica is split over (rollout.tensor_parallel under torchrun)
    routes: bool = False  # the engine records mixture-of-experts routes for the trainer to replay
    engine: RolloutEngine | None = None  # set by `start`
    prefetch: AsyncRollout | None = None  # train.async_rollout: the next step's rollout in flight

    @classmethod
    def plan(cls, cfg: TrainerConfig, world: World, model: torch.nn.Module, device: torch.device) -> RolloutPlacement:
        """The placement's replica, made from `model`'s full weights before it is sharded."""
        rollout_device = torch.device(cfg.rollout.device) if cfg.rollout.device is not None else None
        split = cfg.rollout.tensor_parallel > 1 and world.distributed  # (checked before: a static backend, torchrun)
        shared = world.distributed and rollout_device is not None  # rank 0 decodes for every rank
        if shared and cfg.rollout.backend not in COPY_BACKENDS:
            raise ValueError(f"rollout.device={cfg.rollout.device} under torchrun needs rollout.backend=static "
                             f"(resolved: {cfg.rollout.backend}); set rollout.backend=static or unset rollout.device")
        replica = None
        if split:
            check_tensor_parallel(cfg, world.size, unwrap_model(model).config)
            mode = weight_copy(cfg.rollout, device, has_copy=True, distributed=True)
            replica = TensorParallelCopy(model, tp_mesh(world.size, cfg.rollout.tensor_parallel, device), device,
                                         sleep=mode == "sleep")
        elif shared and not world.main:  # rank 0 keeps the replica on the rollout's GPU; this rank joins its syncs
            merged = MergedRolloutCopy.applies(model, cfg.rollout.merge_lora)
            replica = PeerSync((MergedRolloutCopy if merged else RolloutCopy).synced_names(model), merged)
        elif (world.sharded or rollout_device is not None) and cfg.rollout.backend in COPY_BACKENDS:
            mode = ("resident" if rollout_device is not None or cfg.train.async_rollout  # async: decodes beside the update
                    else weight_copy(cfg.rollout, device, has_copy=True, distributed=True))
            replica = make_replica(model, cfg.rollout.merge_lora, sleep=mode == "sleep", device=rollout_device or device,
                                   fuse=cfg.rollout.fuse_projections is not False, fp8=cfg.rollout.fp8)
            check_fused(cfg.rollout, replica.groups, "the rollout's replica has no plain q/k/v or gate/up layers "
                        "(unmerged LoRA layers, or another layout)")
        own_gpu = rollout_device is not None and not same_device(rollout_device, device) and world.main
        routes = routing_replay_on(cfg, model, agent=cfg.agent.enabled, separate_decode=shared or split)
        return cls(replica=replica, device=rollout_device if own_gpu else None, shared=shared,
                   split=cfg.rollout.tensor_parallel if split else 1, routes=routes)

    def start(self, cfg: TrainerConfig, world: World, model: torch.nn.Module, tokenizer: Any, device: torch.device, *,
              sampler: PromptSampler, agent: Any = None, state: dict[str, Any] | None = None) -> RolloutPlacement:
        """The engine (and the prefetch of train.async_rollout, its pending rollout restored from `state`), now that
        `model` is sharded where it is to be."""
        if isinstance(self.replica, TensorParallelCopy):
            self.replica.materialize()  # this rank's slices, now that the model is sharded
        choice = EngineChoice(
            replica=self.replica is not None,
            merged_replica=isinstance(self.replica, (MergedRolloutCopy, TensorParallelCopy)),
            resident=self.replica is not None or cfg.train.async_rollout,  # async: a copy of its own
            decode_attention=decode_attention_for(cfg.train.packed is True)
            if cfg.rollout.decode_attention == "auto" else None,  # rounding as the trainer's attention does
            record_routes=self.routes)
        if self.shared:  # rank 0's decode process (the replica shared with it), every rank's handle; made by all
            bound = cfg.train.collective_timeout_s  # a rollout past half of it ends the decode process
            worker = DecodeWorker(self.replica.model, cfg.rollout, tokenizer, bound / 2, choice) if world.main else None
            self.engine = SharedDecode(worker, dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * bound)),
                                       torch.device(cfg.rollout.device))
        else:  # merged: a plain model
            self.engine = make_rollout_engine(cfg.rollout, self.replica.model if self.replica else model, tokenizer,
                                              choice)
        if isinstance(self.replica, TensorParallelCopy):
            self.engine = group_decode(self.engine, self.replica)
        if cfg.train.async_rollout:
            sync = None if self.replica is None else self._sync(model)
            self.prefetch = AsyncRollout(self.engine, sampler, cfg.train.prompts_per_step, device, sync=sync,
                                         agent=agent, share=lambda rows: rank_share(rows, world))
            self.prefetch.restore(state or {})
        return self

    def _sync(self, model: torch.nn.Module) -> Callable[[], None]:
        """Bring the replica up to date with `model`, then the engine's weights with the replica (a merged copy of
        an unmerged replica, where the engine keeps one; a rank that only joins a shared rollout's sync has none)."""
        replica, engine = self.replica, None if self.shared else self.engine

        def sync() -> None:
            replica.sync(model)
            if engine is not None:
                engine.weights.sync()

        return sync

    def generate(self, prompts: list, options: SamplingOptions, episodes: Any = None) -> RolloutBatch:
        """The engine's rollout of `prompts` (token ids with an agent's `episodes` driver)."""
        if episodes is not None:
            return self.engine.generate(prompts, options, episodes=episodes)
        return self.engine.generate(prompts, options)

    @contextlib.contextmanager
    def weights(self, model: torch.nn.Module, lend: Lend = no_lend) -> Iterator[None]:
        """The weights the engine samples from, current for the block (`parallel.rollout_weights`)."""
        with rollout_weights(model, self.replica, lend=lend):
            yield

    def decoded_module(self) -> torch.nn.Module | None:
        """The module the engine reads its weights from, where the engine says (a merged copy, a replica)."""
        return getattr(getattr(self.engine, "weights", None), "module", None)

    def metrics(self) -> dict[str, float]:
        """The rollout's own memory: the engine's weight copy and this rank's replica (a shared rollout's is rank
        0's; a split one's, this rank's slices)."""
        replica = getattr(self.replica, "model", None)
        return {
            "rollout/weights_copy_gib": getattr(getattr(self.engine, "weights", None), "extra_bytes", 0) / 2**30,
            "rollout/replica_gib": local_bytes(replica) / 2**30 if replica is not None else 0.0,
        }

    def extra_peak_gib(self) -> float:
        """Peak memory on the rollout's GPU outside this process (a shared rollout's decode process), else 0."""
        return self.engine.device_peak_gib if self.shared else 0.0

    def close(self, wait: bool) -> None:
        """Stop the rollout in flight (`wait`: let it finish) and a shared rollout's decode process."""
        if self.prefetch is not None:
            self.prefetch.close(wait=wait)
        if self.shared:
            self.engine.close()
