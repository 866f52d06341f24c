"""Held-out accuracy of a model on a prompt split: greedy (pass@1) or pass@k with k samples per prompt.

`evaluate` serves `logitless eval` (a model loaded for it) and, through `eval_in_run`, the eval during training
(`eval.every_steps`), which generates with the run's own rollout engine and logs `eval/*` metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from logitless.agents import Agent
from logitless.data import PromptRow
from logitless.objectives import Stat, merge_metrics
from logitless.rewards import add_reward_column, score_completions
from logitless.rollout import make_engine
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import (
    accuracy_index,
    check_prompt_lengths,
    load_rows,
    reward_functions,
    torch_threads,
)
from logitless.trainer.placement.engines import sampling_options
from logitless.trainer.config.schema import TrainerConfig
from logitless.trainer.episodes import (
    ENVIRONMENT_REWARD,
    environment_rewards,
    environment_weight,
    episode_stats,
    reward_completions,
    stat_means,
)
from logitless.models.vision import is_vision_language
from logitless.rollout.vision import is_processor, text_tokenizer
from logitless.trainer.policy.vision import load_processor
from logitless.trainer.policy.modeling import attention_backends, load_model_and_tokenizer, prepare_for_training
from logitless.trainer.report.traces import TRACES_FILE, batch_traces, trace_text, traced_rows
from logitless.trainer.rundir import write_atomic


@dataclass
class EvalResult:
    accuracy: float  # share of prompts with a correct answer (greedy), or with >= 1 correct of k samples (pass@k)
    mean_reward: float  # mean weighted total reward over all samples
    num_prompts: int
    pass_k: int
    split: str
    seconds: float
    samples: list[dict[str, Any]] = field(default_factory=list)  # prompt, completion, reward, correct
    sample_accuracy: float = math.nan  # share of samples that are correct (pass@1 estimated from k samples)
    mean_length: float = math.nan  # completion tokens per sample
    # multi-turn episodes (agent.*): means per episode of `trainer.episodes.episode_stats` (turns, ...); else empty
    episodes: dict[str, float] = field(default_factory=dict)
    # their mergeable stats (for the mean over several ranks' episodes); not written to eval.json
    episode_stats: dict[str, Stat] = field(default_factory=dict, repr=False, compare=False)
    # agent.trace_episodes of the episodes, spread over the samples (`report.traces`); written beside eval.json
    traces: list[dict[str, Any]] = field(default_factory=list, repr=False, compare=False)

    def metrics(self) -> dict[str, float]:
        """The `eval/*` metrics of a run: eval/accuracy (share of correct samples: the greedy accuracy, or pass@1
        estimated from k samples), eval/pass@k (k > 1), eval/reward, eval/completion_length, and with an agent
        eval/episode/* (turns, tool calls, ... per episode)."""
        out = {"eval/accuracy": self.sample_accuracy, "eval/reward": self.mean_reward,
               "eval/completion_length": self.mean_length}
        if self.pass_k > 1:
            out[f"eval/pass@{self.pass_k}"] = self.accuracy
        out.update({f"eval/{k}": v for k, v in self.episodes.items()})
        return out

    def summary(self) -> str:
        what = "greedy accuracy" if self.pass_k == 1 else f"pass@{self.pass_k}"
        e = self.episodes
        turns = (f", {e['episode/turns_mean']:.2f} turns and {e['episode/tool_calls_mean']:.2f} tool calls per "
                 "episode" if e else "")
        return (
            f"{what} {100 * self.accuracy:.1f}% on {self.num_prompts} prompts of split '{self.split}' "
            f"(mean reward {self.mean_reward:.3f}{turns}, {self.seconds:.0f} s)"
        )


def eval_temperature(cfg: TrainerConfig) -> float:
    """eval.temperature, or 0 (greedy) for pass_k = 1 and rollout.temperature for pass_k > 1."""
    if cfg.eval.temperature is not None:
        return cfg.eval.temperature
    return 0.0 if cfg.eval.pass_k == 1 else cfg.rollout.temperature


def eval_options(cfg: TrainerConfig) -> Any:
    """The eval's SamplingOptions (seeded with train.seed: every eval of a run draws the same way)."""
    return sampling_options(
        cfg.rollout, seed=cfg.train.seed, num_generations=cfg.eval.pass_k, temperature=eval_temperature(cfg),
        max_new_tokens=cfg.eval.max_completion_length, section="eval",
        chat_template_kwargs=cfg.data.chat_template_kwargs,
    )


def evaluate(
    model: Any, tokenizer: Any, rows: list[PromptRow], cfg: TrainerConfig, *, split: str = "", engine: Any = None,
    fns: list[Callable[..., Any]] | None = None, agent: Any = None,
) -> EvalResult:
    """Accuracy of `model` on `rows` with the reward functions of `cfg.reward`.

    Greedy when `cfg.eval.pass_k == 1` (unless eval.temperature says otherwise); otherwise k samples per prompt at
    the eval temperature and a prompt counts as solved when any sample is correct (pass@k with n = k). Correct =
    the accuracy reward equals 1. With `cfg.agent` enabled each sample is a multi-turn episode with the agent's
    tools / environment, scored as in training (the whole conversation, the environment's reward column).
    `engine`: the rollout engine to generate with (default: a new one of rollout.backend); `fns`: the reward
    functions (default: built from cfg.reward); `agent`: the run's agent (default: one built from cfg.agent).
    `tokenizer` may be a vision-language model's processor (prompts with images).
    """
    processor = tokenizer if is_processor(tokenizer) else None
    tokenizer = text_tokenizer(tokenizer)
    rows = rows[: cfg.eval.num_prompts]
    fns = reward_functions(cfg.reward) if fns is None else fns
    acc_col = accuracy_index(cfg.reward)
    options = eval_options(cfg)
    check_prompt_lengths(rows, processor or tokenizer, model, options, f"eval split {split!r}")
    if engine is None:
        backend = cfg.rollout.backend
        if backend == "auto":
            from logitless.trainer.memory.auto import rollout_backend

            backend = rollout_backend(cfg, next(model.parameters()).device, model)[0]
        engine = make_engine(backend, model, processor or tokenizer)
    own = agent is None and cfg.agent.enabled  # an agent built here is closed here (its MCP servers stopped)
    agent = Agent(tokenizer, cfg.agent, cfg.data.chat_template_kwargs, processor) if own else agent
    try:
        return _evaluate(model, tokenizer, rows, cfg, split, engine, fns, agent, acc_col, options)
    finally:
        if own:
            agent.close()


def _evaluate(model: Any, tokenizer: Any, rows: list[PromptRow], cfg: TrainerConfig, split: str, engine: Any,
              fns: list[Callable[..., Any]], agent: Any, acc_col: int, options: Any) -> EvalResult:
    """`evaluate`'s generation and scoring, with the engine and agent decided."""
    k = cfg.eval.pass_k
    env_weight = environment_weight(cfg)
    t0 = time.perf_counter()
    solved, rewards, samples, episodes, lengths, traces = [], [], [], [], [], []
    traced = traced_rows(len(rows) * k, cfg.agent.trace_episodes if agent is not None else 0)
    for start in range(0, len(rows), cfg.eval.batch_size):
        chunk = rows[start : start + cfg.eval.batch_size]
        with torch_threads(cfg.rollout.num_threads):
            if agent is not None:
                driver = agent.driver(chunk, k)
                batch = engine.generate(driver.prompt_ids, options, episodes=driver)
            else:
                batch = engine.generate([r.prompt for r in chunk], options)
        lengths.extend(batch.loss_mask().sum(1).tolist())
        per_sample = [chunk[i] for i in batch.prompt_index.tolist()]
        prompts = [r.prompt for r in per_sample]
        completions = reward_completions(tokenizer, batch, prompts)
        scores = score_completions(
            fns, cfg.reward.reward_weights, prompts, completions, per_sample,
            on_error=cfg.reward.on_error, penalty=cfg.reward.error_penalty,
            timeout_s=cfg.reward.timeout_s,
        )
        if env_weight is not None:
            scores = add_reward_column(scores, ENVIRONMENT_REWARD, environment_rewards(batch), env_weight)
        episodes.append(episode_stats(batch))
        if batch.episodes is not None:
            first = start * k  # the chunk's first sample
            picked = [i - first for i in traced if first <= i < first + len(per_sample)]
            traces += batch_traces(picked, per_sample, batch.episodes, scores.names, scores.rewards, scores.total,
                                   first=first)
        correct = (scores.rewards[:, acc_col] == 1.0).view(len(chunk), k)  # [n, k]
        solved.extend(correct.any(1).tolist())
        rewards.extend(scores.total.tolist())
        for b, row in enumerate(per_sample):
            samples.append({
                "prompt": row.prompt, "completion": completions[b], "answer": row.fields.get("answer"),
                "reward": None if math.isnan(scores.total[b].item()) else scores.total[b].item(),
                "correct": bool(correct.view(-1)[b]),
            })
    finite = [r for r in rewards if not math.isnan(r)]
    merged = merge_metrics(episodes)
    return EvalResult(
        accuracy=sum(solved) / len(solved), mean_reward=sum(finite) / max(len(finite), 1), num_prompts=len(rows),
        pass_k=k, split=split, seconds=time.perf_counter() - t0, samples=samples,
        sample_accuracy=sum(s["correct"] for s in samples) / len(samples), mean_length=sum(lengths) / len(lengths),
        episodes=stat_means(merged), episode_stats=merged, traces=traces,
    )


def evaluate_config(cfg: TrainerConfig, checkpoint: str | Path | None = None) -> EvalResult:
    """Load the model of `cfg` (plus the weights of `checkpoint`, if given) and evaluate it on the eval split."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    split = cfg.eval.split or cfg.data.eval_split
    rows = load_rows(cfg.data, split, eval=True)  # data errors need no model: before the load
    path = ckpt.resolve_checkpoint(checkpoint, flag="--checkpoint") if checkpoint is not None else None
    model, tokenizer, _ = load_model_and_tokenizer(cfg.model, trainable=False)
    if is_vision_language(model):
        tokenizer = load_processor(cfg.model, tokenizer)  # evaluate takes the processor in the tokenizer's place
    if path is not None:
        if cfg.model.lora:
            model = prepare_for_training(model, dataclasses.replace(cfg.model, gradient_checkpointing=False))
        ckpt.load_model_weights(model, path / "model")
    model.eval()
    with attention_backends(cfg.model):
        return evaluate(model, tokenizer, rows, cfg, split=split)


def write_eval(result: EvalResult, path: str | Path, step: int | None = None) -> None:
    """The result and every sample as JSON at `path`; with episode traces (`result.traces`), those beside it in
    `traces_path(path)`, each line with `step` (the checkpoint's step, None for the model as loaded)."""
    data = {k: v for k, v in asdict(result).items() if k not in ("episode_stats", "traces")}
    Path(path).write_text(json.dumps(data, indent=1, default=str))
    if result.traces:
        write_atomic(traces_path(path), trace_text(step, result.traces))


def traces_path(output: str | Path) -> Path:
    """Where `logitless eval --output F.json` writes its episode traces: F.episodes.jsonl beside it (not
    episodes.jsonl, which in a run folder holds the training run's)."""
    output = Path(output)
    return output.with_name(f"{output.stem}.{TRACES_FILE}")


def eval_due(cfg: TrainerConfig, step: int) -> bool:
    """Whether the eval during training runs after `step`: every eval.every_steps steps and after train.max_steps
    (a function of the step alone, so a resumed run evaluates at the same steps)."""
    every = cfg.eval.every_steps
    return every > 0 and (step % every == 0 or step == cfg.train.max_steps)


def eval_in_run(ctx: Any, weights: AbstractContextManager) -> dict[str, float]:
    """The `eval/*` metrics of the policy as it is now, on the run's held-out rows (`ctx.eval_rows`), generated by
    the run's rollout engine with the run's reward functions, within `weights` (a context manager that makes the
    engine's weights current: the trainer's `stages.rollout_state`). Under torchrun every rank evaluates every
    world-size-th row and the counts are summed over the ranks."""
    from logitless.trainer.distributed.collectives import all_reduce_metrics, all_reduce_sum

    cfg, world = ctx.cfg, ctx.world
    # a tensor-parallel group decodes its rows once; a shared rollout GPU (rollout.device) every rank's, once
    split_by = (world.size if cfg.rollout.device is not None else cfg.rollout.tensor_parallel) if world.size > 1 else 1
    rows = ctx.eval_rows[world.rank // split_by :: world.size // split_by] if world.size > 1 else ctx.eval_rows
    split = cfg.eval.split or cfg.data.eval_split
    with weights:
        result = evaluate(ctx.model, ctx.processor or ctx.tokenizer, rows, cfg, split=split, engine=ctx.rollout.engine,
                          fns=ctx.reward_fns, agent=ctx.agent)
    if world.size == 1:
        return result.metrics()
    n_samples = len(result.samples)
    finite = [s["reward"] for s in result.samples if s["reward"] is not None]
    share = 1.0 if world.rank % split_by == 0 else 0.0  # one rank of each group counts the group's rows
    sums = [all_reduce_sum(share * x, ctx.device) for x in (
        result.accuracy * result.num_prompts, result.num_prompts, result.sample_accuracy * n_samples, n_samples,
        sum(finite), len(finite), result.mean_length * n_samples)]
    episodes = stat_means(all_reduce_metrics(result.episode_stats if share else {}, ctx.device)) \
        if cfg.agent.enabled else result.episodes
    merged = dataclasses.replace(result, accuracy=sums[0] / sums[1], sample_accuracy=sums[2] / sums[3],
                                 mean_reward=sums[4] / max(sums[5], 1), mean_length=sums[6] / sums[3],
                                 episodes=episodes)
    return merged.metrics()
