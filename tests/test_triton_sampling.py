"""The Triton token draw (`logitless.ops.triton_sampling`, rollout.sampler_kernel=triton).

CPU, under TRITON_INTERPRET=1 (`tests/interpret.py`): the same tokens as the engine's torch sampler
(`rollout.sampling.sample_tokens` at `step_keys`) and as the op's own naive oracle, and the same logprobs to fp32
rounding, on odd shapes (vocabularies across block edges and below one block, strided rows, bf16/fp16/fp32 logits,
temperatures 1 and not, greedy); the block partials of a vocabulary split over ranks; a block of -inf logits; ties
go to the first index, as torch's argmax; a row's draw does not depend on the other rows. Equal tokens carry the
torch sampler's chi-square test (tests/test_fused_sampler.py) over to the kernel on CPU; the interpreter runs each
program in Python, too slowly for the 30,000 draws of a chi-square test itself. Refusals: the kernel off CUDA, an
unknown name, off the static backend. GPU (`python -m pytest -m gpu tests/test_triton_sampling.py`): bf16 logits of
Qwen2.5's vocabulary at 128 rows against the compiled torch sampler, and the chi-square test of the kernel's own
draws (the check fails for draws at another temperature).
"""

from __future__ import annotations

import pytest
import torch

from tests.interpret import patch_interpreter, run_cases
from tests.test_fused_sampler import LOGITS, N, check_distribution

pytest.importorskip("triton")

TEMPS = (1.0, 1.7)  # chi-square cases: softmax(LOGITS / T)


