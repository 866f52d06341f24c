"""Everything a training run holds between steps, built once from the config (`build_context`)."""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from rich.console import Console

from logitless.agents import Agent
from logitless.data import PromptRow, PromptSampler
from logitless.objectives import AdvantageOptions, EntropyCoef, initial_entropy_coef
from logitless.rewards.models import load_reward_models
from logitless.trainer import checkpoint as ckpt
from logitless.trainer import dcp
from logitless.trainer.builders import (
    check_prompt_lengths,
    load_rows,
    make_optimizer,
    make_scheduler,
    reward_functions,
    sync_offloaded_params,
    training_accuracy_index,
)
from logitless.trainer.checks.model import model_config
from logitless.trainer.config.schema import TrainerConfig, to_dict, to_yaml
from logitless.trainer.distributed.parallel import QuietLogger, World, shard_model
from logitless.trainer.episodes import environment_weight
from logitless.trainer.evaluate import eval_options
from logitless.trainer.report.health import RunHealth
from logitless.trainer.memory.auto import has_auto, resolve
from logitless.trainer.memory.oom import MemoryState
from logitless.trainer.placement.engines import sampling_options
from logitless.trainer.placement.placement import RolloutPlacement
from logitless.trainer.policy.modeling import (
    LoraCompute,
    ReferencePolicy,
    check_packed_attention,
    load_model_and_tokenizer,
    prepare_for_training,
    trainable_parameters,
)
from logitless.trainer.policy.offload import ParkedState
from logitless.trainer.report.accounting import ModelShape, device_peaks
from logitless.trainer.report.metrics import MetricsLogger
from logitless.trainer.report.traces import EpisodeTraces
from logitless.trainer.report.tracking import open_trackers, resolve_report_to
from logitless.trainer.policy.vision import check_image_rows, load_processor
from logitless.models.vision import is_vision_language
from logitless.rollout.vision import is_processor
from logitless.trainer.rundir import RunDir, restart_advice, write_atomic


@dataclass
class TrainContext:
    """The model, its sampler engine, optimizer and data, and the state that carries across steps."""

    cfg: TrainerConfig
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    rollout: RolloutPlacement  # what decodes the step's samples, from which weights, where (placement/)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: PromptSampler
    reward_fns: list[Callable[..., list[float | None]]]
    acc_col: int | None  # column of the reward whose 1.0 means "correct" (None: no accuracy reward)
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
    empty_steps: int = 0  # consecutive steps whose completions were all empty
    parked: ParkedState = field(default_factory=ParkedState)  # train.offload_during_rollout's host buffers
    memory: MemoryState | None = None  # the memory plan's model and settings (trainer/memory/oom.py), where one is made
    on_micro_batch: Callable[[int], None] | None = None  # called before each micro-batch's forward (a test hook)
    agent: Agent | None = None  # agent.tools / agent.environment / agent.driver: what answers the model between turns
    run: RunDir | None = None  # the claimed run folder (rank 0): checked before each write
    t_start: float = field(default_factory=time.perf_counter)  # for the wall-time budget
    eval_rows: list[PromptRow] | None = None  # held-out rows of the eval during training (eval.every_steps, on_start)
    health: RunHealth | None = None  # the warnings of a run that trains on nothing (their memory is checkpointed)
    traces: EpisodeTraces | None = None  # agent.trace_episodes: episodes.jsonl (rank 0)
    processor: Any = None  # a vision-language model's processor (its tokenizer is `tokenizer`); None for a text model

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self, step: int) -> Path:
        """Write an atomic checkpoint of this step (model, optimizer, schedule, data position, RNG, entropy coef)."""
        if self.run is not None:
            self.run.check_alive()
        state = {"sampler": self.sampler.state_dict(), "entropy_coef": list(self.entropy_coef),
                 **({"health": self.health.state_dict()} if self.health is not None else {})}
        prefetch = self.rollout.prefetch
        pending = prefetch.state() if prefetch is not None else {}  # the next step's rollout in flight
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


