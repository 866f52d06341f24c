"""Build the parts the loop needs from config sections: prompt rows, reward functions, optimizer, LR schedule."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from logitless.data import TASKS, PromptRow, load_hf_prompts, load_jsonl_prompts, load_task
from logitless.models.routing import require_routing, routing_of
from logitless.rewards import get_reward_fn
from logitless.rollout import RolloutEngine, SamplingOptions, make_engine, sleep
from logitless.rollout.engine import unwrap_model
from logitless.rollout.weights import LiveWeights, MergedLoraWeights, in_place_refusal, merges
from logitless.trainer.config import DataConfig, OptimConfig, RewardConfig, RolloutConfig
from logitless.trainer.modeling import QLORA_INSTALL_HINT, require_cuda_package
from logitless.trainer.prompt_lengths import check_prompt_lengths  # noqa: F401  (where the trainer finds it)


def load_rows(cfg: DataConfig, split: str | None = None, *, eval: bool = False, console: Any = None,
              limit: int | None = None) -> list[PromptRow]:
    """Prompt rows of `cfg.task` for `split` (default: cfg.split, or cfg.eval_split when `eval`). `console` (rich):
    a large file is read with a progress bar there (one line when it is not a terminal). `limit`: at most this
    many rows, where the source can stop early (a file, a task with a `limit` option)."""
    split = split or (cfg.eval_split if eval else cfg.split)
    options = {**cfg.options, **(cfg.eval_options if eval else {})}
    takes_limit = cfg.task in ("jsonl", "hub") or (
        cfg.task in TASKS and "limit" in inspect.signature(TASKS[cfg.task]).parameters)
    if limit is not None and takes_limit:
        options["limit"] = min(limit, options.get("limit") or limit)
    if cfg.task == "jsonl":
        if "path" not in options:
            raise ValueError("data.task='jsonl' needs data.options.path=<file.jsonl> (and data.eval_options.path for eval)")
        with reading_progress(options["path"], console) as progress:
            rows = load_jsonl_prompts(**options, progress=progress)
    elif cfg.task == "hub":
        if "name" not in options:
            raise ValueError("data.task='hub' needs data.options.name=<dataset name on the Hugging Face hub>")
        rows = load_hf_prompts(split=split, **options)
    else:
        rows = load_task(cfg.task, split, **options)
    if not rows:
        raise ValueError(f"data.task={cfg.task!r} split {split!r} has no rows; check data.options")
    return rows if limit is None else rows[:limit]


BIG_FILE = 64 * 2**20  # bytes: a prompt file at least this large is read with a progress bar


@contextlib.contextmanager
def reading_progress(path: Any, console: Any) -> Iterator[Callable[[int, int, int], None] | None]:
    """A `progress(bytes read, file bytes, rows)` callback showing a rich progress bar on `console` while a large
    file is read (on a terminal), and one line when it is done; None (nothing shown) for a small file or no console."""
    p = Path(str(path)).expanduser()
    size = p.stat().st_size if p.is_file() else 0
    if console is None or size < BIG_FILE:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    t0, rows = time.perf_counter(), [0]
    bar = Progress(TextColumn(f"reading {p.name}"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[rows]:,} rows"),
                   TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal)
    task = bar.add_task("", total=size, rows=0)
    if not console.is_terminal:  # a log: say what the silence is
        console.print(f"reading {p} ({size / 2**20:,.0f} MiB)...", highlight=False)

    def progress(done: int, total: int, n: int) -> None:
        rows[0] = n
        bar.update(task, completed=done, rows=n)

    with bar:
        yield progress
    console.print(f"read {rows[0]:,} rows of {p} ({size / 2**20:,.0f} MiB) in {time.perf_counter() - t0:.1f} s",
                  highlight=False)


def reward_functions(cfg: RewardConfig) -> list[Callable[..., list[float | None]]]:
    """The configured reward functions, with their `reward_options` bound."""
    unknown = [k for k in cfg.reward_options if k not in cfg.reward_funcs]
    if unknown:
        raise ValueError(
            f"reward.reward_options has entries {unknown} that are not in reward.reward_funcs={cfg.reward_funcs}"
        )
    return [get_reward_fn(spec, **cfg.reward_options.get(spec, {})) for spec in cfg.reward_funcs]


def accuracy_index(cfg: RewardConfig) -> int:
    """Column of the reward whose value 1.0 counts as a correct answer."""
    if cfg.accuracy_reward is None:
        return 0
    if cfg.accuracy_reward not in cfg.reward_funcs:
        raise ValueError(
            f"reward.accuracy_reward={cfg.accuracy_reward!r} is not one of reward.reward_funcs={cfg.reward_funcs}"
        )
    return cfg.reward_funcs.index(cfg.accuracy_reward)


OFFLOAD_INSTALL_HINT = "pip install 'logitless[offload]'  (torchao)"


def make_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, host: bool = False) -> torch.optim.Optimizer:
    """AdamW of `cfg.optimizer`: torch's, bitsandbytes' 8-bit-state AdamW8bit, or torchao's CPUOffloadOptimizer
    (fp32 states and the update on the CPU, the parameters copied back after each step). host: the parameters
    are FSDP2 shards in host memory (train.fsdp_offload), stepped by torch's fused CPU AdamW (one vectorized
    pass, 3-5x the plain loop)."""
    if not params:
        raise ValueError("the model has no trainable parameters (model.lora=false and everything frozen?)")
    kwargs = dict(
        lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
    )
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs, **({"fused": True} if host else {}))
    device = params[0].device
    setting = f"optim.optimizer={cfg.optimizer!r}"
    if cfg.optimizer == "adamw_8bit":
        require_cuda_package("bitsandbytes", setting, QLORA_INSTALL_HINT, device)
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    require_cuda_package("torchao", setting, OFFLOAD_INSTALL_HINT, device)
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(params, torch.optim.AdamW, **kwargs)


def clip_offloaded_grads(optimizer: torch.optim.Optimizer, norm: float, max_norm: float) -> None:
    """Apply gradient clipping to the host copies of a CPUOffloadOptimizer.

    It copies each gradient to the host as soon as backward has produced it, before the step clips the device
    gradients; scale the host copies by the same factor `clip_grad_norm_` used (a no-op without clipping).
    """
    coef = torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6)  # as torch
    if not hasattr(optimizer, "param_d2h_map") or not coef < 1.0:
        return
    optimizer.stream.synchronize()  # the backward's device-to-host gradient copies are done
    for host in optimizer.param_d2h_map.values():
        host.grad.mul_(coef)


def sync_offloaded_params(optimizer: torch.optim.Optimizer) -> None:
    """Refresh a CPUOffloadOptimizer's host copies of the weights from the model (after a checkpoint was loaded
    into the model: its steps update the host copies and copy them back, so stale ones would undo the load)."""
    for device_param, host in getattr(optimizer, "param_d2h_map", {}).items():
        host.copy_(device_param.detach())


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of the base learning rate before optimizer step `step` (0-based) of `total`.

    Linear warmup over `warmup_steps` (or `warmup_ratio * total`), then constant or cosine decay to 0.
    """
    warmup = cfg.warmup_steps or int(math.ceil(cfg.warmup_ratio * total))
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))


