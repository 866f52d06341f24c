"""The training loop of `logitless train`, top to bottom.

    for each step:
        prompts  = sampler.next_batch(prompts_per_step)                         logitless.data
        rollout  = engine.generate(prompts, G samples each)                     logitless.rollout
        rewards  = score_completions(reward_funcs, completions, row fields)     logitless.rewards
        adv      = compute_advantages(rewards, G)                               logitless.objectives
        old/ref logprobs without grad (fused op)                                logitless.models
        μ times: for each micro-batch (sorted by length):
            logp = completion_logprobs(policy)                                  logitless.models
            policy_loss(logp, ..., normalizer of the whole step).backward()     logitless.objectives
        clip gradients, AdamW step, LR schedule                                 trainer.builders
        metrics, sample table, checkpoint                                       trainer.metrics / checkpoint

One step is one rollout batch; with μ = train.num_iterations > 1 it makes μ optimizer steps on it. Ctrl-C or
SIGTERM stops at the next safe point with a checkpoint: before the first optimizer step of a step, the step is
dropped (its data position and RNG are rewound, so a resumed run is identical); after it, the step finishes.
"""

from __future__ import annotations

import dataclasses
import math
import random
import resource
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from logitless.data import PromptRow, PromptSampler
from logitless.models import completion_logprobs
from logitless.objectives import (
    EntropyCoef,
    Stat,
    compute_advantages,
    entropy_quantile_threshold,
    loss_normalizer,
    merge_metrics,
    on_policy_logp_grad,
    policy_loss,
    summarize,
    update_entropy_coef,
)
from logitless.rewards import score_completions
from logitless.rollout import make_engine
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.batching import make_micro_batches
from logitless.trainer.builders import (
    accuracy_index,
    check_prompt_lengths,
    load_rows,
    make_optimizer,
    make_scheduler,
    reward_functions,
    sampling_options,
    torch_threads,
)
from logitless.trainer.config import TrainerConfig, to_yaml
from logitless.trainer.distributed import all_reduce_metrics, all_reduce_sum
from logitless.trainer.metrics import MetricsLogger, RewardErrorReport
from logitless.trainer.modeling import ReferencePolicy, load_model_and_tokenizer, prepare_for_training, trainable_parameters
from logitless.trainer.plot import plot_run
from logitless.trainer.preflight import check_resume, validate_config
from logitless.trainer.rundir import claim_run_dir
from logitless.trainer.sources import check_sources
from logitless.trainer.signals import StopRequest

Hook = Callable[[str, int], None]  # hook(event, step); events: "step_start", "after_rollout", "after_update"
MAX_EMPTY_STEPS = 3  # consecutive steps whose completions are all empty before the run is stopped


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # last completed step
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics logged by this process
    checkpoint: Path | None = None  # newest checkpoint written
    interrupted: int | None = None  # the signal that stopped the run, if any

    @property
    def exit_code(self) -> int:
        return 128 + self.interrupted if self.interrupted else 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    """Display text of a prompt (the last message of a chat prompt)."""
    return prompt if isinstance(prompt, str) else str(prompt[-1]["content"])


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def reward_metrics(rewards: torch.Tensor, total: torch.Tensor, names: list[str], acc_col: int) -> dict[str, float]:
    """Mean/std of each reward function [B, R] and of the weighted total [B]; accuracy = share of samples whose
    accuracy reward is 1 (samples it could not score count as wrong)."""
    out: dict[str, float] = {"reward/mean": float(total.mean()), "reward/std": float(total.std(unbiased=False))}
    for k, name in enumerate(names):
        col = rewards[:, k]
        ok = col[~torch.isnan(col)]
        out[f"reward/{name}/mean"] = float(ok.mean()) if ok.numel() else math.nan
        out[f"reward/{name}/std"] = float(ok.std(unbiased=False)) if ok.numel() else math.nan
    out["accuracy"] = float((rewards[:, acc_col] == 1.0).float().mean())
    return out


def train(
    cfg: TrainerConfig,
    *,
    resume: str | Path | None = None,
    overwrite: bool = False,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    hook: Hook | None = None,
) -> TrainResult:
    """Run GRPO-family training as configured; `model`/`tokenizer` (optional) replace cfg.model's loading.

    Before anything slow: the config is checked (`preflight`), the run folder is locked for this process and must
    be new, or `resume`d (the run continues in the resumed run's folder), or `overwrite`n (`rundir`).
    """
    validate_config(cfg)
    with claim_run_dir(cfg, resume=resume, overwrite=overwrite) as run:
        if run.resume_from is not None:
            check_resume(run.cfg, run.resume_from)
        if model is None:
            check_sources(run.cfg)
        return _train(run.cfg, resume=run.resume_from, model=model, tokenizer=tokenizer, hook=hook)