def _processor(cfg: TrainerConfig, model: torch.nn.Module, tokenizer: Any) -> tuple[Any, Any]:
    """(tokenizer, processor): a vision-language model's processor (given as `tokenizer` to `train(model=...)`, or
    loaded from model.name_or_path) beside its tokenizer; (tokenizer, None) for a text model."""
    if is_processor(tokenizer):
        return tokenizer.tokenizer, tokenizer
    if not is_vision_language(model):
        return tokenizer, None
    if not cfg.model.name_or_path:
        raise ValueError("a vision-language model given to train(model=...) needs its processor: pass it as "
                         "tokenizer=")
    return tokenizer, load_processor(cfg.model, tokenizer)


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


def write_error_advice(run_dir: Path) -> Callable[[OSError], str]:
    """What a failed write in the run folder says: the OS error, and what to do (free space, --resume)."""
    return lambda e: (f"{ckpt.failure_reason(e)}. Free space or fix the folder's permissions; "
                      f"{restart_advice(run_dir)}")


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
                           write_error=write_error_advice(run_dir),
                           trackers=trackers, console=console)
    if run is not None and run.config_note:
        logger.console.print(run.config_note, highlight=False, markup=False, soft_wrap=True)
    return logger


def _shape(model: torch.nn.Module, decoded: torch.nn.Module | None, split: int = 1) -> ModelShape:
    """The training model's shape, with the weight bytes of the module the rollout decodes with (a merged bf16
    copy of a QLoRA model reads bf16 weights, not 4-bit ones); the model's own where the engine does not say.
    split: rollout.tensor_parallel, each rank reading 1/split of them per step."""
    shape = ModelShape.of(model)
    if decoded is None or decoded is model:
        return shape
    return dataclasses.replace(shape, decode_weight_bytes=ModelShape.of(decoded).decode_weight_bytes // split)


@dataclass
class Inputs:
    """The run's prompts and rewards, read before the model loads (their errors need no model)."""

    rows: list[PromptRow]
    sampler: PromptSampler
    eval_rows: list[PromptRow] | None  # held-out rows of the eval during training
    reward_fns: list[Callable[..., list[float | None]]]
    acc_col: int
    images: bool = False  # some row has images

    @classmethod
    def load(cls, cfg: TrainerConfig, console: Console | None, world_size: int = 1) -> Inputs:
        rows = load_rows(cfg.data, console=console)
        eval_rows = None
        if cfg.eval.every_steps or cfg.eval.on_start:
            eval_rows = load_rows(cfg.data, cfg.eval.split or cfg.data.eval_split, eval=True)[: cfg.eval.num_prompts]
        images = check_image_rows(cfg, rows + (eval_rows or []), world_size)
        return cls(rows, PromptSampler(rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle), eval_rows,
                   reward_functions(cfg.reward), training_accuracy_index(cfg.reward), images)

    def check_lengths(self, cfg: TrainerConfig, tokenizer: Any, model: torch.nn.Module) -> None:
        """Every prompt within the rollout's prompt limit and the model's context (`check_prompt_lengths`);
        `tokenizer` is a vision-language model's processor, which counts each image's tokens."""
        if self.images and not is_processor(tokenizer):
            raise ValueError(f"data.task={cfg.data.task!r} has rows with images, but model.name_or_path="
                             f"{cfg.model.name_or_path!r} is a text model: use a vision-language model")
        options = sampling_options(cfg.rollout, seed=None, chat_template_kwargs=cfg.data.chat_template_kwargs)
        check_prompt_lengths(self.rows, tokenizer, model, options, f"data.task={cfg.data.task!r}")
        if self.eval_rows is not None:
            check_prompt_lengths(self.eval_rows, tokenizer, model, eval_options(cfg),
                                 "eval during training (eval.every_steps)")


def build_context(
    cfg: TrainerConfig, world: World, *, resume: str | Path | None = None, model: torch.nn.Module | None = None,
    tokenizer: Any = None, run: RunDir | None = None, given: TrainerConfig | None = None,
) -> TrainContext:
    """Data and rewards first (their errors need no model), then model, rollout placement, optimizer, and the
    resumed state. `world`: this process's place, its process group already made (`parallel.process_group`); `run`:
    the claimed run folder (rank 0). `cfg`: the run's settings, "auto" decided (`memory.auto`; decided here, without
    the table, where the caller has not); `given`: the config as written (saved as the run's config)."""
    if has_auto(cfg):
        given = given or cfg
        cfg = resolve(cfg, world_size=world.size, model=model).cfg
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)  # the same on every rank: the model's random init (LoRA) must agree
    console = Console(stderr=True) if world.main else None  # the run's console (MetricsLogger prints there too)
    inputs = Inputs.load(cfg, console, world.size)
    model, tokenizer, device = _model(cfg, model, tokenizer, host=world.offload)
    tokenizer, processor = _processor(cfg, model, tokenizer)
    load_reward_models(inputs.reward_fns, device)  # model:/judge: rewards, on the training device unless they name one
    inputs.check_lengths(cfg, processor or tokenizer, model)
    if cfg.train.packed:
        check_packed_attention(model)
    reference = ReferencePolicy(model, device) if cfg.objective.beta > 0 else None  # before a resume loads weights
    rollout = RolloutPlacement.plan(cfg, world, model, device)  # a replica copies the full weights: before sharding
    if world.sharded:
        model = shard_model(model, device, offload=world.offload)
        if world.rank:
            seed_everything(cfg.train.seed + world.rank)  # per-rank streams from here on (dropout, rewards)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params, cfg.optim, host=world.offload)
    steps_per_rollout = cfg.train.num_iterations * cfg.train.steps_per_rollout  # optimizer steps per rollout batch
    scheduler = make_scheduler(optimizer, cfg.train.max_steps * steps_per_rollout, cfg.optim)
    state = _resumed_state(resume, world, model, optimizer, scheduler) if resume is not None else {}
    if state:
        inputs.sampler.load_state_dict(state["sampler"])
    start, run_dir = int(state.get("step", 0)), Path(cfg.train.output_dir)
    logger = _logger(given or cfg, run_dir, world, start, run, console)
    coef = EntropyCoef(*state["entropy_coef"]) if "entropy_coef" in state else initial_entropy_coef(cfg.objective)
    # (checked by preflight before the weights)
    agent = Agent(tokenizer, cfg.agent, cfg.data.chat_template_kwargs, processor) if cfg.agent.enabled else None
    try:
        rollout.start(cfg, world, model, processor or tokenizer, device, sampler=inputs.sampler, agent=agent,
                      state=state)
    except BaseException:
        if agent is not None:
            agent.close()  # its MCP servers stop with the failed start
        raise
    return TrainContext(
        cfg=cfg, model=model, tokenizer=tokenizer, device=device, rollout=rollout, agent=agent, params=params,
        optimizer=optimizer, scheduler=scheduler, sampler=inputs.sampler, reward_fns=inputs.reward_fns,
        acc_col=inputs.acc_col, adv_options=advantage_options(cfg), reference=reference,
        shape=_shape(model, rollout.decoded_module(), rollout.split),
        peaks=device_peaks(device, cfg.logging.peak_tflops, cfg.logging.hbm_tbs), run_dir=run_dir, logger=logger,
        start=start, entropy_coef=coef, world=world, run=run, lora_compute=LoraCompute(model, cfg.model),
        eval_rows=inputs.eval_rows, health=RunHealth(cfg, logger.print, state.get("health")),
        traces=EpisodeTraces(run_dir, cfg.agent.trace_episodes, start, write_atomic)
        if world.main and agent is not None and cfg.agent.trace_episodes else None, processor=processor,
    )
