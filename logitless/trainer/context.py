"""Everything a training run holds between steps, built once from the config (`build_context`)."""

from __future__ import annotations

import dataclasses
import random
import time
from datetime import timedelta
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console

from logitless.agents import Agent
from logitless.data import PromptRow, PromptSampler
from logitless.objectives import AdvantageOptions, EntropyCoef, initial_entropy_coef
from logitless.rewards.models import load_reward_models
from logitless.rollout import RolloutEngine
from logitless.rollout.engine import same_device, unwrap_model
from logitless.trainer import checkpoint as ckpt
from logitless.trainer import dcp
from logitless.trainer.accounting import ModelShape, device_peaks
from logitless.trainer.async_rollout import AsyncRollout
from logitless.trainer.auto import has_auto, resolve
from logitless.trainer.builders import (
    accuracy_index,
    check_fused,
    check_prompt_lengths,
    decode_attention_for,
    load_rows,
    make_optimizer,
    make_rollout_engine,
    make_scheduler,
    reward_functions,
    sampling_options,
    sync_offloaded_params,
    weight_copy,
)
from logitless.trainer.config import TrainerConfig, to_dict, to_yaml
from logitless.trainer.episodes import environment_weight
from logitless.trainer.evaluate import eval_options
from logitless.trainer.metrics import MetricsLogger
from logitless.trainer.model_checks import model_config
from logitless.trainer.modeling import (
    LoraCompute,
    ReferencePolicy,
    check_packed_attention,
    load_model_and_tokenizer,
    prepare_for_training,
    trainable_parameters,
)
from logitless.trainer.offload import ParkedState
from logitless.trainer.oom import MemoryState
from logitless.trainer.tracking import open_trackers, resolve_report_to
from logitless.trainer.parallel import (
    COPY_BACKENDS,
    MergedRolloutCopy,
    QuietLogger,
    RolloutCopy,
    World,
    make_replica,
    rank_share,
    shard_model,
)
from logitless.trainer.rundir import RunDir, write_atomic
from logitless.trainer.rollout_worker import DecodeWorker
from logitless.trainer.shared_rollout import PeerSync, SharedDecode
from logitless.trainer.tensor_parallel import TensorParallelCopy, check_tensor_parallel, group_decode, tp_mesh