def _run_cases() -> dict:
    """Executed inside the TRITON_INTERPRET=1 subprocess; returns {case: metrics}."""
    patch_interpreter()
    from logitless.ops.triton_sampling import sample_step, sample_step_reference
    from logitless.rollout.sampling import row_keys, sample_tokens, step_keys, step_salt, vocab_codes

    def case(B, V, T, greedy, dtype, *, block, strided=False, step=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        wide = (torch.randn(B, 2, V, generator=g) * 4).to(dtype)
        logits = wide[:, 1] if strided else wide[:, 1].contiguous()  # strided: rows 2 V apart
        keys = row_keys(seed, torch.arange(B) // 2, torch.arange(B) % 2)
        token, logp = sample_step(logits, keys, step_salt(step), T, greedy, block=block)
        torch_tok, torch_logp = sample_tokens(logits.float(), None, step_keys(keys, step), vocab_codes(V, "cpu"), T,
                                              greedy)
        ref_tok, _ = sample_step_reference(logits, keys, step_salt(step), T, greedy)
        exact = torch.log_softmax(logits.double() / T, -1).gather(1, token[:, None])[:, 0]
        return {"same_tokens": torch.equal(token, torch_tok) and torch.equal(token, ref_tok),
                "logp_err": float((logp.double() - exact).abs().max()),
                "torch_logp_err": float((torch_logp.double() - exact).abs().max()),
                "dtypes": [str(token.dtype), str(logp.dtype)], "blocks": -(-V // block)}

    res = {
        "fp32_blocks_and_a_partial_one": case(6, 1000, 1.0, False, torch.float32, block=256),
        "bf16_below_one_block_hot": case(5, 70, 0.7, False, torch.bfloat16, block=256),
        "fp16_strided_rows": case(4, 333, 1.3, False, torch.float16, block=64, strided=True),
        "greedy_many_blocks": case(3, 2049, 1.0, True, torch.float32, block=128),
        "greedy_bf16_hot": case(3, 500, 0.5, True, torch.bfloat16, block=256),
        "one_row_many_blocks": case(1, 4100, 1.0, False, torch.float32, block=512, step=11),
    }

    # a whole block of -inf logits (a masked vocabulary range): finite logp, never drawn
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=g)
    logits[:, 64:192] = float("-inf")
    keys = row_keys(5, torch.arange(4), torch.zeros(4, dtype=torch.long))
    tok, lp = sample_step(logits, keys, 9, 1.0, False, block=64)
    res["masked_blocks"] = {"finite": bool(torch.isfinite(lp).all()),
                            "drawn_masked": bool(((tok >= 64) & (tok < 192)).any()),
                            "logp_err": float((lp.double() - torch.log_softmax(logits.double(), -1)
                                               .gather(1, tok[:, None])[:, 0]).abs().max())}
    # ties: equal logits in two blocks; greedy takes the first index, as torch's argmax
    tied = torch.zeros(2, 300)
    tied[:, [70, 250]] = 5.0
    tok, _ = sample_step(tied, keys[:2], 0, 1.0, True, block=64)
    res["ties"] = {"tokens": tok.tolist(), "torch": tied.argmax(-1).tolist()}

    # a row's draw does not depend on the other rows: rows 3 and 1 alone equal rows 3 and 1 of the batch
    logits = torch.randn(5, 777, generator=g)
    keys = row_keys(2, torch.arange(5), torch.arange(5))
    tb, lb = sample_step(logits, keys, 4, 0.9, False, block=256)
    ts, ls = sample_step(logits[[3, 1]], keys[[3, 1]], 4, 0.9, False, block=256)
    res["rows_independent"] = {"same": torch.equal(tb[[3, 1]], ts) and torch.equal(lb[[3, 1]], ls)}

    # a step counter read on the device (a replayed CUDA graph's) draws what the host-hashed step draws, for
    # steps past 2**32 - GOLDEN too (the kernel's uint32 sum wraps as counter_salt's masked one)
    counted = {}
    for step in (0, 7, 2**32 - 5):
        th, lh = sample_step(logits, keys, step_salt(step), 0.9, False, block=256)
        tc, lc = sample_step(logits, keys, torch.tensor(step), 0.9, False, block=256)
        tt, _ = sample_tokens(logits, None, step_keys(keys, torch.tensor(step)), vocab_codes(777, "cpu"), 0.9, False)
        counted[str(step)] = torch.equal(th, tc) and torch.equal(lh, lc) and torch.equal(tc, tt)
    res["counter_salt"] = counted

    # a vocabulary split over a group (`rollout/vocab_split.py`, the group simulated in this process): each rank's
    # block partials (its columns' global token ids, the blocks of its chunk, empty ones past its columns) combine
    # into the whole rows' draw
    from tests.test_vocab_split import group_draw

    split = {}
    for name, (B, V, n_ranks, T, greedy, dtype, step) in {
        "empty_block": (3, 8193, 2, 0.9, False, torch.float32, 3),  # rank 1: 4,096 columns, its 2nd block empty
        "bf16_3_ranks": (2, 10000, 3, 1.0, False, torch.bfloat16, 4),
        "greedy_two_blocks": (2, 9000, 2, 1.0, True, torch.float32, 5),
        "fp16_uneven_4": (3, 258, 4, 1.3, False, torch.float16, torch.tensor(6)),
    }.items():
        logits = (torch.randn(B, V, generator=g) * 4).to(dtype)
        keys = row_keys(3, torch.arange(B), torch.arange(B) % 2)
        salt = step if torch.is_tensor(step) else step_salt(step)
        want_tok, want_logp = sample_step(logits, keys, salt, T, greedy)
        torch_tok, _ = sample_tokens(logits, None, step_keys(keys, step), vocab_codes(V, "cpu"), T, greedy)
        ranks = group_draw(logits, n_ranks, keys, step, T, greedy, kernel="triton")
        split[name] = {"same_tokens": all(torch.equal(t, want_tok) and torch.equal(t, torch_tok) for t, _ in ranks),
                       "logp_err": max(float((lp - want_logp).abs().max()) for _, lp in ranks)}
    res["vocab_split"] = split
    return res


@pytest.fixture(scope="module")
def cases() -> dict:
    return run_cases(__file__)


SHAPES = ["fp32_blocks_and_a_partial_one", "bf16_below_one_block_hot", "fp16_strided_rows", "greedy_many_blocks",
          "greedy_bf16_hot", "one_row_many_blocks"]


@pytest.mark.parametrize("name", SHAPES)
def test_kernel_draws_the_torch_samplers_tokens(cases, name):
    c = cases[name]
    assert c["same_tokens"], c
    assert c["logp_err"] < 2e-5 and c["torch_logp_err"] < 2e-5, c  # fp32 rounding of values up to ~30
    assert c["dtypes"] == ["torch.int64", "torch.float32"], c


def test_the_shapes_cover_several_blocks_and_less_than_one(cases):
    blocks = {cases[n]["blocks"] for n in SHAPES}
    assert 1 in blocks and max(blocks) >= 8, blocks


def test_masked_vocabulary_blocks_are_never_drawn_and_keep_logp_finite(cases):
    c = cases["masked_blocks"]
    assert c["finite"] and not c["drawn_masked"] and c["logp_err"] < 1e-5, c


def test_ties_go_to_the_first_index_as_torchs_argmax(cases):
    assert cases["ties"]["tokens"] == cases["ties"]["torch"] == [70, 70]


def test_a_rows_draw_does_not_depend_on_the_other_rows(cases):
    assert cases["rows_independent"]["same"]


def test_a_device_step_counter_draws_the_host_hashed_steps_tokens(cases):
    assert cases["counter_salt"] == {"0": True, "7": True, str(2**32 - 5): True}


def test_the_block_partials_of_a_split_vocabulary_draw_the_whole_rows_tokens(cases):
    """rollout.tensor_parallel's draw over each rank's vocabulary columns with the Triton kernel (block partials
    offset to the rank's token ids, gathered and combined): the whole rows' tokens, logprobs within 1e-5."""
    split = cases["vocab_split"]
    assert len(split) == 4
    for name, c in split.items():
        assert c["same_tokens"] and c["logp_err"] <= 1e-5, (name, c)


def test_a_tensor_salt_must_be_a_0d_int64_counter_on_the_logits_device():
    from logitless.ops.triton_sampling import sample_step

    with pytest.raises(ValueError, match=r"a tensor salt is a 0-d int64 counter on cpu, got \(1,\) torch.int32"):
        sample_step(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.int32), 1.0, False)


def test_off_cuda_the_kernel_is_refused_and_auto_is_torch():
    from logitless.rollout.sampling import resolve_sampler_kernel as pick

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert pick("auto", cpu, True) == "torch" and pick("auto", cuda, False) == "torch"
    assert pick("auto", cuda, True) == "triton" and pick("torch", cuda, True) == "torch"
    with pytest.raises(ValueError, match=r"rollout\.sampler_kernel=triton runs Triton kernels on a CUDA GPU, but "
                                         r"the rollout decodes on cpu; set rollout\.sampler_kernel=torch"):
        pick("triton", cpu, True)
    with pytest.raises(ValueError, match=r"decodes on cuda:0 without the triton package"):
        pick("triton", cuda, False)
    with pytest.raises(ValueError, match=r"rollout\.sampler_kernel='cuda': use one of"):
        pick("cuda", cpu, True)


def test_an_engine_refuses_the_kernel_on_cpu(tiny_qwen2_model, gpt2_tokenizer):
    from logitless.rollout.static import StaticEngine

    if torch.cuda.is_available():
        pytest.skip("the model here is on the CPU, but the check reads where the rollout decodes")
    assert StaticEngine(tiny_qwen2_model, gpt2_tokenizer).sampler_kernel == "torch"
    with pytest.raises(ValueError, match=r"rollout\.sampler_kernel=triton runs Triton kernels on a CUDA GPU"):
        StaticEngine(tiny_qwen2_model, gpt2_tokenizer, sampler_kernel="triton")


def test_the_option_needs_the_static_backend():
    from logitless.trainer.config.schema import load_train_config

    with pytest.raises(ValueError, match=r"rollout\.sampler_kernel='triton' needs rollout\.backend=static"):
        load_train_config(None, ["rollout.backend=hf", "rollout.sampler_kernel=triton"])
    with pytest.raises(ValueError, match=r"rollout\.sampler_kernel"):
        load_train_config(None, ["rollout.backend=static", "rollout.sampler_kernel=cuda"])
    assert load_train_config(None, []).rollout.sampler_kernel == "auto"


@pytest.mark.gpu
def test_gpu_bf16_qwen_vocabulary_matches_the_compiled_torch_sampler():
    """128 rows of bf16 logits over 151,936 tokens, 8 steps: the tokens of the compiled torch sampler (its noise
    is computed by inductor's kernels, so a near-tie may round the other way: at most 1 in 1,000 differ) and
    logprobs within fp32 rounding."""
    from logitless.ops.triton_sampling import sample_step
    from logitless.rollout.sampling import fused_sampler, row_keys, step_keys, step_salt, vocab_codes

    dev = torch.device("cuda")
    B, V = 128, 151_936
    g = torch.Generator(device=dev).manual_seed(0)
    keys = row_keys(3, torch.arange(B, device=dev) // 8, torch.arange(B, device=dev) % 8)
    codes, torch_draw = vocab_codes(V, dev), fused_sampler(dev, True)
    same, total, worst = 0, 0, 0.0
    for step, T in enumerate([1.0, 1.0, 0.7, 0.7, 1.0, 1.2, 1.0, 1.0]):
        logits = (torch.randn(B, V, device=dev, generator=g) * 3).to(torch.bfloat16)
        tok, lp = sample_step(logits, keys, step_salt(step), T, False)
        ref_tok, ref_lp = torch_draw(logits, None, step_keys(keys, step), codes, T, False)
        same += int((tok == ref_tok).sum())
        total += B
        eq = tok == ref_tok
        worst = max(worst, float((lp[eq] - ref_lp[eq]).abs().max()))
    assert same >= total * 0.999, (same, total)
    assert worst < 1e-4, worst


def _gpu_draws(T: float) -> tuple[torch.Tensor, torch.Tensor]:
    """N draws (one per row, each row its own stream) from softmax(LOGITS / T) by the kernel on the GPU."""
    from logitless.ops.triton_sampling import sample_step
    from logitless.rollout.sampling import row_keys

    dev = torch.device("cuda")
    keys = row_keys(11, torch.arange(N, device=dev), torch.zeros(N, dtype=torch.long, device=dev))
    tok, lp = sample_step(LOGITS.to(dev).expand(N, -1).contiguous(), keys, 17, T, False)
    return tok.cpu(), lp.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("T", TEMPS)
def test_gpu_draws_follow_softmax_at_the_temperature(T):
    from logitless.rollout import SamplingOptions

    check_distribution(SamplingOptions(temperature=T), *_gpu_draws(T))


@pytest.mark.gpu
def test_gpu_chi_square_check_fails_for_draws_at_another_temperature():
    from logitless.rollout import SamplingOptions

    hot, _ = _gpu_draws(1.7)
    with pytest.raises(AssertionError, match=r"^\("):
        check_distribution(SamplingOptions(temperature=1.0), hot, torch.log_softmax(LOGITS.double(), -1)[hot])


if __name__ == "__main__":  # the TRITON_INTERPRET=1 subprocess of `cases`
    import json

    print(json.dumps(_run_cases()))