ROUTE_BACKENDS = ("static", "hf")  # rollout backends that record mixture-of-experts routes


def routing_replay_on(cfg: Any, model: Any, *, agent: bool, separate_decode: bool) -> bool:
    """model.routing_replay resolved: whether the rollout records each token's experts and the trainer's forwards
    replay them (`models/routing.py`). "auto": on for a mixture-of-experts model with a supported router wherever
    routes can be recorded (rollout.backend static or hf, single-turn, decoded in this process); true: the same,
    with an error naming what stands in the way."""
    want = cfg.model.routing_replay
    if want is False:
        return False
    base = unwrap_model(model)
    if routing_of(base) is None:
        if want is True:
            require_routing(base, "model.routing_replay")  # raises, saying why
        return False
    why = routing_replay_obstacle(cfg.rollout.backend, agent, separate_decode)
    if why is not None and want is True:
        raise ValueError(f"model.routing_replay=true: {why}; set model.routing_replay=auto (off here) or false")
    return why is None


def routing_replay_obstacle(backend: str, agent: bool, separate_decode: bool) -> str | None:
    """Why the rollout cannot record routes for replay (None: it can; backend "auto" counts as one that can)."""
    if backend not in (*ROUTE_BACKENDS, "auto"):
        return f"rollout.backend={backend} does not record routes (use static or hf)"
    if agent:
        return "multi-turn episodes (agent.tools / agent.environment) do not record routes yet"
    if separate_decode:
        return ("a shared rollout GPU's decode process or a tensor-parallel rollout (rollout.device or "
                "rollout.tensor_parallel under torchrun) does not record routes yet")
    return None