@dataclass
class TrainContext:
    """The model, its sampler engine, optimizer and data, and the state that carries across steps."""

    cfg: TrainerConfig
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    engine: RolloutEngine
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: PromptSampler
    reward_fns: list[Callable[..., list[float | None]]]
    acc_col: int  # column of the reward whose 1.0 means "correct"
    adv_options: AdvantageOptions
    reference: ReferencePolicy | None  # the KL term's policy (objective.beta > 0)
    shape: ModelShape  # for the ceiling and MFU accounting
    peaks: tuple[float, float]  # (dense bf16 FLOP/s, HBM bytes/s) of the device; NaN where unknown
    run_dir: Path
    logger: MetricsLogger
    start: int  # last step completed before this process started (0, or the resumed checkpoint's step)
    entropy_coef: EntropyCoef  # carried across steps (adaptive entropy control)
    lora_compute: LoraCompute  # how the trainer's forwards run the LoRA adapters (model.lora_compute)
    world: World = field(default_factory=World)  # this process's rank among torchrun's workers
    # the engine's own weights (static backend with a sharded model: torchrun or train.fsdp_offload, or on
    # rollout.device), else None
    replica: RolloutCopy | MergedRolloutCopy | TensorParallelCopy | PeerSync | None = None
    rollout_device: torch.device | None = None  # rollout.device where it is not the training device
    empty_steps: int = 0  # consecutive steps whose completions were all empty
    parked: ParkedState = field(default_factory=ParkedState)  # train.offload_during_rollout's host buffers
    prefetch: AsyncRollout | None = None  # train.async_rollout: the next step's rollout in flight
    memory: MemoryState | None = None  # the memory plan's model and settings (trainer/oom.py), where one is made
    on_micro_batch: Callable[[int], None] | None = None  # called before each micro-batch's forward (a test hook)
    agent: Agent | None = None  # agent.tools / agent.environment: what answers the model between turns
    run: RunDir | None = None  # the claimed run folder (rank 0): checked before each write
    t_start: float = field(default_factory=time.perf_counter)  # for the wall-time budget
    eval_rows: list[PromptRow] | None = None  # held-out rows of the eval during training (eval.every_steps, on_start)

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self, step: int) -> Path:
        """Write an atomic checkpoint of this step (model, optimizer, schedule, data position, RNG, entropy coef)."""
        if self.run is not None:
            self.run.check_alive()
        state = {"sampler": self.sampler.state_dict(), "entropy_coef": list(self.entropy_coef)}
        pending = self.prefetch.state() if self.prefetch is not None else {}  # the next step's rollout in flight
        if self.world.sharded:  # sharded (DCP), every rank; each rank's pending rollout is its own
            return dcp.save_sharded(
                self.ckpt_root, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                trainer_state=state, world=self.world, device=self.device, keep=self.cfg.checkpoint.save_total_limit,
                rank_state=pending,
            )
        state.update(pending)
        return ckpt.save_checkpoint(
            self.ckpt_root, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            trainer_state=state, keep=self.cfg.checkpoint.save_total_limit,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def advantage_options(cfg: TrainerConfig) -> AdvantageOptions:
    """The advantage options with the reward weights of `reward.reward_weights` (checked by `preflight`), and
    `agent.environment_reward_weight` for the environment's reward column when an agent has an environment."""
    weights = tuple(cfg.reward.reward_weights) if cfg.reward.reward_weights else None
    env = environment_weight(cfg)
    if env is not None:
        weights = (*(weights or (1.0,) * len(cfg.reward.reward_funcs)), env)
    return dataclasses.replace(cfg.advantage, reward_weights=weights)


def _model(cfg: TrainerConfig, model: torch.nn.Module | None, tokenizer: Any,
           host: bool = False) -> tuple[torch.nn.Module, Any, torch.device]:
    """(model, tokenizer, device): loaded as cfg.model says, or the given model prepared for training. host: its
    weights in host memory whatever the device (train.fsdp_offload: FSDP2 then moves one unit at a time to the
    device to shard it, and the rollout's replica is built on the device from the host weights, so the device
    never holds the model twice)."""
    cpu = torch.device("cpu")
    if model is None:
        return load_model_and_tokenizer(model_config(cfg), place=cpu if host else None)
    if tokenizer is None:
        raise ValueError("train(model=...) needs tokenizer= too")
    model = prepare_for_training(model, cfg.model)
    device = next(model.parameters()).device
    return (model.to(cpu) if host else model), tokenizer, device


def _resumed_state(resume: str | Path, world: World, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict:
    """Load a checkpoint into model, optimizer and schedule (sharded under torchrun or with train.fsdp_offload);
    returns its trainer state."""
    path = ckpt.resolve_checkpoint(resume)
    dcp.check_world_size(path, world)
    dcp.check_layout(path, world)
    configured = [{k: g[k] for k in OPTIM_SETTINGS if k in g} for g in optimizer.param_groups]
    if world.sharded:
        state = dcp.load_sharded(resume, model=model, optimizer=optimizer, scheduler=scheduler, world=world)
    else:
        state = ckpt.load_checkpoint(resume, model=model, optimizer=optimizer, scheduler=scheduler)
    _keep_configured(optimizer, scheduler, configured)
    sync_offloaded_params(optimizer)  # adamw_cpu_offload keeps host copies of the weights
    return state


OPTIM_SETTINGS = ("initial_lr", "weight_decay", "betas", "eps")  # of the config, in a fresh optimizer's param groups


def _keep_configured(optimizer: Any, scheduler: Any, configured: list[dict[str, Any]]) -> None:
    """The config's optimizer settings (base learning rate, weight decay, betas, epsilon) over those the
    checkpoint's optimizer and schedule state brought back. They are equal, and nothing is touched, unless the
    resume changed them (`--allow-config-change`); then the schedule goes on from its step at the new base rate."""
    changed = False
    for group, want in zip(optimizer.param_groups, configured):
        for k, v in want.items():
            if group.get(k) != v:
                group[k], changed = v, True
    if changed and scheduler is not None:
        scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        for g, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            g["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _logger(cfg: TrainerConfig, run_dir: Path, world: World, start: int, run: RunDir | None,
            console: Console | None = None) -> MetricsLogger | QuietLogger:
    """Only rank 0 writes the run folder's files (its config as given, "auto" kept, where the claim says:
    `RunDir.save_config`), prints and plots."""
    if not world.main:
        return QuietLogger()
    if run is not None:
        run.check_alive()
        run.save_config(cfg)
    else:  # a context built outside `train` (no claim): config.yaml as given
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    log = cfg.logging
    names, required = resolve_report_to(log.report_to, log.tensorboard)
    trackers = open_trackers(names, run_dir, config=to_dict(cfg), project=log.project, run_name=log.run_name,
                             options=log.tracker_options, resume_step=start, required=required)
    logger = MetricsLogger(run_dir, progress=log.progress, total_steps=cfg.train.max_steps, resume_step=start,
                           trackers=trackers, console=console)
    if run is not None and run.config_note:
        logger.console.print(run.config_note, highlight=False, markup=False, soft_wrap=True)
    return logger


def _shape(model: torch.nn.Module, engine: Any, split: int = 1) -> ModelShape:
    """The training model's shape, with the weight bytes of the module the rollout decodes with (a merged bf16
    copy of a QLoRA model reads bf16 weights, not 4-bit ones); the model's own where the engine does not say.
    split: rollout.tensor_parallel, each rank reading 1/split of them per step."""
    shape = ModelShape.of(model)
    decoded = getattr(getattr(engine, "weights", None), "module", None)
    if decoded is None or decoded is model:
        return shape
    return dataclasses.replace(shape, decode_weight_bytes=ModelShape.of(decoded).decode_weight_bytes // split)


def build_context(
    cfg: TrainerConfig, world: World, *, resume: str | Path | None = None, model: torch.nn.Module | None = None,
    tokenizer: Any = None, run: RunDir | None = None, given: TrainerConfig | None = None,
) -> TrainContext:
    """Data and rewards first (their errors need no model), then model, engine, optimizer, and the resumed state.
    `world`: this process's place, its process group already made (`parallel.process_group`); `run`: the claimed
    run folder (rank 0). `cfg`: the run's settings, "auto" decided (`trainer.auto`; decided here, without the
    table, where the caller has not); `given`: the config as written (saved as the run's config)."""
    if has_auto(cfg):
        given = given or cfg
        cfg = resolve(cfg, world_size=world.size, model=model).cfg
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)  # the same on every rank: the model's random init (LoRA) must agree
    adv_options = advantage_options(cfg)
    console = Console(stderr=True) if world.main else None  # the run's console (MetricsLogger prints there too)
    rows: list[PromptRow] = load_rows(cfg.data, console=console)
    sampler = PromptSampler(rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    eval_rows = None
    if cfg.eval.every_steps or cfg.eval.on_start:
        eval_rows = load_rows(cfg.data, cfg.eval.split or cfg.data.eval_split, eval=True)[: cfg.eval.num_prompts]
    reward_fns, acc_col = reward_functions(cfg.reward), accuracy_index(cfg.reward)
    model, tokenizer, device = _model(cfg, model, tokenizer, host=world.offload)
    load_reward_models(reward_fns, device)  # model:/judge: rewards, on the training device unless they name one
    agent = Agent(tokenizer, cfg.agent) if cfg.agent.enabled else None  # tools, environment, template: checked here
    check_prompt_lengths(rows, tokenizer, model, sampling_options(
        cfg.rollout, seed=None, chat_template_kwargs=cfg.data.chat_template_kwargs), f"data.task={cfg.data.task!r}")
    if eval_rows is not None:
        check_prompt_lengths(eval_rows, tokenizer, model, eval_options(cfg), "eval during training (eval.every_steps)")
    if cfg.train.packed:
        check_packed_attention(model)
    # before a resume loads trained weights
    reference = ReferencePolicy(model, device) if cfg.objective.beta > 0 else None
    replica, rollout_device = None, torch.device(cfg.rollout.device) if cfg.rollout.device is not None else None
    split = cfg.rollout.tensor_parallel > 1 and world.distributed  # (checked before: a static backend, torchrun)
    shared = world.distributed and rollout_device is not None  # rank 0 decodes for every rank (shared_rollout.py)
    if shared and cfg.rollout.backend not in COPY_BACKENDS:
        raise ValueError(f"rollout.device={cfg.rollout.device} under torchrun needs rollout.backend=static (resolved: "
                         f"{cfg.rollout.backend}); set rollout.backend=static or unset rollout.device")
    mesh = tp_mesh(world.size, cfg.rollout.tensor_parallel, device) if split else None
    if split:
        check_tensor_parallel(cfg, world.size, unwrap_model(model).config)
        mode = weight_copy(cfg.rollout, device, has_copy=True, distributed=True)
        replica = TensorParallelCopy(model, mesh, device, sleep=mode == "sleep")
    elif shared and not world.main:  # rank 0 keeps the replica on the rollout's GPU; this rank joins its syncs
        merged = MergedRolloutCopy.applies(model, cfg.rollout.merge_lora)
        replica = PeerSync((MergedRolloutCopy if merged else RolloutCopy).synced_names(model), merged)
    elif (world.sharded or rollout_device is not None) and cfg.rollout.backend in COPY_BACKENDS:
        mode = ("resident" if rollout_device is not None or cfg.train.async_rollout  # async: it decodes beside the update
                else weight_copy(cfg.rollout, device, has_copy=True, distributed=True))
        replica = make_replica(model, cfg.rollout.merge_lora, sleep=mode == "sleep", device=rollout_device or device,
                               fuse=cfg.rollout.fuse_projections is not False)
        check_fused(cfg.rollout, replica.groups, "the rollout's replica has no plain q/k/v or gate/up layers "
                    "(unmerged LoRA layers, or another layout)")
    if world.sharded:
        model = shard_model(model, device, offload=world.offload)
        if world.rank:
            seed_everything(cfg.train.seed + world.rank)  # per-rank streams from here on (dropout, rewards)
    if isinstance(replica, TensorParallelCopy):
        replica.materialize()  # this rank's slices, now that the model is sharded
    params = trainable_parameters(model)
    optimizer = make_optimizer(params, cfg.optim, host=world.offload)
    steps_per_rollout = cfg.train.num_iterations * cfg.train.steps_per_rollout  # optimizer steps per rollout batch
    scheduler = make_scheduler(optimizer, cfg.train.max_steps * steps_per_rollout, cfg.optim)
    run_dir = Path(cfg.train.output_dir)
    state = _resumed_state(resume, world, model, optimizer, scheduler) if resume is not None else {}
    start = int(state.get("step", 0))
    if state:
        sampler.load_state_dict(state["sampler"])
    logger = _logger(given or cfg, run_dir, world, start, run, console)
    coef = EntropyCoef(*state["entropy_coef"]) if "entropy_coef" in state else initial_entropy_coef(cfg.objective)
    engine_changes: dict[str, Any] = {}
    if replica is not None:  # the replica merged (a plain model), fused its projections and sleeps by itself
        engine_changes.update(fuse_projections=None, weight_copy="resident")
        if isinstance(replica, (MergedRolloutCopy, TensorParallelCopy)):
            engine_changes["merge_lora"] = None
    if cfg.train.async_rollout:  # async samples during updates: a copy of its own
        engine_changes["weight_copy"] = "resident"
    if cfg.rollout.decode_attention == "auto":  # decode attention rounding as the trainer's attention does
        engine_changes["decode_attention"] = decode_attention_for(cfg.train.packed is True)
    rollout_cfg = dataclasses.replace(cfg.rollout, **engine_changes)
    if shared:  # rank 0's decode process (the replica shared with it), every rank's handle; one group, made by all
        bound = cfg.train.collective_timeout_s
        worker = DecodeWorker(replica.model, rollout_cfg, tokenizer, bound / 2) if world.main else None
        engine = SharedDecode(worker, dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * bound)),
                              rollout_device)
    else:  # merged: a plain model
        engine = make_rollout_engine(rollout_cfg, replica.model if replica else model, tokenizer)
    if isinstance(replica, TensorParallelCopy):
        engine = group_decode(engine, replica)
    sync = None if replica is None else _replica_sync(replica, model, None if shared else engine)
    prefetch = None
    if cfg.train.async_rollout:
        prefetch = AsyncRollout(engine, sampler, cfg.train.prompts_per_step, device, sync=sync, agent=agent,
                                share=lambda rows: rank_share(rows, world))
        prefetch.restore(state)
    return TrainContext(
        cfg=cfg, model=model, tokenizer=tokenizer, device=device, engine=engine, prefetch=prefetch, agent=agent,
        params=params, optimizer=optimizer, scheduler=scheduler, sampler=sampler, reward_fns=reward_fns,
        acc_col=acc_col, adv_options=adv_options,
        reference=reference,
        shape=_shape(model, engine, cfg.rollout.tensor_parallel if split else 1),
        peaks=device_peaks(device, cfg.logging.peak_tflops, cfg.logging.hbm_tbs),
        run_dir=run_dir, logger=logger, start=start, entropy_coef=coef, world=world, replica=replica, run=run,
        lora_compute=LoraCompute(model, cfg.model),
        rollout_device=None if rollout_device is None or same_device(rollout_device, device) or not world.main
        else rollout_device,  # (a shared rollout's GPU is rank 0's alone)
        eval_rows=eval_rows,
    )


def _replica_sync(replica: Any, model: torch.nn.Module, engine: Any) -> Callable[[], None]:
    """Bring the replica up to date with `model`, then the engine's weights with the replica (a merged copy of an
    unmerged replica, where the engine keeps one; no engine: a rank that only joins a shared rollout's sync)."""
    def sync() -> None:
        replica.sync(model)
        if engine is not None:
            engine.weights.sync()

    return sync