def _train(
    cfg: TrainerConfig,
    *,
    resume: str | Path | None = None,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    hook: Hook | None = None,
) -> TrainResult:
    """The training run of `train`, in its claimed run folder (cfg.train.output_dir is absolute)."""
    hook = hook or (lambda event, step: None)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    G, mu = cfg.rollout.num_generations, cfg.train.num_iterations
    if cfg.advantage.reward_weights is not None:
        raise ValueError("set reward weights once, in reward.reward_weights (advantage.reward_weights is filled from it)")
    adv_options = dataclasses.replace(
        cfg.advantage, reward_weights=tuple(cfg.reward.reward_weights) if cfg.reward.reward_weights else None
    )
    obj_options = cfg.objective
    if obj_options.max_completion_length not in (None, cfg.rollout.max_completion_length):
        raise ValueError(
            f"objective.max_completion_length={obj_options.max_completion_length} (the dr_grpo normalizer) differs "
            f"from rollout.max_completion_length={cfg.rollout.max_completion_length}; set both to the same value"
        )

    # ---- data and rewards (first: their errors need no model), model, sampler engine, optimizer
    rows: list[PromptRow] = load_rows(cfg.data)
    sampler = PromptSampler(rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    reward_fns = reward_functions(cfg.reward)
    acc_col = accuracy_index(cfg.reward)
    if model is None:
        model, tokenizer, device = load_model_and_tokenizer(cfg.model)
    else:
        if tokenizer is None:
            raise ValueError("train(model=...) needs tokenizer= too")
        model = prepare_for_training(model, cfg.model)
        device = next(model.parameters()).device
    reference = ReferencePolicy(model) if obj_options.beta > 0 else None
    check_prompt_lengths(rows, tokenizer, model, sampling_options(cfg.rollout, seed=None), f"data.task={cfg.data.task!r}")
    engine = make_engine(cfg.rollout.backend, model, tokenizer)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.train.max_steps * mu, cfg.optim)

    run_dir = Path(cfg.train.output_dir)
    ckpt_root = run_dir / "checkpoints"
    start, state = 0, {}
    if resume is not None:
        state = ckpt.load_checkpoint(resume, model=model, optimizer=optimizer, scheduler=scheduler)
        start = int(state["step"])
        sampler.load_state_dict(state["sampler"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    logger = MetricsLogger(
        run_dir, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
        total_steps=cfg.train.max_steps, resume_step=start,
    )
    result = TrainResult(run_dir=run_dir, step=start)
    report_reward_errors = RewardErrorReport(logger.print, cfg.reward.error_penalty)

    def save(step: int) -> None:
        result.checkpoint = ckpt.save_checkpoint(
            ckpt_root, step, model=model, optimizer=optimizer, scheduler=scheduler,
            trainer_state={"sampler": sampler.state_dict(), "entropy_coef": list(entropy_coef)},
            keep=cfg.checkpoint.save_total_limit,
        )

    empty_steps = 0
    t_start = time.perf_counter()
    top_entropy = obj_options.top_entropy_quantile < 1.0
    entropy_grad = obj_options.entropy_coef > 0 or obj_options.use_adaptive_entropy
    entropy_coef = EntropyCoef(*state.get("entropy_coef", (obj_options.entropy_coef, obj_options.entropy_coef)))
    try:
        with StopRequest() as stop:
            for step in range(start + 1, cfg.train.max_steps + 1):
                hook("step_start", step)
                rewind = (sampler.state_dict(), ckpt.rng_state())
                t0 = time.perf_counter()

                # ---- 1. rollout: G samples for each prompt, with the sampler's logprobs
                batch_rows = sampler.next_batch(cfg.train.prompts_per_step)
                options = sampling_options(cfg.rollout, seed=cfg.train.seed * 1_000_003 + step)
                with torch_threads(cfg.rollout.num_threads):
                    rollout = engine.generate([r.prompt for r in batch_rows], options).to(device)
                t_gen = time.perf_counter()

                # ---- 2. rewards [B, R] and 3. group advantages [B]
                sample_rows = [batch_rows[i] for i in rollout.prompt_index.tolist()]
                scores = score_completions(
                    reward_fns, cfg.reward.reward_weights, [r.prompt for r in sample_rows], rollout.completions,
                    sample_rows, on_error=cfg.reward.on_error, penalty=cfg.reward.error_penalty,
                )
                report_reward_errors(step, scores.names, scores.num_errors, scores.error_texts, len(sample_rows))
                adv = compute_advantages(scores.rewards, G, adv_options)
                t_score = time.perf_counter()
                hook("after_rollout", step)
                if stop.requested:  # nothing trained yet: drop this step so a resume redoes it identically
                    sampler.load_state_dict(rewind[0])
                    ckpt.set_rng_state(*rewind[1])
                    if step - 1 > 0:
                        save(step - 1)
                    break

                # ---- 4. old / reference logprobs (no grad) and 5. μ optimizer steps over micro-batches
                cmask = rollout.completion_mask
                n_tokens = int(cmask.sum())
                # Rows with advantage 0 add exactly 0 to the loss and its gradient when there is no KL or entropy
                # term, so they are not run (they still count in the normalizer, which is taken over all rows).
                trained = torch.arange(cmask.shape[0], device=device)
                if cfg.train.skip_zero_advantage and obj_options.beta == 0 and not (entropy_grad or top_entropy):
                    trained = (adv.advantages.to(device) != 0).nonzero().view(-1)
                micro = make_micro_batches(
                    rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, cmask,
                    rollout.sampler_logp, rollout.truncated, adv.advantages.to(device), cfg.train.micro_batch_size,
                    rows=trained,
                )
                obj_metrics: list[dict[str, Stat]] = []
                losses, grad_norms = [], []
                empty = [not c.strip() for c in rollout.completions]
                empty_steps = empty_steps + 1 if all(empty) else 0
                if all(empty):
                    warnings.warn(f"step {step}: every completion is empty (the model ends at once)", stacklevel=2)
                    if empty_steps >= MAX_EMPTY_STEPS:
                        raise ValueError(
                            f"every completion of the last {MAX_EMPTY_STEPS} steps is empty: the model emits EOS "
                            "first. Check the tokenizer's EOS token and chat template (model.name_or_path), "
                            "rollout.stop and rollout.max_completion_length"
                        )
                if n_tokens > 0:  # (0 only if the engine returned no token at all, not even EOS)
                    temp = options.logp_temperature
                    normalizer = all_reduce_sum(
                        loss_normalizer(obj_options, [cmask], [rollout.truncated]),
                        device,
                    )
                    old_logp: list[torch.Tensor | None] = [None] * len(micro)
                    ref_logp: list[torch.Tensor | None] = [None] * len(micro)
                    old_entropy: list[torch.Tensor] = []
                    with torch.no_grad():
                        for i, m in enumerate(micro):
                            args = (m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask)
                            if mu > 1 or top_entropy:
                                old_logp[i], ent = completion_logprobs(model, *args, temperature=temp, with_entropy=top_entropy)
                                old_logp[i] = old_logp[i] if mu > 1 else None
                                old_entropy += [ent] if top_entropy else []
                            if reference is not None:
                                with reference.use(model) as ref_model:
                                    ref_logp[i] = completion_logprobs(ref_model, *args, temperature=temp)[0]
                    threshold = None  # top-entropy mask: one threshold over the whole step's tokens
                    if top_entropy:
                        threshold = entropy_quantile_threshold(
                            old_entropy, [m.completion_mask for m in micro], obj_options.top_entropy_quantile
                        )
                    model.train()
                    for _ in range(mu):
                        # fp64 sum on device: no host sync per micro-batch
                        step_loss, parts = torch.zeros((), dtype=torch.float64, device=device), []
                        for i, m in enumerate(micro):
                            # on-policy without KL/IS/entropy terms: d loss / d logp is known before the forward,
                            # so the fused op can form its gradients there (a speed hint; None otherwise)
                            hint = None if mu > 1 else on_policy_logp_grad(
                                m.completion_mask, m.advantages, obj_options, normalizer, sampler_logp=m.sampler_logp,
                                truncated=m.truncated, entropy_coef=entropy_coef.effective if entropy_grad else 0.0,
                            )
                            logp, entropy = completion_logprobs(
                                model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                temperature=temp, with_entropy=True, grad_hint=hint,
                            )
                            out = policy_loss(
                                logp, m.completion_mask, m.advantages, obj_options, normalizer,
                                old_logp=old_logp[i], ref_logp=ref_logp[i], sampler_logp=m.sampler_logp,
                                entropy=entropy if entropy_grad else entropy.detach(), truncated=m.truncated,
                                entropy_coef=entropy_coef.effective, entropy_threshold=threshold,
                            )
                            out.loss.backward()
                            step_loss += out.loss.detach()
                            parts.append(out.metrics)
                        for p in params:  # a step without trained rows still is an AdamW step with zero gradients
                            if p.grad is None:
                                p.grad = torch.zeros_like(p)
                        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
                        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                        losses.append(float(step_loss))
                        merged = all_reduce_metrics(merge_metrics(parts))
                        obj_metrics.append(merged)
                        if obj_options.use_adaptive_entropy:
                            entropy_coef = update_entropy_coef(entropy_coef.coef, float(merged["entropy"].mean), obj_options)
                hook("after_update", step)
                t_train = time.perf_counter()

                # ---- 6. metrics, samples, checkpoint
                lengths = cmask.sum(1).float()
                record: dict[str, Any] = reward_metrics(scores.rewards, scores.total, scores.names, acc_col)
                record.update({f"reward/{n}/errors": e for n, e in zip(scores.names, scores.num_errors) if e})
                record.update({f"reward/{n}/none": c for n, c in zip(scores.names, scores.num_none) if c})
                adv_summary = summarize(adv.metrics)
                record.update({k: v for k, v in adv_summary.items() if k.startswith(("advantage", "zero_var", "unscorable"))})
                obj_summary = summarize(merge_metrics(obj_metrics)) if obj_metrics else {}
                record.update({k: v for k, v in obj_summary.items() if not k.startswith("completion_length")})
                record.update({
                    "loss": sum(losses) / len(losses) if losses else math.nan,
                    "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
                    "learning_rate": optimizer.param_groups[0]["lr"],
                    "entropy_coef": entropy_coef.effective,
                    "completion/length_mean": float(lengths.mean()),
                    "completion/length_max": float(lengths.max()),
                    "completion/truncated": float(rollout.truncated.float().mean()),
                    "completion/empty": sum(empty) / len(empty),
                    "tokens_per_s": rollout.timing.tokens_per_s,
                    "train_tokens_per_s": n_tokens * mu / max(t_train - t_score, 1e-9),
                    "time/generate": t_gen - t0,
                    "time/score": t_score - t_gen,
                    "time/train": t_train - t_score,
                    "memory/peak_gb": peak_memory_gb(device),
                    "skipped": float(n_tokens == 0),
                    "trained_rows": float(len(trained)) if n_tokens > 0 else 0.0,
                })
                result.step = step
                if step % cfg.logging.logging_steps == 0 or step == cfg.train.max_steps:
                    logger.log(step, {**record, "time/elapsed": time.perf_counter() - t_start})
                    result.records.append({"step": step, **record})
                logger.advance(step, record)
                if cfg.logging.log_completions and (step % cfg.logging.completions_steps == 0 or step == 1):
                    logger.completions_table(
                        step, [prompt_text(r.prompt) for r in sample_rows], rollout.completions,
                        [None if math.isnan(v) else v for v in scores.total.tolist()],
                        cfg.logging.num_completions_to_print,
                    )
                # wall-time budget: stop when one more step of the average duration so far would not fit
                elapsed = time.perf_counter() - t_start
                out_of_time = cfg.train.max_minutes is not None and (
                    elapsed + elapsed / (step - start) > 60 * cfg.train.max_minutes
                )
                last = step == cfg.train.max_steps or out_of_time
                if stop.requested or (cfg.checkpoint.save_steps and step % cfg.checkpoint.save_steps == 0) or (
                    last and cfg.checkpoint.save_at_end
                ):
                    try:
                        save(step)
                    except ckpt.CheckpointError as e:
                        if stop.requested or last:
                            raise
                        logger.print(f"[yellow]warning:[/] {e} Training continues.")
                if stop.requested:
                    break
                if out_of_time:
                    logger.print(f"train.max_minutes={cfg.train.max_minutes} reached after step {step}")
                    break
            result.interrupted = stop.requested
    finally:
        logger.close()
    if result.interrupted:
        logger.console.print(
            f"stopped by signal {result.interrupted} after step {result.step}; resume with --resume {run_dir}"
        )
    elif cfg.logging.plot and result.records:
        plot_run(run_dir)
    return result
