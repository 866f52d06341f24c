"""Parts of the static engine on their own: the smallest `max_kv_gib` that `wave_rows` suggests (it must hold
one row, at 3 significant digits), the even split into waves, the sampling processors built from the options,
and when the decode loop runs its host-side checks. Cases that mutation testing (docs/testing.md) showed the
engine tests leave open."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from logitless.rollout import SamplingOptions
from logitless.rollout.hf import sampling_processors
from logitless.rollout.kv_cache import wave_rows
from logitless.rollout.static import StaticEngine
from tests.test_rollout_families import TOK, make_model

GIB = 2**30


@pytest.mark.parametrize("row_bytes, shown, need", [
    (GIB // 8, "0.125", "0.125"),  # exactly 0.125 GiB: 0.125 is enough
    (GIB // 8 + 1, "0.125", "0.126"),  # one byte more: 0.125 is not
    (int(0.11412 * GIB), "0.1141", "0.115"),  # rounded up at the third digit, not the fourth
    (3 * GIB + 5, "3", "3.01"),
    (1000 * GIB + 1, "1000", "1010.0"),  # 1 byte over 1000 GiB, below the rounding slack: one unit more
])
def test_too_small_budget_suggests_the_smallest_that_holds_one_row(row_bytes, shown, need):
    with pytest.raises(ValueError) as info:
        wave_rows(4, row_bytes, row_bytes / 2, "rollout.max_kv_gib")
    half = f"{row_bytes / 2 / GIB:.4g}"
    assert str(info.value) == (
        f"rollout.max_kv_gib={half} GiB is too small for the KV cache of one row ({shown} GiB: prompt + "
        f"max_new_tokens positions); set rollout.max_kv_gib >= {need}, or lower max_new_tokens"
    )
    assert float(need) * GIB >= row_bytes
    assert wave_rows(4, row_bytes, float(need) * GIB, "rollout.max_kv_gib") == 1


def test_rows_are_spread_evenly_over_the_fewest_waves():
    assert wave_rows(9, 100, 400, "x") == 3  # 4 fit, but 3 waves of 3 beat 4 + 4 + 1
    assert wave_rows(10, 100, 350, "x") == 3  # 3 fit: 4 waves of 3, 3, 3, 1
    assert wave_rows(10, 100, 1000, "x") == 10 and wave_rows(10, 100, None, "x") == 10
    assert wave_rows(10, 100, 999.9, "x") == 5


def test_sampling_processors_follow_the_options():
    assert sampling_processors(SamplingOptions()) == []  # T = 1, no filter
    assert sampling_processors(SamplingOptions(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)) == []  # greedy
    procs = sampling_processors(SamplingOptions(repetition_penalty=2.0, temperature=0.5, top_k=3, top_p=0.9,
                                                min_p=0.05))
    assert [type(p) for p in procs] == [RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                        TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper]
    assert procs[0].penalty == 2.0 and procs[1].temperature == 0.5 and procs[2].top_k == 3
    assert procs[3].top_p == 0.9 and procs[4].min_p == 0.05
    only_penalty = sampling_processors(SamplingOptions(repetition_penalty=0.5, temperature=0.0))
    assert [type(p) for p in only_penalty] == [RepetitionPenaltyLogitsProcessor]


class _Recording(StaticEngine):
    """The engine, noting the step count of each host check it runs."""

    def _all_done(self, live, history, P, steps, options):
        self.checked.append(steps)
        return super()._all_done(live, history, P, steps, options)


def test_host_checks_run_every_check_every_steps():
    eng = _Recording(make_model("llama"), TOK, check_every=4, cache_multiple=8)
    eng.checked = []
    b = eng.generate(["ab"], SamplingOptions(num_generations=2, max_new_tokens=10, seed=0, ignore_eos=True))
    assert eng.checked == [4, 8]  # not after the last step, which ends the loop anyway
    assert (b.completion_mask.sum(1) == 10).all()


@pytest.mark.parametrize("rows,buckets,compact,want", [
    (128, 1, False, 1), (128, 4, False, 4), (128, 1, True, 5), (128, 4, True, 20), (100, 2, True, 10),
    (17, 1, True, 3), (9, 1, True, 2), (8, 3, True, 3),
])
def test_compiled_variants_count_every_row_count_compaction_can_reach(rows, buckets, compact, want):
    from logitless.rollout.static_rows import compiled_variants

    assert compiled_variants(rows, buckets, compact) == want


def test_recompile_limit_is_raised_for_the_decode_variants_and_never_lowered():
    from logitless.rollout.static_rows import RECOMPILE_MARGIN, allow_recompiles

    with torch._dynamo.config.patch(recompile_limit=8):  # restored after
        allow_recompiles(2)
        assert torch._dynamo.config.recompile_limit == 8  # enough already
        allow_recompiles(20)  # 128 rows compacted down to 8, 4 length buckets
        assert torch._dynamo.config.recompile_limit == 20 + RECOMPILE_MARGIN
        allow_recompiles(3)
        assert torch._dynamo.config.recompile_limit == 20 + RECOMPILE_MARGIN


def test_compiled_engine_allows_the_recompiles_its_settings_need():
    from logitless.rollout.static_rows import RECOMPILE_MARGIN

    model = make_model("llama")
    with torch._dynamo.config.patch(recompile_limit=8):
        StaticEngine(model, TOK)._forward(model, torch.device("cpu"), 128)  # eager on CPU: nothing to allow
        assert torch._dynamo.config.recompile_limit == 8
        eng = StaticEngine(model, TOK, compile=True, length_buckets=4, compact_finished=True)
        forward, compiled = eng._forward(model, torch.device("cpu"), 128)  # compiles lazily, at the first call
        assert compiled and torch._dynamo.config.recompile_limit == 20 + RECOMPILE_MARGIN
    for attr in ("_compiled_call", "_last_compile_config"):  # the model's compiled call stays unused
        model.__dict__.pop(attr, None)
