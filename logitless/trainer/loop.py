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
        held-out eval every eval.every_steps                                    trainer.evaluate
        metrics (and trackers), sample table, checkpoint                        trainer.metrics / tracking

One step is one rollout batch; with μ = train.num_iterations > 1 it makes μ optimizer steps on it, with
k = train.steps_per_rollout one per part of it (μ·k in all). With train.dynamic_sampling the rollout and scoring
repeat until the step has prompts_per_step informative groups (trainer/dynamic.py). Ctrl-C or
SIGTERM stops at the next safe point with a checkpoint: before the first optimizer step of a step, the step is
dropped (its data position and RNG are rewound, so a resumed run is identical); after it, the step finishes. The
signal says so at once; a second one stops at once (`signals.py`). Before each step's metrics and checkpoint are
written, the run folder is checked to still be there (`RunDir.check_alive`).

Before the model loads, every setting left "auto" is decided (`trainer/memory/auto.py`: the fast exact path for this
device and model, and the memory plan), printed and saved as resolved.json. A rollout or update that runs out of
device memory is retried once with leaner settings (`trainer/memory/oom.py`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from logitless.data.images import prompt_text
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config.schema import TrainerConfig
from logitless.trainer.context import TrainContext, build_context
from logitless.trainer.dynamic import sample_step
from logitless.trainer.episodes import conversation_texts
from logitless.trainer.evaluate import eval_due, eval_in_run
from logitless.trainer.report.metrics import MismatchReport, RewardErrorReport, mismatch_causes
from logitless.trainer.report.traces import batch_traces, traced_rows
from logitless.trainer.policy.modeling import attention_backends
from logitless.trainer.distributed.parallel import (
    World,
    agree,
    claimed_on_rank0,
    launched_world,
    process_group,
)
from logitless.trainer.memory import oom
from logitless.trainer.memory.auto import resolve_run, save_resolved
from logitless.trainer.preflight import check_resume, check_world, preflight
from logitless.trainer.report.accounting import PhaseTimer
from logitless.trainer.report.plot import plot_run
from logitless.trainer.rundir import RunDir, claim_run_dir, restart_advice
from logitless.trainer.signals import StopRequested, StopSignals, label
from logitless.trainer.distributed.watchdog import phase, watching
from logitless.trainer.mismatch_rows import untrained_mismatch
from logitless.trainer.stages import (
    Rollout,
    Scored,
    UpdatePlan,
    UpdateResult,
    check_empty,
    logprob_stage,
    merge_plans,
    part_rows,
    plan_update,
    rollout_state,
    update_stage,
)
from logitless.trainer.records import step_record

# hook(event, step); events: "step_start", "generate" (the rollout starts), "after_rollout", "micro_batch" (before
# each micro-batch's forward in the update), "after_update"
Hook = Callable[[str, int], None]


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


def log_step(ctx: TrainContext, result: TrainResult, step: int, record: dict[str, Any], ro: Rollout, scored: Scored) -> None:
    """Metrics JSONL / TensorBoard / progress bar, and every K steps a table of sample completions."""
    cfg = ctx.cfg.logging
    if ctx.run is not None:
        ctx.run.check_alive()
    result.step = step
    if step % cfg.logging_steps == 0 or step == ctx.cfg.train.max_steps or any(k.startswith("eval/") for k in record):
        ctx.logger.log(step, {**record, "time/elapsed": time.perf_counter() - ctx.t_start})
        result.records.append({"step": step, **record})
    ctx.logger.advance(step, record)
    if ctx.traces is not None and ro.batch.episodes is not None:
        sc = scored.scores
        picked = traced_rows(len(ro.batch.episodes), ctx.traces.n)
        turn = scored.turn  # advantage.credit=turn: each model turn's advantage too
        ctx.traces.write(step, batch_traces(picked, ro.sample_rows, ro.batch.episodes, sc.names, sc.rewards,
                                            sc.total, scored.adv.advantages,
                                            turn_advantages=None if turn is None else turn.turns.advantages.tolist(),
                                            num_turns=None if turn is None else turn.num_turns.tolist()))
    if cfg.log_completions and (step % cfg.completions_steps == 0 or step == 1):
        totals = [None if math.isnan(v) else v for v in scored.scores.total.tolist()]
        prompts = [prompt_text(r.prompt) for r in ro.sample_rows]
        texts = ro.batch.completions if ro.batch.episodes is None else conversation_texts(ctx.tokenizer, ro.batch)
        ctx.logger.completions_table(step, prompts, texts, totals, cfg.num_completions_to_print)


def checkpoint_and_stop(ctx: TrainContext, result: TrainResult, step: int, stop_requested: bool) -> bool:
    """Save when due (every save_steps, at the end, on a stop request); True when the run ends after this step.

    The wall-time budget ends the run when one more step of the average duration so far would not fit.
    """
    cfg = ctx.cfg
    elapsed = time.perf_counter() - ctx.t_start
    limit = cfg.train.max_minutes
    out_of_time = limit is not None and elapsed + elapsed / (step - ctx.start) > 60 * limit
    out_of_time = bool(agree(int(out_of_time), ctx.device))  # every rank ends after the same step
    last = step == cfg.train.max_steps or out_of_time
    due = cfg.checkpoint.save_steps and step % cfg.checkpoint.save_steps == 0
    if stop_requested or due or (last and cfg.checkpoint.save_at_end):
        try:
            result.checkpoint = ctx.save(step)
        except ckpt.CheckpointError as e:
            if stop_requested or last:
                raise
            ctx.logger.print(f"[yellow]warning:[/] {e} Training continues.")
    if out_of_time and not stop_requested:
        ctx.logger.print(f"train.max_minutes={limit} reached after step {step}")
    return stop_requested or out_of_time


def rewind_step(ctx: TrainContext, rewind: tuple[Any, Any]) -> None:
    """The data position and RNG as they were when the step started."""
    ctx.sampler.load_state_dict(rewind[0])
    ckpt.set_rng_state(*rewind[1])


def drop_step(ctx: TrainContext, result: TrainResult, step: int, rewind: tuple[Any, Any]) -> None:
    """A stop before the first optimizer step of `step`: rewind its data position and RNG (so a resumed run
    redoes it identically) and checkpoint the step before."""
    if ctx.rollout.prefetch is not None:
        ctx.rollout.prefetch.put_back()  # its rollout is the checkpoint's pending one
    rewind_step(ctx, rewind)
    if step - 1 > 0:
        result.checkpoint = ctx.save(step - 1)  # (a resumed run re-saves the step it started from)


def _sample(ctx: TrainContext, step: int, timer: PhaseTimer, hook: Hook) -> tuple:
    hook("generate", step)
    return sample_step(ctx, step, timer)


def _plans(ctx: TrainContext, ro: Rollout, scored: Scored) -> list[UpdatePlan]:
    """The micro-batches and normalizer of each optimizer step on the batch (train.steps_per_rollout parts)."""
    return [plan_update(ctx, ro, scored, rows) for rows in part_rows(ro, ctx.cfg.train.steps_per_rollout)]


def _update(ctx: TrainContext, ro: Rollout, scored: Scored, plans: list[UpdatePlan] | None, timer: PhaseTimer,
            hook: Hook, step: int) -> tuple[list[UpdatePlan], UpdateResult]:
    """Old/reference logprobs and the optimizer steps of a step, over `plans`' micro-batches (None: planned with the
    current settings, after a retry)."""
    plans = plans or _plans(ctx, ro, scored)
    ctx.on_micro_batch = lambda i: hook("micro_batch", step)
    ctx.memory.phase = "logprobs"
    with timer("logprobs"):
        oldrefs = [logprob_stage(ctx, p) for p in plans]
        # no row trains anywhere (all advantages 0): the mismatch of a sample of rows, before the optimizer step
        sampled = untrained_mismatch(ctx, ro.batch, sum(len(p.trained) for p in plans), plans[0].temperature)
    ctx.memory.phase = "train"
    with timer("train"):
        upd = update_stage(ctx, plans, oldrefs)
    upd.metrics[0].update(sampled)  # beside the first optimizer pass's metrics, where the update measures it
    return plans, upd


def _reset_update(ctx: TrainContext, rng: Any) -> None:
    """The state before the update of a step that ran out of memory: no gradients, the same RNG."""
    ctx.optimizer.zero_grad(set_to_none=True)
    ckpt.set_rng_state(*rng)


@contextlib.contextmanager
def frozen_heap() -> Iterator[Callable[[], None]]:
    """Python's cyclic garbage collector kept off the run's long-lived objects. `freeze()` collects, then moves
    every object alive into the permanent generation (`gc.freeze`), so that a full collection during the run (the
    rollout's release, an automatic one) scans only what the steps allocate since: one full collection a step of
    the CPU demo took 0.23-0.24 s over its 440k objects, 0.0002 s once frozen. Frozen objects are still freed when
    their last reference goes; only a cycle among them waits until the run ends, when they are unfrozen. Leaves
    the collector alone (a no-op `freeze`) where something else froze objects before."""
    if gc.get_freeze_count():
        yield lambda: None
        return

    def freeze() -> None:
        gc.collect()
        gc.freeze()

    try:
        yield freeze
    finally:
        gc.unfreeze()


def train(
    cfg: TrainerConfig,
    *,
    resume: str | Path | None = None,
    overwrite: bool = False,
    allow_config_change: bool = False,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    hook: Hook | None = None,
) -> TrainResult:
    """Run GRPO-family training as configured; `model`/`tokenizer` (optional) replace cfg.model's loading.

    Before anything slow: the config is checked against the sources, the model's config and the first data rows
    (`preflight`), then the run folder is locked for this process and must be new, or `resume`d (the run continues
    in the resumed run's folder; a change of what it trains needs `allow_config_change`), or `overwrite`n
    (`rundir`). From here on Ctrl-C and SIGTERM say what they do (`signals`); a second one raises
    `signals.StopNow` (a KeyboardInterrupt).
    """
    preflight(cfg, model_given=model is not None, tokenizer=tokenizer)
    check_world(cfg, launched_world())
    device = cfg.model.device if model is None else str(next(model.parameters()).device)
    stop = StopSignals(quiet=not launched_world().main)
    stop.abandons_waits = not launched_world().distributed  # ranks must leave their collectives together
    stop.advice = lambda: restart_advice(stop.run_dir)
    claim = lambda: claim_run_dir(cfg, resume=resume, overwrite=overwrite,  # noqa: E731
                                  allow_config_change=allow_config_change)
    with stop, process_group(device, offload=cfg.train.fsdp_offload,
                             timeout_s=2 * cfg.train.collective_timeout_s) as world, \
            claimed_on_rank0(world, claim) as (run_cfg, start, run):
        stop.run_dir = Path(run_cfg.train.output_dir)
        if start is not None:
            check_resume(run_cfg, start)
        with attention_backends(run_cfg.model), frozen_heap() as freeze, watching(run_cfg.train.collective_timeout_s):
            return _train(freeze, run_cfg, world, stop, run=run, resume=start, model=model, tokenizer=tokenizer,
                          hook=hook)


@dataclass
class StepReports:
    """The warnings that follow each step's outcome: reward errors and a sampler that drifted from the trainer
    (those of a run that trains on nothing are `TrainContext.health`'s, whose memory a checkpoint keeps)."""

    reward_errors: RewardErrorReport
    mismatch: MismatchReport

    @classmethod
    def of(cls, ctx: TrainContext) -> StepReports:
        say, cfg = ctx.logger.print, ctx.cfg  # (the decided settings)
        return cls(RewardErrorReport(say, cfg.reward.error_penalty),
                   MismatchReport(say, cfg.logging.mismatch_warning, mismatch_causes(cfg)))

    def scored(self, ctx: TrainContext, step: int, ro: Rollout, sc: Any) -> dict[str, Any]:
        """The warnings of the step's scores; returns what goes into its record."""
        self.reward_errors(step, sc.names, sc.num_errors, sc.error_texts, len(sc.total))
        return ctx.health.reward_none(step, sc.names, sc.num_none, len(sc.total),
                                      sorted(ro.sample_rows[0].fields) if ro.sample_rows else [])


def _train(
    freeze: Callable[[], None],
    cfg: TrainerConfig,
    world: World,
    stop: StopSignals,
    *,
    run: RunDir | None = None,
    resume: str | Path | None = None,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    hook: Hook | None = None,
) -> TrainResult:
    """The training run of `train`, in its claimed run folder (cfg.train.output_dir is absolute; `run`: the claim,
    on rank 0 only)."""
    hook = hook or (lambda event, step: None)
    resolved = resolve_run(cfg, world, model=model)
    ctx = build_context(resolved.cfg, world, resume=resume, model=model, tokenizer=tokenizer, run=run, given=cfg)
    ctx.memory = oom.memory_state(ctx, resolved)
    if world.main:
        save_resolved(resolved, ctx.run_dir)  # beside config.yaml, both written once the model has loaded
    result, reports, finished = TrainResult(run_dir=ctx.run_dir, step=ctx.start), StepReports.of(ctx), False
    freeze()  # the model, data and engine: out of every collection from here on
    try:
        if cfg.eval.on_start and ctx.start == 0:  # the policy before training, logged at step 0
            with phase("eval", 0):
                t0 = time.perf_counter()
                record = {**eval_in_run(ctx, rollout_state(ctx)), "time/eval": time.perf_counter() - t0}
                ctx.logger.log(0, record)
                result.records.append({"step": 0, **record})
        for step in range(ctx.start + 1, cfg.train.max_steps + 1):
            if _step(ctx, step, stop, result, reports, hook):
                break
            if step == ctx.start + 1 and ctx.rollout.prefetch is None:  # the first step's compiled graphs too (not with
                freeze()  # a rollout in flight: its KV cache, were it in a cycle, would wait until the run's end)
        result.interrupted = stop.requested
        finished = True
    finally:
        ctx.logger.close()
        ctx.rollout.close(wait=finished)  # on an error or a stop-at-once, the rollout in flight is not awaited
        if ctx.agent is not None:
            ctx.agent.close()  # its MCP servers and environment server connection
    if result.interrupted:
        sig = result.interrupted
        when = f"after step {result.step}" if result.step > ctx.start else f"before step {ctx.start + 1} finished"
        ctx.logger.console.print(f"stopped by signal {sig} ({label(sig)}) {when}; {restart_advice(ctx.run_dir)}",
                                 highlight=False, markup=False, soft_wrap=True)
    elif cfg.logging.plot and result.records and ctx.world.main:
        plot_run(ctx.run_dir)
    return result


def _step(ctx: TrainContext, step: int, stop: StopSignals, result: TrainResult, reports: StepReports,
          hook: Hook) -> bool:
    """One step: rollout and scores, the update, metrics, eval, checkpoint, each phase under the watchdog's bound
    (train.collective_timeout_s); True when the run ends after it."""
    stop.step, stop.updating = step, False
    hook("step_start", step)
    rewind = (ctx.sampler.state_dict(), ckpt.rng_state())
    timer = PhaseTimer(ctx.device, ctx.rollout.device)
    # generate and score (with train.dynamic_sampling: until the step has its informative groups); out of
    # memory: once more, with fewer rows per wave, from the step's data position and RNG
    ctx.memory.retries = 0
    with phase("rollout", step):
        try:
            ro, scored, sc, sampled = oom.retry_on_oom(ctx, step, "generate", lambda: _sample(ctx, step, timer, hook),
                                                       reset=lambda: rewind_step(ctx, rewind))
        except StopRequested as e:  # a stop abandoned the rollout or its scoring: the step is dropped below
            stop.requested = stop.requested or e.signum
        else:
            warned = reports.scored(ctx, step, ro, sc)
            hook("after_rollout", step)
    with phase("update", step):
        dropped = agree(stop.commit_step(), ctx.device)  # a signal to any rank before the update began
        if dropped:  # nothing trained yet: every rank drops this step
            stop.requested = stop.requested or dropped
            drop_step(ctx, result, step, rewind)
            return True
        check_empty(ctx, ro, step)
        plan, upd = _train_on(ctx, ro, scored, timer, hook, step)
        hook("after_update", step)
        record = {**step_record(ctx, ro, scored, plan, upd, timer), **sampled, **oom.memory_metrics(ctx, ro, plan)}
        if eval_due(ctx.cfg, step):  # held-out eval (eval.every_steps)
            with timer("eval"):
                record.update(eval_in_run(ctx, rollout_state(ctx)))
            record["time/eval"] = timer.seconds["eval"]
        record.update({**warned, **ctx.health(step, record)})  # warnings of a run that trains on nothing
        log_step(ctx, result, step, record, ro, scored)
        reports.mismatch(step, record)
        if ctx.run is not None:
            ctx.run.first_step_done()  # --overwrite: the run it replaces goes now
        agreed = agree(stop.requested, ctx.device)  # the ranks decide together; a signal that comes meanwhile
        stop.requested = stop.requested or agreed  # stays requested, for the next decision
    with phase("checkpoint", step):
        return checkpoint_and_stop(ctx, result, step, bool(agreed))


def _train_on(ctx: TrainContext, ro: Rollout, scored: Scored, timer: PhaseTimer, hook: Hook, step: int
              ) -> tuple[UpdatePlan, UpdateResult]:
    """The step's optimizer steps on its rollout, none where the engine returned no token at all (not even EOS);
    out of memory: once more, from the same state, with micro-batches planned anew under leaner settings."""
    plans = _plans(ctx, ro, scored)
    if merge_plans(plans).n_tokens == 0:
        return merge_plans(plans), UpdateResult()
    rng, tried = ckpt.rng_state(), [plans]
    plans, upd = oom.retry_on_oom(ctx, step, "update", lambda: _update(ctx, ro, scored, tried[-1], timer, hook, step),
                                  reset=lambda: (_reset_update(ctx, rng), tried.append(None)))
    return merge_plans(plans), upd
