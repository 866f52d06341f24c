"""Held-out accuracy of a model on a prompt split: greedy (pass@1) or pass@k with k samples per prompt."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from logitless.agents import Agent
from logitless.data import PromptRow
from logitless.objectives import merge_metrics
from logitless.rewards import add_reward_column, score_completions
from logitless.rollout import make_engine
from logitless.trainer import checkpoint as ckpt
from logitless.trainer.builders import (
    accuracy_index,
    check_prompt_lengths,
    load_rows,
    reward_functions,
    sampling_options,
    torch_threads,
)
from logitless.trainer.config import TrainerConfig
from logitless.trainer.episodes import (
    ENVIRONMENT_REWARD,
    environment_rewards,
    environment_weight,
    episode_stats,
    reward_completions,
    stat_means,
)
from logitless.trainer.modeling import attention_backends, load_model_and_tokenizer, prepare_for_training


@dataclass
class EvalResult:
    accuracy: float  # share of prompts with a correct answer (greedy), or with >= 1 correct of k samples (pass@k)
    mean_reward: float  # mean weighted total reward over all samples
    num_prompts: int
    pass_k: int
    split: str
    seconds: float
    samples: list[dict[str, Any]] = field(default_factory=list)  # prompt, completion, reward, correct
    # multi-turn episodes (agent.*): means per episode of `trainer.episodes.episode_stats` (turns, ...); else empty
    episodes: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        what = "greedy accuracy" if self.pass_k == 1 else f"pass@{self.pass_k}"
        e = self.episodes
        turns = (f", {e['episode/turns_mean']:.2f} turns and {e['episode/tool_calls_mean']:.2f} tool calls per "
                 "episode" if e else "")
        return (
            f"{what} {100 * self.accuracy:.1f}% on {self.num_prompts} prompts of split '{self.split}' "
            f"(mean reward {self.mean_reward:.3f}{turns}, {self.seconds:.0f} s)"
        )


def evaluate(model: Any, tokenizer: Any, rows: list[PromptRow], cfg: TrainerConfig, *, split: str = "") -> EvalResult:
    """Accuracy of `model` on `rows` with the reward functions of `cfg.reward`.

    Greedy when `cfg.eval.pass_k == 1`; otherwise k samples per prompt at `cfg.rollout.temperature` and a prompt
    counts as solved when any sample is correct (pass@k with n = k). Correct = the accuracy reward equals 1.
    With `cfg.agent` enabled each sample is a multi-turn episode with the agent's tools / environment, scored as
    in training (the whole conversation, the environment's reward column).
    """
    k = cfg.eval.pass_k
    rows = rows[: cfg.eval.num_prompts]
    fns = reward_functions(cfg.reward)
    acc_col = accuracy_index(cfg.reward)
    options = sampling_options(
        cfg.rollout, seed=cfg.train.seed, num_generations=k, temperature=0.0 if k == 1 else cfg.rollout.temperature,
        max_new_tokens=cfg.eval.max_completion_length,
    )
    check_prompt_lengths(rows, tokenizer, model, options, f"eval split {split!r}")
    backend = cfg.rollout.backend
    if backend == "auto":
        from logitless.trainer.auto import rollout_backend

        backend = rollout_backend(cfg, next(model.parameters()).device, model)[0]
    engine = make_engine(backend, model, tokenizer)
    agent = Agent(tokenizer, cfg.agent) if cfg.agent.enabled else None
    env_weight = environment_weight(cfg)
    t0 = time.perf_counter()
    solved, rewards, samples, episodes = [], [], [], []
    for start in range(0, len(rows), cfg.eval.batch_size):
        chunk = rows[start : start + cfg.eval.batch_size]
        with torch_threads(cfg.rollout.num_threads):
            if agent is not None:
                driver = agent.driver(chunk, k)
                batch = engine.generate(driver.prompt_ids, options, episodes=driver)
            else:
                batch = engine.generate([r.prompt for r in chunk], options)
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
    return EvalResult(
        accuracy=sum(solved) / len(solved), mean_reward=sum(finite) / max(len(finite), 1), num_prompts=len(rows),
        pass_k=k, split=split, seconds=time.perf_counter() - t0, samples=samples,
        episodes=stat_means(merge_metrics(episodes)),
    )


def evaluate_config(cfg: TrainerConfig, checkpoint: str | Path | None = None) -> EvalResult:
    """Load the model of `cfg` (plus the weights of `checkpoint`, if given) and evaluate it on the eval split."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    split = cfg.eval.split or cfg.data.eval_split
    rows = load_rows(cfg.data, split, eval=True)  # data errors need no model: before the load
    path = ckpt.resolve_checkpoint(checkpoint, flag="--checkpoint") if checkpoint is not None else None
    model, tokenizer, _ = load_model_and_tokenizer(cfg.model, trainable=False)
    if path is not None:
        if cfg.model.lora:
            model = prepare_for_training(model, dataclasses.replace(cfg.model, gradient_checkpointing=False))
        ckpt.load_model_weights(model, path / "model")
    model.eval()
    with attention_backends(cfg.model):
        return evaluate(model, tokenizer, rows, cfg, split=split)


def write_eval(result: EvalResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(result), indent=1, default=str))
