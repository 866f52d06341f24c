"""The trainer's side of multi-turn episodes (`logitless.rollout.episodes`, `logitless.agents`): what reward
functions see, the environment's reward column, and the step's episode metrics.

Rewards see the whole episode. `completions` passed to reward functions are the messages after the prompt
(`EpisodeRecord.messages`: assistant turns with their tool calls, tool results, environment messages; TRL's
convention), after a chat prompt and after a raw-text prompt alike, so a reward can tell the model's words from a
tool's. The built-in rewards score a message list by its last assistant message (`rewards.builtin.completion_text`):
a number in a tool result is not the model's answer. An environment's own episode reward
(`EpisodeRecord.reward`) is one more reward column, named `environment`, weighted by
`agent.environment_reward_weight`; an episode without one is NaN there, as a reward function's None.

With advantage.credit=turn each model turn gets its own reward (`turn_credit`): the environment's step reward of
that turn (`EpisodeRecord.turn_rewards`, × the environment weight; 0 for a turn without one), and the last turn
also gets every episode-level reward: the weighted reward functions (they score the whole episode) and the
environment's final reward() (`EpisodeRecord.reward` less the step rewards). The turn rewards of an episode sum
to its weighted total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from logitless.objectives import AdvantageOptions, Stat, token_advantages, token_turns, turn_advantages
from logitless.objectives.credit import TurnAdvantageOutput
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


@dataclass
class TurnCredit:
    """advantage.credit=turn: the advantage of each model turn and of each completion token."""

    turns: TurnAdvantageOutput  # advantages [B, K] of each turn, returns-to-go, zero-variance rows, metrics
    rewards: torch.Tensor  # [B, K] float64, each turn's weighted reward (NaN on unscorable rows, 0 past the last turn)
    num_turns: torch.Tensor  # [B] long, model turns of each episode (runs of model tokens between observations)
    tokens: torch.Tensor  # [B, T] float32, each completion token's advantage: its turn's; 0 on observations, padding


def turn_rewards(batch: RolloutBatch, rewards: torch.Tensor, names: Sequence[str], weights: Sequence[float]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-turn rewards [B, K] float64, model turns [B] long, turn index of each completion token [B, T] long, -1
    off the model's tokens) of an episode rollout, from its reward columns `rewards` [B, R] (`names`, `weights`) and
    its records (module docstring: step rewards on their turns, episode-level rewards on the last turn). A row whose
    every column is NaN is unscorable: NaN at every turn. Refuses records that break the driver's contract (one
    `turn_rewards` entry per model turn or none; `reward` set when a turn has one)."""
    index, runs = token_turns(batch.completion_mask.cpu(), batch.env_mask.cpu())
    num = runs.clamp(min=1)  # a row without model tokens still has one (empty) turn that holds its rewards
    cols = rewards.detach().cpu().to(torch.float64)
    env = list(names).index(ENVIRONMENT_REWARD) if ENVIRONMENT_REWARD in names else None
    w = torch.tensor(list(weights), dtype=torch.float64)
    funcs = [k for k in range(len(names)) if k != env]
    out = torch.zeros((len(batch.episodes), int(num.max())), dtype=torch.float64)
    for b, rec in enumerate(batch.episodes):
        if bool(torch.isnan(cols[b]).all()):
            out[b] = math.nan
            continue
        steps = list(rec.turn_rewards)
        if steps and len(steps) != int(runs[b]):
            raise ValueError(
                f"advantage.credit=turn: episode {b} has {int(runs[b])} model turns (runs of model tokens between "
                f"the driver's observations) but its record has {len(steps)} turn_rewards; a driver reports one "
                "turn_rewards entry per model turn (or none) and answers every turn it continues with at least one "
                "token. Fix the driver, or set advantage.credit=episode")
        given = [float(x) for x in steps if x is not None]
        if given and rec.reward is None:
            raise ValueError(f"advantage.credit=turn: episode {b}'s record has turn_rewards but reward=None; a "
                             "driver's EpisodeRecord.reward is the episode's whole environment reward (its "
                             "turn_rewards plus any final reward). Fix the driver, or set advantage.credit=episode")
        w_env = float(w[env]) if env is not None else 0.0
        for t, x in enumerate(steps):
            out[b, t] = w_env * (x if x is not None else 0.0)
        last = float(torch.nansum(cols[b, funcs] * w[funcs])) if funcs else 0.0
        if env is not None and rec.reward is not None:
            last += w_env * (float(rec.reward) - sum(given))  # the final reward(), beside the step rewards
        out[b, int(num[b]) - 1] += last
    return out, num, index


def turn_credit(batch: RolloutBatch, rewards: torch.Tensor, names: Sequence[str], options: AdvantageOptions,
                group_size: int) -> TurnCredit:
    """advantage.credit=turn: per-turn rewards (`turn_rewards`), their group-relative advantages
    (`objectives.turn_advantages`) and each token's advantage, over this process's rows (whole groups)."""
    if batch.episodes is None or batch.env_mask is None:
        raise ValueError("advantage.credit=turn gives each turn of a multi-turn episode its own advantage, but this "
                         "rollout has no episodes; set agent.environment (or agent.driver), or advantage.credit=episode")
    weights = options.reward_weights if options.reward_weights is not None else (1.0,) * len(names)
    r, num, index = turn_rewards(batch, rewards, names, weights)
    out = turn_advantages(r, num, group_size, options)
    tokens = token_advantages(out.advantages, index).to(batch.completion_mask.device)
    return TurnCredit(out, r, num, tokens)
