"""The draw over a vocabulary split across a group (`logitless/rollout/vocab_split.py`), one process simulating the
group (`group_draw`: every rank's draw run twice, the first time recording what each gives the all-gather, the
second time gathering those): the tokens of the draw over the whole rows and logprobs within 1e-5, on odd splits
(uneven chunks, 7 ranks, a chunk below the Triton draw's block), bf16/fp16/fp32 logits, temperatures 1 and not,
greedy, ties across ranks (the lowest id, as argmax), a rank whose columns are all -inf, a step counter on the
device; the whole rows gathered back for the filters; the split's refusal. The Triton draw's block partials are
checked the same way under the interpreter in tests/test_triton_sampling.py; the collectives themselves on 2 and 4
gloo ranks in tests/test_tensor_parallel.py."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from logitless.rollout.sampling import row_keys, sample_tokens, step_keys, vocab_codes
from logitless.rollout.vocab_split import (
    combine_partials,
    shard_codes,
    shard_of,
    shard_partials,
    split_sampler,
    whole_logits,
)

TOL = 1e-5


def group_run(vocab: int, ranks: int, fn: Callable) -> list:
    """fn(shard) on each rank's `VocabShard` of `vocab` over `ranks`, the gather being the group's: every rank's fn
    runs twice, the first time recording what it gives the gather (which returns its input repeated), the second
    time gathering those (fn is deterministic, so the second run is the group's)."""
    seen: dict[int, list[torch.Tensor]] = {}

    def run(record: bool) -> list:
        out = []
        for r in range(ranks):
            calls = iter(range(10**6))

            def gather(t: torch.Tensor, r: int = r, calls=calls) -> torch.Tensor:
                k = next(calls)
                if record:
                    seen.setdefault(r, []).append(t.clone())
                    return torch.stack([t] * ranks)
                return torch.stack([seen[i][k] for i in range(ranks)])

            out.append(fn(shard_of(vocab, ranks, r, gather)))
        return out

    run(True)
    return run(False)


def group_draw(logits: torch.Tensor, ranks: int, keys: torch.Tensor, step, T: float, greedy: bool,
               kernel: str = "torch") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's (token, logp) of `split_sampler` over its columns of `logits` [B, V]."""

    def draw(shard):
        cols = logits[:, shard.start : shard.start + shard.size]
        sampler = split_sampler(shard, logits.device, kernel, compile=False)
        return sampler(cols, keys, step, shard_codes(shard.start, shard.size, logits.device), T, greedy)

    return group_run(logits.shape[1], ranks, draw)


CASES = {  # (B, V, ranks, T, greedy, dtype)
    "uneven_4": (6, 258, 4, 0.9, False, torch.float32),
    "bf16_3": (5, 1000, 3, 1.0, False, torch.bfloat16),
    "greedy_2": (4, 37, 2, 1.3, True, torch.float32),
    "fp16_7_hot": (3, 1001, 7, 1.7, False, torch.float16),
    "one_row_cold": (1, 5000, 2, 0.3, False, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_group_draws_the_whole_rows_tokens(name):
    B, V, N, T, greedy, dtype = CASES[name]
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
    keys = row_keys(3, torch.arange(B) // 2, torch.arange(B) % 2)
    want_tok, want_logp = sample_tokens(logits, None, step_keys(keys, 5), vocab_codes(V, "cpu"), T, greedy)
    exact = torch.log_softmax(logits.double() / T, -1).gather(1, want_tok[:, None])[:, 0]
    results = group_draw(logits, N, keys, 5, T, greedy)
    for tok, logp in results:  # every rank alike
        assert torch.equal(tok, want_tok) and tok.dtype == torch.long
        assert float((logp - want_logp).abs().max()) <= TOL and logp.dtype == torch.float32
        assert float((logp.double() - exact).abs().max()) <= TOL
    shards = [shard_of(V, N, r, None) for r in range(N)]
    assert [s.size for s in shards] == [len(c) for c in torch.arange(V).chunk(N)]  # DTensor's Shard(0) sizes
    if name == "uneven_4":
        assert len({int(t) * N // V for t in want_tok}) > 1  # the tokens come from several ranks' columns


def test_a_device_step_counter_draws_the_host_steps_tokens():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    keys = row_keys(8, torch.arange(4), torch.zeros(4, dtype=torch.long))
    host = group_draw(logits, 3, keys, 9, 1.0, False)
    device = group_draw(logits, 3, keys, torch.tensor(9), 1.0, False)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(host, device))
    other = group_draw(logits, 3, keys, 10, 1.0, False)
    assert not torch.equal(host[0][0], other[0][0])  # the step matters


def test_ties_across_ranks_go_to_the_lowest_token_id():
    tied = torch.zeros(2, 300)
    tied[:, [70, 250]] = 5.0  # ranks 0 and 2 of 3 (chunks of 100)
    keys = row_keys(1, torch.arange(2), torch.zeros(2, dtype=torch.long))
    for tok, _ in group_draw(tied, 3, keys, 0, 1.0, True):
        assert tok.tolist() == tied.argmax(-1).tolist() == [70, 70]


def test_a_rank_whose_columns_are_all_minus_infinity_is_never_drawn():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    logits[:, 100:200] = float("-inf")  # rank 1 of 3
    keys = row_keys(6, torch.arange(3), torch.zeros(3, dtype=torch.long))
    want = sample_tokens(logits, None, step_keys(keys, 1), vocab_codes(300, "cpu"), 1.0, False)
    for tok, logp in group_draw(logits, 3, keys, 1, 1.0, False):
        assert torch.equal(tok, want[0]) and not ((tok >= 100) & (tok < 200)).any()
        assert torch.isfinite(logp).all() and float((logp - want[1]).abs().max()) <= TOL


def test_partials_combine_in_any_grouping_of_the_columns():
    """A rank's columns reduced to one partial, or split into several: the same draw (what the Triton blocks do)."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    keys = step_keys(row_keys(4, torch.arange(3), torch.arange(3)), 2)
    one = shard_partials(logits, keys, shard_codes(0, 100, "cpu"), 0, 0.8, False)
    pieces = torch.cat([shard_partials(logits[:, a:b], keys, shard_codes(a, b - a, "cpu"), a, 0.8, False)
                        for a, b in ((0, 17), (17, 64), (64, 100))], 1)
    (t1, l1), (t3, l3) = combine_partials(one), combine_partials(pieces)
    assert torch.equal(t1, t3) and float((l1 - l3).abs().max()) <= TOL
    assert torch.equal(t1, sample_tokens(logits, None, keys, vocab_codes(100, "cpu"), 0.8, False)[0])


def test_the_whole_rows_are_gathered_back_for_the_filters():
    logits = torch.randn(3, 258, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for N in (2, 4, 7):
        rows = group_run(258, N, lambda s: whole_logits(s, logits[:, s.start : s.start + s.size]))
        assert all(torch.equal(r, logits) for r in rows)


def test_a_vocabulary_too_small_for_the_group_is_refused():
    with pytest.raises(ValueError, match="a vocabulary of 5 tokens in chunks of 2 leaves a process of 4 without"):
        shard_of(5, 4, 0, None)
    assert shard_of(7, 4, 3, None).size == 1
