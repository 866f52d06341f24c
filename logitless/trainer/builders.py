"""Build the parts the loop needs from config sections: prompt rows, reward functions, optimizer, LR schedule (the
rollout's engine: `placement/engines.py`)."""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from logitless.data import TASKS, PromptRow, load_hf_prompts, load_jsonl_prompts, load_task
from logitless.rewards import get_reward_fn
from logitless.trainer.config.schema import DataConfig, OptimConfig, RewardConfig
from logitless.trainer.policy.modeling import QLORA_INSTALL_HINT, require_cuda_package
from logitless.trainer.checks.prompt_lengths import check_prompt_lengths  # noqa: F401  (where the trainer finds it)


def load_rows(cfg: DataConfig, split: str | None = None, *, eval: bool = False, console: Any = None,
              limit: int | None = None) -> list[PromptRow]:
    """Prompt rows of `cfg.task` for `split` (default: cfg.split, or cfg.eval_split when `eval`). `console` (rich):
    a large file is read with a progress bar there (one line when it is not a terminal). `limit`: at most this
    many rows, where the source can stop early (a file, a task with a `limit` option)."""
    split = split or (cfg.eval_split if eval else cfg.split)
    # the key that chose the split: eval.split when it overrides data.eval_split
    key = "data.split" if not eval else "data.eval_split" if split == cfg.eval_split else "eval.split"
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
    else:
        if cfg.task == "hub" and "name" not in options:
            raise ValueError("data.task='hub' needs data.options.name=<dataset name on the Hugging Face hub>")
        try:
            rows = load_hf_prompts(split=split, **options) if cfg.task == "hub" else load_task(cfg.task, split, **options)
        except ValueError as e:
            if repr(split) not in str(e) and f"split {split}" not in str(e):
                raise
            raise ValueError(f"{key}={split!r}: {e}; set {key} to a split data.task={cfg.task!r} has") from None
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


ACCURACY_REWARDS = ("numeric_answer", "math_verify", "code_tests")  # built-ins whose 1.0 means "correct"


def training_accuracy_index(cfg: RewardConfig) -> int | None:
    """Column of the reward a run's `accuracy` metric (the progress bar's "acc") counts 1.0 of: reward.accuracy_reward
    when set, else the first reward when it is a built-in correctness check (`ACCURACY_REWARDS`); None for any other
    reward, whose 1.0 need not mean "correct" (a constant reward would print acc 1.000)."""
    if cfg.accuracy_reward is None and (not cfg.reward_funcs or cfg.reward_funcs[0] not in ACCURACY_REWARDS):
        return None
    return accuracy_index(cfg)


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
