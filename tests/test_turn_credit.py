"""Turn-level credit (advantage.credit=turn), the math: per-turn advantages against a plain computation on planted
episodes with varying turn counts, the token map, exactness under any micro-batch split and under torchrun's split
of the prompts over ranks, and the refused combinations. The trainer's side: tests/test_trainer_turn_credit.py."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from logitless.objectives import (AdvantageOptions, ObjectiveOptions, compute_advantages, loss_normalizer,
                                  policy_loss, token_advantages, token_turns, turn_advantages)
from logitless.trainer.batching import make_micro_batches
from logitless.trainer.distributed.parallel import World, rank_share

G = 3
# 3 groups of G episodes, 1 to 4 turns each; None: an unscorable episode (every reward None)
EPISODES = [
    [1.0, 0.0, 2.0], [0.5], [0.0, 3.0],
    [1.0, 1.0], [1.0, 1.0], [2.0, -1.0, 0.5, 1.0],
    [0.0, 1.0, 0.0], None, [0.0, 2.0, 0.0],
]


def oracle(episodes, gamma, baseline, estimator, scale, eps=1e-4, group_size=G):
    """The advantage of each turn of each episode, computed directly from the definition in docs/agents.md."""
    ret = [None if r is None else [sum(gamma ** (u - t) * r[u] for u in range(t, len(r))) for t in range(len(r))]
           for r in episodes]
    every = [x for R in ret if R is not None for x in R]
    out = []
    for b, R in enumerate(ret):
        if R is None:
            out.append([])
            continue
        group = [ret[g] for g in range((b // group_size) * group_size, (b // group_size + 1) * group_size)]
        row = []
        for t in range(len(R)):
            if baseline == "turn":  # the group's episodes that reached turn t, at turn t
                values = [Rg[t] for Rg in group if Rg is not None and len(Rg) > t]
                own = R[t]
            else:  # the group's episode returns
                values = [Rg[0] for Rg in group if Rg is not None]
                own = R[0]
            if len(values) < 2 or max(values) == min(values):
                row.append(0.0)
                continue
            if estimator == "grpo":
                a = R[t] - sum(values) / len(values)
            else:
                a = R[t] - (sum(values) - own) / (len(values) - 1)
            if scale == "group":
                a /= statistics.stdev(values) + eps
            elif scale == "batch":
                a /= statistics.stdev(every) + eps
            row.append(a)
        out.append(row)
    return out


def planted(episodes):
    K = max(len(r) for r in episodes if r is not None)
    rewards = torch.zeros(len(episodes), K, dtype=torch.float64)
    turns = torch.tensor([len(r) if r is not None else 2 for r in episodes])
    for b, r in enumerate(episodes):
        if r is None:
            rewards[b] = math.nan
        else:
            rewards[b, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return rewards, turns


@pytest.mark.parametrize("gamma,baseline,estimator,scale", list(itertools.product(
    (1.0, 0.5, 0.0), ("turn", "episode"), ("grpo", "rloo"), ("group", "batch", "none"))))
def test_turn_advantages_equal_the_direct_computation(gamma, baseline, estimator, scale):
    rewards, turns = planted(EPISODES)
    o = AdvantageOptions(credit="turn", turn_discount=gamma, turn_baseline=baseline, estimator=estimator, scale=scale)
    out = turn_advantages(rewards, turns, G, o)
    want = oracle(EPISODES, gamma, baseline, estimator, scale)
    for b, row in enumerate(want):
        got = out.advantages[b].tolist()
        assert got[: len(row)] == pytest.approx(row, rel=1e-5, abs=1e-6), (b, got, row)
        assert all(x == 0.0 for x in got[len(row):])  # past the episode's last turn (and unscorable rows)
    assert torch.isnan(out.returns[7]).all()  # the unscorable episode
    # group 1 with gamma 1 and the turn baseline: turn 0's returns are 2, 2, 2.5 and turn 1's 1, 1, 0.5, so both
    # cells carry signal and the two equal episodes get equal advantages
    assert out.advantages[3].tolist() == out.advantages[4].tolist()


def test_one_turn_per_episode_is_the_episode_level_advantage():
    torch.manual_seed(0)
    totals = torch.randn(12, dtype=torch.float64)
    for baseline, estimator, scale in itertools.product(("turn", "episode"), ("grpo", "rloo"), ("group", "none")):
        o = AdvantageOptions(credit="turn", turn_baseline=baseline, estimator=estimator, scale=scale)
        per_turn = turn_advantages(totals.view(-1, 1), torch.ones(12, dtype=torch.long), 4, o).advantages[:, 0]
        assert per_turn.tolist() == pytest.approx(compute_advantages(totals, 4, o).advantages.tolist(), abs=1e-6)


def test_a_terminal_reward_with_gamma_1_and_the_episode_baseline_is_the_episode_advantage():
    """Rewards only at the last turn: every turn's return-to-go is the episode's return, so every token gets the
    episode-level advantage whatever the turn counts."""
    totals = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 1.0], dtype=torch.float64)
    turns = torch.tensor([3, 1, 2, 2, 4, 1])
    rewards = torch.zeros(6, 4, dtype=torch.float64)
    rewards[torch.arange(6), turns - 1] = totals
    o = AdvantageOptions(credit="turn", turn_baseline="episode")
    out = turn_advantages(rewards, turns, 3, o)
    episode = compute_advantages(totals, 3, o).advantages
    for b in range(6):
        assert out.advantages[b, : turns[b]].tolist() == pytest.approx([float(episode[b])] * int(turns[b]), abs=1e-6)


def test_tokens_get_their_turns_advantage_and_observations_none():
    #            turn 0   obs   turn 1  obs  turn 2  pad
    completion = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0]])
    env = torch.tensor([[0, 0, 1, 0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0]])
    index, turns = token_turns(completion, env)
    assert index.tolist() == [[0, 0, -1, 1, 1, -1, -1, 2, -1], [0, -1, -1, 1, 1, -1, -1, -1, -1]]
    assert turns.tolist() == [3, 2]
    adv = torch.tensor([[0.5, -1.0, 2.0], [3.0, 4.0, 0.0]])
    assert token_advantages(adv, index).tolist() == [[0.5, 0.5, 0, -1, -1, 0, 0, 2, 0], [3, 0, 0, 4, 4, 0, 0, 0, 0]]


def _rollout(seed=0, B=9, P=3, T=10):
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(torch.randint(3, T + 1, (B,), generator=g).tolist()):
        completion[b, :n] = 1
    env = (torch.rand(B, T, generator=g) < 0.3).long() * completion
    env[:, 0] = 0
    return dict(prompt_ids=torch.randint(0, 50, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.randint(0, 50, (B, T), generator=g), completion_mask=completion,
                sampler_logp=-torch.rand(B, T, generator=g), truncated=torch.zeros(B, dtype=torch.bool),
                env=env, logp=-torch.rand(B, T, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo", "cispo"])
@pytest.mark.parametrize("size", [1, 2, 4, 9])
def test_per_token_advantages_give_the_full_batch_loss_under_any_micro_batch_split(loss_type, size):
    """The advantages are computed once over the whole step's groups; the micro-batches carry slices of them, and
    the sum of their losses and gradients is the full batch's."""
    x = _rollout()
    loss_mask = x["completion_mask"] * (1 - x["env"])
    index, turns = token_turns(x["completion_mask"], x["env"])
    rewards = torch.randn(9, int(turns.max()), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    adv = token_advantages(turn_advantages(rewards, turns, G, AdvantageOptions(credit="turn", turn_discount=0.9))
                           .advantages, index)
    opts = ObjectiveOptions(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    norm = loss_normalizer(opts, [loss_mask])
    logp = x["logp"].clone().requires_grad_(True)
    old = (x["logp"] + 0.1 * torch.randn(9, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    full = policy_loss(logp, loss_mask, adv, opts, norm, old_logp=old).loss
    (g_full,) = torch.autograd.grad(full, logp)
    micro = make_micro_batches(x["prompt_ids"], x["prompt_mask"], x["completion_ids"], x["completion_mask"],
                               x["sampler_logp"], x["truncated"], adv, size, loss_mask=loss_mask)
    total, grad = 0.0, torch.zeros_like(logp)
    for m in micro:
        t = m.completion_mask.shape[1]
        assert torch.equal(m.advantages, adv[m.rows][:, :t])  # each row's own slice of the step's advantages
        assert not adv[m.rows][:, t:].any()  # trimmed columns hold no advantage
        lp = logp[m.rows][:, :t].detach().requires_grad_(True)
        loss = policy_loss(lp, m.loss_mask, m.advantages, opts, norm, old_logp=old[m.rows][:, :t]).loss
        (g,) = torch.autograd.grad(loss, lp)
        grad[m.rows, :t] += g
        total += float(loss.detach())
    assert total == pytest.approx(float(full.detach()), rel=1e-12, abs=1e-14)
    assert torch.allclose(grad, g_full, rtol=1e-12, atol=1e-15)


def test_per_row_advantages_as_tokens_give_the_same_loss():
    x = _rollout(seed=3)
    mask = x["completion_mask"] * (1 - x["env"])
    adv = torch.randn(9, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for lt in ("dapo", "grpo", "vespo"):
        opts = ObjectiveOptions(loss_type=lt, off_policy_mask_threshold=0.05)
        kw = dict(old_logp=x["logp"] + 0.2, sampler_logp=x["logp"] - 0.1)
        a = policy_loss(x["logp"], mask, adv, opts, 100.0, **kw)
        b = policy_loss(x["logp"], mask, adv.view(-1, 1).expand(9, 10), opts, 100.0, **kw)
        assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-12)


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_ranks_share_of_the_prompts_holds_whole_groups_so_its_turn_advantages_are_the_full_ones(ranks):
    """Under torchrun each rank rolls out G episodes of its `rank_share` of the step's prompts and computes the
    advantages of those whole groups before any micro-batch split: the ranks' values are the one-process values."""
    rewards, turns = planted(EPISODES * 2)  # 6 prompts
    prompts = list(range(len(turns) // G))
    o = AdvantageOptions(credit="turn", turn_discount=0.7)
    full = turn_advantages(rewards, turns, G, o)
    parts = []
    for rank in range(ranks):
        share = rank_share(prompts, World(rank=rank, size=ranks))
        rows = torch.tensor([p * G + g for p in share for g in range(G)])
        parts.append(turn_advantages(rewards[rows], turns[rows], G, o).advantages)
    assert torch.equal(torch.cat(parts), full.advantages)


def test_bad_combinations_are_refused_naming_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"turn_discount=0.9 only applies to credit='turn'.*Set credit='turn'"):
        AdvantageOptions(turn_discount=0.9)
    with pytest.raises(ValueError, match=r"turn_baseline='episode' only applies to credit='turn'"):
        AdvantageOptions(turn_baseline="episode")
    with pytest.raises(ValueError, match=r"turn_discount=1.5 must be <= 1"):
        AdvantageOptions(credit="turn", turn_discount=1.5)
    with pytest.raises(ValueError, match=r"credit='turns' is not valid; choose one of 'episode', 'turn'"):
        AdvantageOptions(credit="turns")
    with pytest.raises(ValueError, match=r"normalize_then_sum.*Use multi_reward='sum_then_normalize'"):
        AdvantageOptions(credit="turn", multi_reward="normalize_then_sum")
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\] = \[2\].*or the shape of logp \[2, 3\]"):
        policy_loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 2), ObjectiveOptions(), 1.0)
