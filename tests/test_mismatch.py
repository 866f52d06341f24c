"""The sampler–trainer mismatch metrics (rollout/mismatch_mean, _max, _kl; objectives/mismatch.py): equal to a direct
computation over split micro-batches and in a training run, moved by exactly a planted offset in the engine's
logprobs, and warned about (once, again when it doubles) with the run's likely causes."""

from __future__ import annotations

import math

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.objectives import merge_metrics
from logitless.objectives.mismatch import mismatch_summary, sampler_mismatch
from logitless.trainer.placement import placement
from logitless.trainer.loop import train
from logitless.trainer.report.metrics import MismatchReport, mismatch_causes
from tests import dist_worker as w

KEYS = ("rollout/mismatch_mean", "rollout/mismatch_max", "rollout/mismatch_kl")
MAKE_ENGINE = placement.make_rollout_engine  # the trainer's own factory


def direct(logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The three metrics written out over the masked tokens, fp64."""
    r = (logp.double() - sampler_logp.double())[mask.bool()]
    return dict(zip(KEYS, (float(r.abs().mean()), float(r.abs().max()), float((r.exp() - 1 - r).mean()))))


def test_stats_merge_over_micro_batches_to_the_direct_computation():
    g = torch.Generator().manual_seed(0)
    logp, samp = -5 * torch.rand(7, 11, generator=g), -5 * torch.rand(7, 11, generator=g)
    mask = (torch.rand(7, 11, generator=g) < 0.7).long()
    mask[3] = 0  # a row without tokens
    whole = mismatch_summary(sampler_mismatch(logp, samp, mask))
    parts = merge_metrics([sampler_mismatch(logp[a:b], samp[a:b], mask[a:b]) for a, b in ((0, 2), (2, 3), (3, 7))])
    want = direct(logp, samp, mask)
    for k in KEYS:
        assert whole[k] == pytest.approx(want[k], rel=1e-12)
        assert mismatch_summary(parts)[k] == pytest.approx(want[k], rel=1e-12)
    # the masked-out positions may hold anything (padding's 0, -inf)
    junk = torch.where(mask.bool(), samp, -math.inf)
    assert mismatch_summary(sampler_mismatch(logp, junk, mask)) == pytest.approx(whole, rel=1e-12)
    assert mismatch_summary(sampler_mismatch(logp, samp, torch.zeros_like(mask))) == {}  # no token: nothing logged


class Offset:
    """The run's real engine, whose logprobs of completion tokens get `offsets[k]` added at its k-th call; the
    batches it returned are kept."""

    def __init__(self, engine, offsets):
        self.engine, self.offsets, self.batches = engine, list(offsets), []

    def generate(self, prompts, options, episodes=None):
        b = self.engine.generate(prompts, options)
        b.sampler_logp = b.sampler_logp + self.offsets[len(self.batches)] * b.completion_mask
        self.batches.append(b)
        return b


@pytest.fixture(scope="module")
def tok(gpt2_tokenizer_dir):
    return w.tokenizer(gpt2_tokenizer_dir)


def run(tmp_path, tok, monkeypatch, offsets, *overrides):
    engines: list[Offset] = []
    monkeypatch.setattr(placement, "make_rollout_engine",
                        lambda *args: engines.append(Offset(MAKE_ENGINE(*args), offsets)) or engines[-1])
    cfg = w.config(tmp_path, f"train.max_steps={len(offsets)}", "train.skip_zero_advantage=false",
                   "train.num_iterations=2", "optim.learning_rate=0.05", *overrides)
    return train(cfg, model=w.model(), tokenizer=tok).records, engines[0].batches


def test_run_logs_the_first_passs_mismatch_and_a_planted_offset_moves_it_by_its_size(tmp_path, tok, monkeypatch,
                                                                                   capsys, one_thread):
    """One step on the hf engine (fp32: sampler and trainer agree to ~1e-7), μ = 2 over 6 micro-batches: the
    metrics are the direct computation against the trainer's logprobs before any optimizer step (the second pass's
    policy has moved); with 0.1 nats added to every sampler logprob, mean and max move by 0.1 and the KL estimate is
    exp(-0.1) - 1 + 0.1. A growing offset is warned about at once and again when the mean doubles."""
    base, (b0,) = run(tmp_path / "base", tok, monkeypatch, [0.0])
    planted, batches = run(tmp_path / "planted", tok, monkeypatch, [0.1, 0.12, 0.25])
    args = (b0.prompt_ids, b0.prompt_mask, b0.completion_ids, b0.completion_mask)
    with torch.no_grad():
        logp, _ = completion_logprobs(w.model(), *args)  # the step-1 policy: LoRA's B = 0 leaves the base model
    assert torch.equal(batches[0].completion_ids, b0.completion_ids)  # the same samples, offset only
    for rec, b in ((base[0], b0), (planted[0], batches[0])):
        want = direct(logp, b.sampler_logp, b.completion_mask)
        assert {k: rec[k] for k in KEYS} == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert base[0]["rollout/mismatch_max"] < 1e-4  # fp32 engine and trainer agree
    assert planted[0]["rollout/mismatch_mean"] - base[0]["rollout/mismatch_mean"] == pytest.approx(0.1, abs=1e-5)
    assert planted[0]["rollout/mismatch_max"] == pytest.approx(0.1, abs=2e-4)
    assert planted[0]["rollout/mismatch_kl"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-3)
    assert [r["rollout/mismatch_mean"] for r in planted] == pytest.approx([0.1, 0.12, 0.25], abs=1e-4)
    err = capsys.readouterr().err
    mismatch = [w for w in err.split("warning:")[1:] if "the sampler's logprobs differ" in w]  # (not the run's
    assert len(mismatch) == 2 and mismatch[0].startswith(" step 1:") and mismatch[1].startswith(" step 3:")  # others)
    assert "logging.mismatch_warning=0.05" in err and "rollout.backend=hf" in err  # the hf engine's own cause
    assert "step 1: reward" in err and "mismatch 0.100" in err  # the progress line (no terminal: printed)


def test_warning_threshold_and_repeats():
    shown: list[str] = []
    report = MismatchReport(shown.append, 0.05, "some cause")
    means = [0.01, None, 0.06, 0.1, 0.119, math.nan, 0.12, 0.2, 0.3]
    fired = [report(i, {} if m is None else {"rollout/mismatch_mean": m, "rollout/mismatch_max": 1.0,
                                             "rollout/mismatch_kl": 0.01}) for i, m in enumerate(means)]
    assert fired == [False, False, True, False, False, False, True, False, True]
    assert "up from 0.06" in shown[1] and "up from 0.12" in shown[2] and all("some cause" in s for s in shown)
    assert not MismatchReport(shown.append, None, "")(0, {"rollout/mismatch_mean": 9.0})  # null: never


@pytest.mark.parametrize("overrides, says, not_says", [
    (["rollout.backend=static", "train.async_rollout=true"], ["train.async_rollout=true", "rollout.merge_lora=false",
                                                             "objective.sampler_is_mode (e.g."], []),
    (["rollout.backend=static", "model.lora=false", "objective.sampler_is_mode=token_truncate"],
     ["rollout.backend=hf", "sampler_is_mode=token_truncate already"], ["merge_lora", "async"]),
    (["rollout.backend=hf"], ["rollout.backend=hf runs", "model.attn_implementation"], ["merge_lora", "async"]),
])
def test_causes_name_the_runs_settings_and_their_fixes(overrides, says, not_says):
    text = mismatch_causes(w.config("unused", *overrides))
    assert all(s in text for s in says) and not any(s in text for s in not_says), text


def test_a_step_that_trains_no_row_logs_the_mismatch_of_a_sample_of_rows(tmp_path, tok, monkeypatch, one_thread):
    """Every reward equal, so every advantage is 0 and no row trains (train.skip_zero_advantage): each step still logs
    rollout/mismatch_* in metrics.jsonl, the direct computation over train.mismatch_sample_rows=5 of its 16 rows
    spread evenly (0, 3, 6, 9, 12) against the policy the rollout sampled from (LoRA's B stays 0: the base model).
    0 rows: not logged."""
    import json

    from tests.conftest import reward_module

    reward_module(tmp_path, monkeypatch, "same_reward",
                  "def same(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    records, batches = run(tmp_path / "run", tok, monkeypatch, [0.1, 0.03], "reward.reward_funcs=[same_reward:same]",
                           "train.skip_zero_advantage=true", "train.num_iterations=1", "train.mismatch_sample_rows=5")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [0, 3, 6, 9, 12]
    for rec, line, b in zip(records, logged, batches):
        assert rec["trained_rows"] == 0 and rec["advantage"] == 0
        with torch.no_grad():
            logp, _ = completion_logprobs(w.model(), b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)
        want = direct(logp[rows], b.sampler_logp[rows], b.completion_mask[rows])
        assert {k: line[k] for k in KEYS} == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert [r["rollout/mismatch_mean"] for r in logged] == pytest.approx([0.1, 0.03], abs=1e-4)
    off, _ = run(tmp_path / "off", tok, monkeypatch, [0.1], "reward.reward_funcs=[same_reward:same]",
                 "train.skip_zero_advantage=true", "train.num_iterations=1", "train.mismatch_sample_rows=0")
    assert not any(k in off[0] for k in KEYS)