def make_rollout_engine(cfg: RolloutConfig, model: Any, tokenizer: Any, record_routes: bool = False) -> RolloutEngine:
    """The rollout section's engine; backend "static" decodes from merged LoRA weights when rollout.merge_lora
    allows (`MergedLoraWeights`, kept where rollout.weight_copy says), else from the model, under the
    rollout.max_kv_gib budget. record_routes: record mixture-of-experts routes (`routing_replay_on`)."""
    if cfg.backend != "static":
        return make_engine(cfg.backend, model, tokenizer, **({"record_routes": True} if record_routes else {}))
    merged = merges(model, cfg.merge_lora)
    mode = weight_copy(cfg, next(model.parameters()).device, has_copy=merged, distributed=False,
                       in_place_why=in_place_refusal(model) if merged else None)
    weights = MergedLoraWeights(model, mode, fuse=cfg.fuse_projections is not False) if merged else LiveWeights(model)
    check_fused(cfg, getattr(weights, "groups", []),
                "the model has no plain q/k/v or gate/up layers" if merged else
                "the engine decodes with the training model itself (full fine-tuning on one process, "
                "rollout.merge_lora=false, or DoRA adapters), whose layout the rollout does not change")
    return make_engine("static", model, tokenizer, weights=weights, max_kv_gib=cfg.max_kv_gib, profile=cfg.profile,
                       length_buckets=cfg.length_buckets, compact_finished=cfg.compact_finished,
                       decode_attention=cfg.decode_attention, sampler_kernel=cfg.sampler_kernel,
                       step_graph=cfg.step_graph, record_routes=record_routes)


def decode_attention_for(packed: bool) -> str:
    """rollout.decode_attention for `auto` in a run: the static engine's decode attention rounds as the trainer's own
    attention does where one of its kernels is the trainer's. Padded micro-batches run torch's sdpa (its
    memory-efficient kernel), so the decode takes sdpa: the sampler then tracks the trainer to hf's level on every
    family (bench/LOG.md, "The decode kernel rounds as the trainer does"). Packed ones run varlen flash attention,
    which none of the decode's kernels is, so the decode takes the engine's own choice (`auto`: the Triton
    flash-decoding kernel on a recent CUDA GPU, 1.38-1.60x faster than sdpa per decode step); each run logs the gap
    it has (`rollout/mismatch_*`)."""
    return "auto" if packed else "sdpa"


def check_fused(cfg: RolloutConfig, groups: list, why: str) -> None:
    """Refuse rollout.fuse_projections=true where the rollout's weights fused nothing (`why` says why not)."""
    if cfg.fuse_projections and not groups:
        raise ValueError(f"rollout.fuse_projections=true found no projections to fuse: {why}; unset "
                         "rollout.fuse_projections")


def weight_copy(cfg: RolloutConfig, device: torch.device, *, has_copy: bool, distributed: bool,
                in_place_why: str | None = None) -> str:
    """Where the rollout's merged weights or replica live (rollout.weight_copy; see `MergedLoraWeights`): the
    setting, or when unset in_place on one CUDA process (sleep where the base weights cannot take the merge:
    4-bit), sleep under torchrun on CUDA, resident otherwise. Raises when the setting cannot apply."""
    mode = cfg.weight_copy
    if mode is None:
        if not has_copy or device.type != "cuda":
            return "resident"
        if not distributed and in_place_why is None:
            return "in_place"
        return "sleep" if sleep.unavailable(device) is None else "resident"
    why = None
    if not has_copy:
        why = ("the engine decodes with the training model itself (no merged-LoRA copy: full fine-tuning on one "
               "process, rollout.merge_lora=false, or DoRA adapters)")
    elif mode == "sleep":
        why = sleep.unavailable(device)
    elif mode == "in_place":
        why = ("the training weights are sharded (torchrun or train.fsdp_offload; use sleep or resident)" if distributed
               else in_place_why)
    if why is not None and mode != "resident":
        raise ValueError(f"rollout.weight_copy={mode} cannot apply: {why}; unset rollout.weight_copy or set it to "
                         "resident")
    return mode


def sampling_options(
    cfg: RolloutConfig,
    *,
    seed: int | None,
    num_generations: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    section: str = "rollout",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> SamplingOptions:
    """`logitless.rollout.SamplingOptions` of the rollout section (TRL names mapped to the engine's);
    `chat_template_kwargs`: data.chat_template_kwargs.

    An invalid option is reported under its config key (`rollout.top_p`, or `eval.pass_k` for `section="eval"`).
    """
    options = SamplingOptions(
        num_generations=cfg.num_generations if num_generations is None else num_generations,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        repetition_penalty=cfg.repetition_penalty,
        max_new_tokens=cfg.max_completion_length if max_new_tokens is None else max_new_tokens,
        stop=list(cfg.stop),
        seed=seed,
        max_prompt_length=cfg.max_prompt_length,
        chat_template_kwargs=dict(chat_template_kwargs) if chat_template_kwargs else None,
    )
    keys = {f: f"rollout.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                                         "max_prompt_length", "num_generations")}
    keys["max_new_tokens"] = "rollout.max_completion_length"
    if section == "eval":
        keys["num_generations"] = "eval.pass_k"
        if max_new_tokens is not None:
            keys["max_new_tokens"] = "eval.max_completion_length"
    try:
        options.validate()
    except (ValueError, TypeError) as e:
        message = str(e)
        for name, key in keys.items():
            message = message.replace(f"SamplingOptions.{name}", key)
        raise type(e)(message) from None
    return options


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `torch.set_num_threads(n)` (CPU intra-op threads), restoring the previous count."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
