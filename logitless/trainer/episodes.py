"""The trainer's side of multi-turn episodes (`logitless.rollout.episodes`, `logitless.agents`): what reward
functions see, the environment's reward column, and the step's episode metrics.

Rewards see the whole episode. `completions` passed to reward functions are the messages after the prompt
(`EpisodeRecord.messages`: assistant turns with their tool calls, tool results, environment messages; TRL's
convention), after a chat prompt and after a raw-text prompt alike, so a reward can tell the model's words from a
tool's. The built-in rewards score a message list by its last assistant message (`rewards.builtin.completion_text`):
a number in a tool result is not the model's answer. An environment's own episode reward
(`EpisodeRecord.reward`) is one more reward column, named `environment`, weighted by
`agent.environment_reward_weight`; an episode without one is NaN there, as a reward function's None.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from logitless.objectives import Stat
from logitless.rollout import RolloutBatch
from logitless.trainer.distributed.collectives import all_reduce_metrics

ENVIRONMENT_REWARD = "environment"  # name of the environment's reward column


def environment_weight(cfg: Any) -> float | None:
    """The weight of the `environment` reward column of a run (`TrainerConfig`), or None when it has no such
    column (no agent, or an agent with tools only). The column holds each episode's own reward
    (`EpisodeRecord.reward`): an environment's, or your own driver's (agent.driver)."""
    agent = cfg.agent
    if not agent.enabled or (agent.environment is None and agent.driver is None):
        return None
    return float(agent.environment_reward_weight)


def conversation_texts(tokenizer: Any, batch: RolloutBatch) -> list[str]:
    """[B] each row's whole completion as text: the model's turns and the observations, special tokens skipped."""
    rows = [ids[m.bool()].tolist() for ids, m in zip(batch.completion_ids.cpu(), batch.completion_mask.cpu())]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def reward_completions(tokenizer: Any, batch: RolloutBatch, prompts: Sequence[Any]) -> list[str | list[dict]]:
    """[B] what reward functions get as `completions`: the completion texts of a single-turn rollout; of an
    episode rollout, each episode's messages after the prompt (raw-text prompts too)."""
    if batch.episodes is None:
        return list(batch.completions)
    return [list(batch.episodes[b].messages) for b in range(len(prompts))]


def environment_rewards(batch: RolloutBatch) -> list[float | None]:
    """[B] each episode's own reward from its environment (None where it gave none)."""
    return [r.reward for r in batch.episodes] if batch.episodes is not None else [None] * batch.completion_ids.shape[0]


def episode_metrics(batch: RolloutBatch, device: torch.device) -> dict[str, float]:
    """Means per episode over the step (all ranks) of `episode_stats`. Empty for a single-turn rollout (no
    collective then: every rank runs episodes or none)."""
    if batch.episodes is None:
        return {}
    return stat_means(all_reduce_metrics(episode_stats(batch), device))


def stat_means(stats: dict[str, Stat]) -> dict[str, float]:
    """{name: mean} of the stats that counted anything."""
    return {name: float(s.mean) for name, s in stats.items() if float(s.count) > 0}


def episode_stats(batch: RolloutBatch) -> dict[str, Stat]:
    """Per-episode values of this process's rows, as mergeable stats: turns, tool calls, tool errors, the
    truncated share, model and observation tokens, and each `EpisodeRecord.metrics` entry (over the episodes
    that report it). Empty for a single-turn rollout."""
    if batch.episodes is None:
        return {}
    recs = batch.episodes
    env = batch.env_mask.cpu() * batch.completion_mask.cpu()

    def stat(values: list[float]) -> Stat:
        return Stat.of(torch.tensor(values, dtype=torch.float64))

    stats = {
        "episode/turns_mean": stat([r.turns for r in recs]),
        "episode/tool_calls_mean": stat([r.tool_calls for r in recs]),
        "episode/tool_errors_mean": stat([r.tool_errors for r in recs]),
        "episode/truncated": stat(batch.truncated.cpu().double().tolist()),
        "tokens/model_mean": stat((batch.completion_mask.cpu() - env).sum(1).double().tolist()),
        "tokens/env_mean": stat(env.sum(1).double().tolist()),
    }
    for key in sorted({k for r in recs for k in r.metrics}):
        stats[f"episode/{key}"] = stat([float(r.metrics[key]) for r in recs if key in r.metrics])
    return stats
