"""Checks of a config that need no model weights: run by `--dry-run`, `logitless train` and `logitless eval` before
the (slow) model load and before the run folder is claimed, so that a bad option fails in seconds, naming its config
key and the fix.

    validate_config(cfg, training=True)   options, sampling, backend, device, task options, reward functions, agent,
                                          settings that need a CUDA GPU or an optional package
    preflight(cfg, training=True)         validate_config, then the sources, the model's own config (positions,
                                          attention, LoRA targets: `model_checks`) and the first data rows against
                                          the rewards (`data_checks`); returns what it checked
    check_resume(cfg, checkpoint)         the checkpoint fits the config (model keys, train.max_steps)
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from logitless.data import TASKS, load_hf_prompts, load_jsonl_prompts
from logitless.objectives.options import ADVANTAGE_ESTIMATORS
from logitless.rewards import reward_name
from logitless.rollout import BACKENDS
from logitless.rollout.fp8 import require_fp8
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import OFFLOAD_INSTALL_HINT, accuracy_index, load_rows, reward_functions
from logitless.trainer.placement.engines import routing_replay_obstacle, sampling_options
from logitless.trainer.config.schema import TrainerConfig
from logitless.trainer.checks.data import FIRST_ROWS, check_reward_fields, check_row_tools
from logitless.trainer.episodes import ENVIRONMENT_REWARD, environment_weight
from logitless.trainer.distributed.fsdp_offload import check_fsdp_offload
from logitless.trainer.distributed.parallel import World, check_distributed, launched_world
from logitless.trainer.placement import check_placement
from logitless.trainer.report.tracking import check_report_to, check_tracker_credentials
from logitless.trainer.checks.model import check_model, model_config, read_model_config
from logitless.trainer.report.health import TRUNCATED_FRACTION, estimate_truncation
from logitless.trainer.policy.modeling import (
    LIGER_INSTALL_HINT,
    QLORA_INSTALL_HINT,
    load_tokenizer,
    require_bitsandbytes,
    require_cuda_package,
    resolve_device,
)
from logitless.trainer.checks.sources import check_sources, model_cached

# Model keys that change the weights a checkpoint holds (or what they mean): they must match on resume / eval.
WEIGHT_KEYS = ("name_or_path", "gguf_file", "revision", "lora", "lora_r", "lora_alpha", "lora_target_modules")


def validate_config(cfg: TrainerConfig, *, training: bool = True) -> None:
    """Raise ValueError naming the config key and the fix for anything wrong that can be seen without a model."""
    if training:
        _check_training(cfg)
    sampling_options(cfg.rollout, seed=None)  # every sampling option, named by its rollout.* key
    sampling_options(
        cfg.rollout, seed=None, num_generations=cfg.eval.pass_k, temperature=0.0 if cfg.eval.pass_k == 1 else None,
        max_new_tokens=cfg.eval.max_completion_length, section="eval",
    )
    if cfg.rollout.backend not in (*BACKENDS, "auto"):
        close = difflib.get_close_matches(cfg.rollout.backend, BACKENDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"rollout.backend={cfg.rollout.backend!r} is not a rollout backend{hint} Use one of {BACKENDS} or auto")
    check_device(cfg.model.device)
    check_task_options(cfg.data.task, cfg.data.options, "data.options")
    check_task_options(cfg.data.task, {**cfg.data.options, **cfg.data.eval_options}, "data.eval_options")
    if not cfg.reward.reward_funcs and environment_weight(cfg) is None:
        raise ValueError("reward.reward_funcs is empty; name at least one reward function (e.g. numeric_answer), "
                         "or an agent.environment (or agent.driver) whose episodes give the reward")
    reward_functions(cfg.reward)
    accuracy_index(cfg.reward)
    check_agent(cfg)
    check_cuda_settings(cfg, training=training)


def preflight(cfg: TrainerConfig, *, training: bool = True, model_given: bool = False, tokenizer: Any = None) -> list[str]:
    """Every check of `cfg` made before the model loads (`--dry-run` makes these and stops), cheapest first:
    `validate_config`, the model and dataset sources (cached or reachable), the model's config (positions, attention
    implementation, LoRA targets; skipped for a model passed in, `model_given`), the agent's tools, environment and
    chat template (with `tokenizer`, else the model's, loaded without weights) and with agent.tools_field every row's
    tool set, then the split's first rows against the fields the rewards read. Raises naming the config key and the
    fix; returns one line per check."""
    validate_config(cfg, training=training)
    lines = ["every config key and value, sampling options, rollout backend, devices, task options, reward functions"]
    if not model_given:
        check_sources(cfg, eval=not training)
        name = cfg.model.name_or_path or "the demo model (SmolLM2-135M-Instruct GGUF)"
        lines.append(f"sources: model {name} and the data of data.task={cfg.data.task!r} are local, in the hub cache "
                     "or reachable")
        config = read_model_config(cfg.model, cached=model_cached(cfg.model))
        attn = model_config(cfg).attn_implementation if training else cfg.model.attn_implementation
        lines += check_model(cfg, config, training=training, attn=attn)
    if check_reward_models(cfg):
        lines.append("reward models and judges: devices, config (the kind of model) and tokenizer")
    if cfg.agent.enabled:
        from logitless.agents import Agent

        from logitless.models.vision import is_vision_language
        from logitless.rollout.vision import is_processor, text_tokenizer
        from logitless.trainer.policy.vision import load_processor

        processor = tokenizer if is_processor(tokenizer) else None
        tokenizer = text_tokenizer(tokenizer) if tokenizer is not None else load_tokenizer(cfg.model)
        if processor is None and not model_given and is_vision_language(config):  # its template renders images
            processor = load_processor(cfg.model, tokenizer)
        agent = Agent(tokenizer, cfg.agent, cfg.data.chat_template_kwargs, processor)
        agent.close()  # (MCP servers started to list their tools stop again; their names stay known)
        if cfg.agent.tools_field is not None:
            lines.append(check_row_tools(cfg, agent, training, load_rows))
        lines.append(f"agent: the driver {cfg.agent.driver} imports and takes agent.driver_options"
                     if cfg.agent.driver is not None else
                     "agent: every tool and the environment import and check, and the chat template renders them")
    split = cfg.data.split if training else (cfg.eval.split or cfg.data.eval_split)
    rows = load_rows(cfg.data, split, eval=not training, limit=FIRST_ROWS)
    lines.append(check_reward_fields(cfg, cfg.reward.reward_funcs, reward_functions(cfg.reward), rows, split))
    if any(isinstance(r.prompt, list) and r.prompt and isinstance(r.prompt[0], dict) for r in rows) and not (
            cfg.agent.enabled and cfg.agent.chat_template):
        tokenizer = tokenizer if tokenizer is not None else _tokenizer_if_loadable(cfg)
        if tokenizer is not None:  # (one that cannot load fails with the model, naming why)
            check_chat_template(tokenizer, cfg, split)
            lines.append("chat prompts: the tokenizer has a chat template")
    if training and (estimate := estimate_truncation(rows, cfg.rollout.max_completion_length, tokenizer)) is not None:
        line, share = estimate
        lines.append(line)
        if share > TRUNCATED_FRACTION:
            warnings.warn(f"{line}: most completions as long as those would be cut and score as unfinished; raise "
                          "rollout.max_completion_length (or ask for shorter answers)", stacklevel=2)
    return lines


def _tokenizer_if_loadable(cfg: TrainerConfig) -> Any:
    """The model's tokenizer (no weights), or None when it cannot be loaded here (the model load reports that)."""
    try:
        return load_tokenizer(cfg.model)
    except Exception:  # noqa: BLE001 (transformers raises OSError, ValueError, ... for a folder without one)
        return None


def check_chat_template(tokenizer: Any, cfg: TrainerConfig, split: str) -> None:
    """Chat-message prompts (the data's first rows) need the tokenizer's chat template: refuse a tokenizer without
    one, naming the data option that makes the prompts raw text."""
    if getattr(tokenizer, "chat_template", None):
        return
    model = cfg.model.name_or_path or "the demo model"
    raise ValueError(f"data.task={cfg.data.task!r} split {split!r} gives chat-message prompts, but the tokenizer of "
                     f"model.name_or_path={model!r} has no chat template (a base model?): set data.options.chat=false "
                     "to train on "
                     "the prompts as plain text, or use a model whose tokenizer has a chat template (an instruct "
                     "model)")


def check_reward_models(cfg: TrainerConfig) -> int:
    """The `model:` and `judge:` rewards' `device` options are devices here, and their config and tokenizer (read
    without weights) fit what they are used as (`_ModelReward.check`); returns how many were checked."""
    from logitless.rewards.models import RewardModel, Judge

    fns = [(spec, fn) for spec, fn in zip(cfg.reward.reward_funcs, reward_functions(cfg.reward))
           if isinstance(fn, (RewardModel, Judge))]
    for spec, fn in fns:
        if fn.device_name is not None:
            check_device(fn.device_name, f"reward.reward_options[{spec!r}].device")
        fn.check()
    return len(fns)


def check_cuda_settings(cfg: TrainerConfig, *, training: bool = True) -> None:
    """Refuse a setting that needs a CUDA GPU (and its optional package) when model.device is not one, or the
    package is missing: Liger's kernels, the 8-bit and CPU-offload optimizers; QLoRA (model.load_in_4bit) needs
    bitsandbytes on a CUDA GPU or the CPU."""
    device = resolve_device(cfg.model.device)
    if training:  # (`logitless eval` decodes in the model's dtype)
        check_fp8(cfg, device)
    if cfg.model.load_in_4bit:
        require_bitsandbytes("model.load_in_4bit=true", device)
    wanted = [
        (cfg.model.liger_kernels is True, "model.liger_kernels=true", "liger_kernel", LIGER_INSTALL_HINT),
        (training and cfg.optim.optimizer == "adamw_8bit", "optim.optimizer='adamw_8bit'", "bitsandbytes",
         QLORA_INSTALL_HINT),
        (training and cfg.optim.optimizer == "adamw_cpu_offload", "optim.optimizer='adamw_cpu_offload'", "torchao",
         OFFLOAD_INSTALL_HINT),
    ]
    for on, setting, package, hint in wanted:
        if not on:
            continue
        if device.type != "cuda":
            where = "no CUDA GPU is usable here" if cfg.model.device == "auto" else f"model.device={cfg.model.device}"
            raise ValueError(f"{setting} needs a CUDA GPU ({package}'s kernels), but {where}; turn it off to run on "
                             f"{device.type}")
        require_cuda_package(package, setting, hint, device)


def check_fp8(cfg: TrainerConfig, device: torch.device) -> None:
    """Refuse rollout.fp8 where the rollout decodes on a GPU without FP8 products (compute capability below 8.9),
    naming the setting and the fix; `device`: the training device (the rollout's, unless rollout.device names one)."""
    if not cfg.rollout.fp8:
        return
    try:
        where = torch.device(cfg.rollout.device) if cfg.rollout.device is not None else device
    except RuntimeError:  # (not a device: check_rollout_device names it)
        return
    require_fp8(where)


def _check_training(cfg: TrainerConfig) -> None:
    if cfg.rollout.num_generations == 1:
        raise ValueError(
            "rollout.num_generations=1: every advantage would be 0, so every step would have loss 0 and grad_norm 0. "
            f"All advantage estimators (advantage.estimator in {ADVANTAGE_ESTIMATORS}, with any advantage.scale or "
            "advantage.multi_reward) subtract a baseline taken from the other samples of the same prompt, which "
            "needs at least 2. Set rollout.num_generations=2 or more (8 is typical)"
        )
    if cfg.advantage.reward_weights is not None:
        raise ValueError("set reward weights once, in reward.reward_weights (advantage.reward_weights is filled from it)")
    if cfg.advantage.credit == "turn" and not cfg.agent.enabled:
        raise ValueError(
            "advantage.credit=turn gives each model turn of a multi-turn episode its own advantage, but this run has "
            "no agent, so every completion is one turn; set agent.environment (its step() rewards each turn) or "
            "agent.driver, or advantage.credit=episode"
        )
    if cfg.objective.max_completion_length not in (None, cfg.rollout.max_completion_length):
        raise ValueError(
            f"objective.max_completion_length={cfg.objective.max_completion_length} (the dr_grpo normalizer) differs "
            f"from rollout.max_completion_length={cfg.rollout.max_completion_length}; set both to the same value"
        )
    budget, r = cfg.train.micro_batch_tokens, cfg.rollout
    if isinstance(budget, int) and r.max_prompt_length is not None and budget < r.max_prompt_length + r.max_completion_length:
        longest = r.max_prompt_length + r.max_completion_length
        raise ValueError(
            f"train.micro_batch_tokens={budget} is smaller than the longest row a step can hold "
            f"(rollout.max_prompt_length + rollout.max_completion_length = {longest}); set "
            f"train.micro_batch_tokens >= {longest}, or lower those lengths"
        )
    replicas = launched_world().size > 1  # under torchrun the static backend decodes from a replica on every rank
    if cfg.train.async_rollout and r.device is None and (r.backend not in ("static", "auto") or not replicas and (
            r.merge_lora is False or not cfg.model.lora)):
        raise ValueError(
            "train.async_rollout=true samples from a copy of the weights while the update runs: it needs "
            f"rollout.backend=static (got {r.backend!r}) and, on one process, model.lora=true (got {cfg.model.lora}) "
            f"and rollout.merge_lora unset or true (got {r.merge_lora}), or a replica on its own device "
            "(rollout.device, e.g. cuda:1); under torchrun every rank decodes from a replica of its own. Set those, "
            "or train.async_rollout=false"
        )
    check_rollout_device(cfg)
    why = routing_replay_obstacle(r.backend, cfg.agent.enabled, replicas and (r.device is not None or
                                                                          r.tensor_parallel > 1))
    if cfg.model.routing_replay is True and why is not None:  # (whether the model has experts: once it is loaded)
        raise ValueError(f"model.routing_replay=true: {why}; set model.routing_replay=auto (off here) or false")
    if cfg.train.async_rollout and (cfg.eval.every_steps or cfg.eval.on_start):
        raise ValueError(
            "eval.every_steps / eval.on_start evaluate with the run's rollout engine, which train.async_rollout=true "
            "keeps busy with the next step's rollout; set eval.every_steps=0 and eval.on_start=false (and run "
            "`logitless eval --checkpoint RUN` on the checkpoints), or train.async_rollout=false")
    if cfg.train.dynamic_sampling and (cfg.train.async_rollout or launched_world().size > 1):
        raise ValueError(
            "train.dynamic_sampling=true samples more prompts within a step until it has enough informative groups, "
            "which train.async_rollout (a step's rollout starts during the step before) and torchrun (each rank "
            "samples its own share) do not support yet; set train.dynamic_sampling=false, or run one process with "
            "train.async_rollout=false")
    check_report_to(cfg.logging.report_to, cfg.logging.tensorboard)
    check_tracker_credentials(cfg.logging.report_to, cfg.logging.tensorboard, cfg.logging.tracker_options)


    if cfg.train.async_rollout and cfg.train.offload_during_rollout is True:
        raise ValueError(
            "train.offload_during_rollout=true moves the optimizer states to the host while the rollout runs, but "
            "train.async_rollout=true runs the update at the same time; set one of them to false"
        )
    check_fsdp_offload(cfg)
    if cfg.train.async_rollout and r.weight_copy not in (None, "resident"):
        raise ValueError(
            f"rollout.weight_copy={r.weight_copy} frees or restores the merged weights after each rollout, but "
            "train.async_rollout=true samples from them while the update runs; set rollout.weight_copy=resident (or "
            "unset it) for async rollouts"
        )


def check_agent(cfg: TrainerConfig) -> None:
    """Refuse settings that cannot run multi-turn episodes (agent.tools / .environment / .driver), naming both keys and
    the fix. What needs the tokenizer or imports user code (tools, the environment, the chat template) is checked
    by `preflight`, which builds the run's `Agent` before the weights load."""
    agent = cfg.agent
    if not agent.enabled:
        return
    on = (f"agent.tools={list(agent.tools)}" if agent.tools else f"agent.environment={agent.environment!r}"
          if agent.environment is not None else f"agent.driver={agent.driver!r}" if agent.driver is not None
          else f"agent.mcp_servers={[s.get('name') for s in agent.mcp_servers]}")
    if cfg.rollout.backend == "continuous":
        raise ValueError(f"{on} runs multi-turn episodes, which rollout.backend=continuous cannot: set "
                         "rollout.backend=hf (or static)")
    names = [reward_name(f) for f in reward_functions(cfg.reward)]
    if environment_weight(cfg) is not None and ENVIRONMENT_REWARD in names:
        raise ValueError(f"reward.reward_funcs names a function {ENVIRONMENT_REWARD!r}, the name of the column of "
                         f"{on}'s own rewards: rename the function")


def check_device(name: str, key: str = "model.device") -> None:
    """Refuse a device that does not parse or is not present on this machine (`key`: model.device or
    rollout.device)."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{key}={name!r} is not a device ({e}); use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{key}={name!r} but this machine has no usable CUDA GPU; use {key}=cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{key}={name!r} but only {torch.cuda.device_count()} CUDA device(s) exist; use "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{key}={name!r} but MPS is not available here; use {key}=cpu (or auto)")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{key}={name!r}: logitless runs on cpu, cuda or mps; use one of those (or auto)")


def check_rollout_device(cfg: TrainerConfig) -> None:
    """Refuse a rollout.device that is not a device here, or a setting that cannot go with a replica on its own
    device, naming both and the fix."""
    name = cfg.rollout.device
    if name is None:
        return
    if name == "auto":
        raise ValueError("rollout.device=auto: unset rollout.device to decode on the training device, or name the "
                         "rollout's own device (e.g. cuda:1)")
    check_device(name, "rollout.device")
    off = "unset rollout.device"
    refused = [
        (cfg.model.load_in_4bit, "model.load_in_4bit=true (QLoRA)",
         "the replica copies the model's weights, and bitsandbytes' 4-bit weights do not copy across devices",
         "model.load_in_4bit=false"),
        (cfg.train.offload_during_rollout is True, "train.offload_during_rollout=true",
         "the rollout then holds no memory on the training device, so parking the training state saves nothing",
         "train.offload_during_rollout=false"),
        (cfg.rollout.weight_copy not in (None, "resident"), f"rollout.weight_copy={cfg.rollout.weight_copy}",
         "the replica on the rollout's device holds its own weights for the whole run",
         "rollout.weight_copy=resident (or unset it)"),
    ]
    for on, setting, why, fix in refused:
        if on:
            raise ValueError(f"{setting} cannot run with rollout.device={name}: {why}; set {fix} or {off}")


def check_task_options(task: str, options: dict[str, Any], where: str) -> None:
    """Refuse an option the task's loader does not take, naming `where`.<option> and the valid ones."""
    if task == "jsonl":
        fn, skip = load_jsonl_prompts, ("progress",)
    elif task == "hub":
        fn, skip = load_hf_prompts, ("split",)
    elif task in TASKS:
        fn, skip = TASKS[task], ("split",)
    else:
        close = difflib.get_close_matches(task, [*TASKS, "jsonl", "hub"], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"data.task={task!r} is not a task{hint} Use one of {sorted([*TASKS, 'jsonl', 'hub'])}")
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [p for p in params if p not in skip]
    for opt in options:
        if opt not in valid:
            close = difflib.get_close_matches(opt, valid, n=1)
            hint = f"; did you mean '{where}.{close[0]}'?" if close else ""
            raise ValueError(f"{where}.{opt}: data.task={task!r} has no option {opt!r}{hint} Valid: {valid}")


def check_resume(cfg: TrainerConfig, checkpoint: Path, *, flag: str = "--resume", training: bool = True) -> None:
    """The checkpoint was trained with the model keys of `cfg` (names each differing key), and has steps left."""
    saved = (ckpt.checkpoint_config(checkpoint) or {}).get("model")
    if isinstance(saved, dict):
        now = {k: getattr(cfg.model, k) for k in WEIGHT_KEYS}
        diff = [k for k in WEIGHT_KEYS if k in saved and _norm(saved[k]) != _norm(now[k])]
        if diff:
            was = ", ".join(f"model.{k}={saved[k]!r}" for k in diff)
            given = ", ".join(f"model.{k}={now[k]!r}" for k in diff)
            raise ValueError(
                f"{flag} {checkpoint}: the checkpoint was trained with {was}, but this config has {given}. "
                f"Use the checkpoint's values (drop the override, or set {' '.join(f'model.{k}={saved[k]}' for k in diff)})"
            )
    if training:
        step = ckpt.checkpoint_step(checkpoint)
        if step >= cfg.train.max_steps:
            raise ValueError(
                f"{flag} {checkpoint}: the run is already at step {step} and train.max_steps={cfg.train.max_steps}; "
                f"nothing to train. To continue it, raise train.max_steps, e.g. {flag} "
                f"{checkpoint.parent.parent} train.max_steps={step + cfg.train.max_steps}"
            )


def _norm(v: Any) -> Any:
    """Comparable form of a model key: lists unordered, an existing local path resolved."""
    if isinstance(v, (list, tuple)):
        return sorted(v)
    if isinstance(v, str) and v and Path(v).expanduser().exists():
        return str(Path(v).expanduser().resolve())
    return v


def check_output_file(path: str | Path, flag: str) -> None:
    """The folder of an output file exists and is writable (checked before hours of work produce it)."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: the folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {str(path)!r}: the folder {folder} is not writable; choose another path")


def check_world(cfg: TrainerConfig, world: World) -> None:
    """Refuse settings that cannot run on `world.size` ranks: the rollout's placement, then the sharding; naming the
    setting and the fix. Config only, so `--dry-run --ranks N` runs it as each rank of a run does."""
    check_placement(cfg, world.size)
    check_distributed(cfg, world)
