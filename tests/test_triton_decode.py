"""The flash-decoding kernel (`logitless.ops.triton_decode`, rollout.decode_attention=triton).

CPU, under TRITON_INTERPRET=1 (`tests/interpret.py`): against the fp64 oracle on odd shapes (group sizes 1-7, head
dims that are not powers of 2, cache lengths across block and chunk edges), left-padding, sliding-window and no
masks, one chunk and several (chunks with no visible slot included), strided cache views (a length bucket of a
longer cache), slots outside the mask's visible span never read (NaN there leaves the output finite); the oracle
itself against the matmul path it replaces. In fp32 only: Triton 3.6's interpreter multiplies bf16 operands of
`tl.dot` as their raw bits (a 16 x 16 bf16 dot is off by 1e10 there), so bf16 is checked on the GPU. "auto" picks
the kernel only for bf16 weights on a CUDA GPU of compute capability 8.0+ with triton. Refusals: the kernel off
CUDA, without triton, for fp32 weights, and off the static backend; an unknown value. GPU (`python -m pytest -m gpu
tests/test_triton_decode.py`): bf16 at the 1.5B shape against the matmul path, and no [g, L] score buffer (the extra
memory is the output's, or the split partials').
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.interpret import patch_interpreter, run_cases

pytest.importorskip("triton")


def _masks(kind: str, B: int, L: int, g: torch.Generator) -> torch.Tensor | None:
    """[B, L] bool: left padding (rows start at random slots), a sliding window of 17 before the last slot, or
    random holes; the last slot (the current token) is always visible."""
    if kind == "none":
        return None
    pos = torch.arange(L)
    if kind == "left_pad":
        start = torch.randint(0, L - 1, (B, 1), generator=g)
        return pos[None, :] >= start
    if kind == "window":
        return (pos[None, :] > L - 1 - 17).expand(B, L).clone()
    m = torch.rand(B, L, generator=g) > 0.4
    m[:, -1] = True
    return m


def _run_cases() -> dict:
    """Executed inside the TRITON_INTERPRET=1 subprocess; returns {case: metrics}."""
    patch_interpreter()
    from logitless.ops.triton_decode import decode_attention, decode_attention_reference
    from logitless.rollout.attention import _matmul_attention

    def case(B, KV, G, D, L, mask_kind, splits, *, spare=9, seed=0, block_scan=None):  # fp32 (see the docstring)
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, KV, G, D, generator=g)
        kc = torch.randn(B, KV, L + spare, D, generator=g)  # a longer cache: the kernel reads a view
        vc = torch.randn(B, KV, L + spare, D, generator=g)
        k, v = kc[:, :, :L], vc[:, :, :L]
        mask = _masks(mask_kind, B, L, g)
        scale = D**-0.5
        got = decode_attention(q, k, v, mask, scale, splits=splits, block_scan=block_scan)
        ref = decode_attention_reference(q.double(), k.double(), v.double(), mask, scale)
        err = ((got.double() - ref).norm() / ref.norm()).item()
        return {"rel": err, "dtype_ok": got.dtype == torch.float32, "shape_ok": tuple(got.shape) == (B, KV, G, D),
                "finite": bool(torch.isfinite(got).all())}

    res = {
        "gqa6_left_pad_one_chunk": case(3, 2, 6, 32, 70, "left_pad", 1),
        "gqa6_left_pad_chunks": case(3, 2, 6, 32, 200, "left_pad", 3),
        "gqa7_head_dim_24_holes": case(2, 3, 7, 24, 130, "holes", 2),
        "mha_g1_short": case(2, 4, 1, 16, 5, "none", 1),
        "window_chunks": case(2, 2, 4, 32, 257, "window", 4),  # the first chunks see nothing at all
        "head_dim_80_odd_length": case(2, 2, 2, 80, 65, "left_pad", 1),
        "auto_splits": case(1, 1, 6, 32, 300, "holes", None),
        # the span scan over several steps (a chunk longer than its scan block), with holes and a window
        "scan_steps_holes": case(2, 2, 6, 32, 200, "holes", 2, block_scan=16),
        "scan_steps_window": case(2, 2, 4, 32, 257, "window", 1, block_scan=32),
    }
    def unseen(splits, block_scan=None):
        """Slots outside the visible span [150, 231) (a window's past; a static cache's unfilled tail) hold NaN: a
        kernel that reads them, even to multiply them by a probability of 0, returns NaN. The blocks that hold the
        span's ends are read (and masked), so only the slots outside those blocks are poisoned."""
        g = torch.Generator().manual_seed(2)
        B, KV, G, D, L = 2, 2, 4, 32, 300
        q = torch.randn(B, KV, G, D, generator=g)
        k, v = torch.randn(B, KV, L, D, generator=g), torch.randn(B, KV, L, D, generator=g)
        pos = torch.arange(L)
        mask = ((pos >= 150) & (pos < 231))[None, :].expand(B, L).clone()
        ref = decode_attention_reference(q.double(), k.double(), v.double(), mask, D**-0.5)
        for t in (k, v):
            t[:, :, :128] = float("nan")  # before the block of slot 150 (blocks of 64)
            t[:, :, 231:] = float("nan")  # the block of slot 230 loads nothing past it
        got = decode_attention(q, k, v, mask, D**-0.5, splits=splits, block_scan=block_scan)
        return {"rel": ((got.double() - ref).norm() / ref.norm()).item(), "dtype_ok": got.dtype == torch.float32,
                "shape_ok": tuple(got.shape) == (B, KV, G, D), "finite": bool(torch.isfinite(got).all())}

    res["unseen_slots_not_read_one_chunk"] = unseen(1)
    res["unseen_slots_not_read_chunks"] = unseen(3)  # chunks [0, 128) and [256, 300) see nothing
    res["unseen_slots_not_read_scan_steps"] = unseen(1, block_scan=64)
    # the oracle is what the engine computed before: the matmul path with a [B, 1, 1, L] bool mask
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 3, 16, generator=g)
    k = torch.randn(2, 2, 40, 16, generator=g)
    v = torch.randn(2, 2, 40, 16, generator=g)
    mask = _masks("left_pad", 2, 40, g)
    a = _matmul_attention(q.double(), k.double(), v.double(), mask[:, None, None, :], 0.25)
    b = decode_attention_reference(q.double(), k.double(), v.double(), mask, 0.25)
    res["oracle_is_the_matmul_path"] = {"rel": ((a - b).norm() / b.norm()).item()}
    return res


@pytest.fixture(scope="module")
def cases() -> dict:
    return run_cases(__file__)


FP32 = ["gqa6_left_pad_one_chunk", "gqa6_left_pad_chunks", "gqa7_head_dim_24_holes", "mha_g1_short",
        "window_chunks", "head_dim_80_odd_length", "auto_splits", "unseen_slots_not_read_one_chunk",
        "unseen_slots_not_read_chunks", "scan_steps_holes", "scan_steps_window", "unseen_slots_not_read_scan_steps"]


@pytest.mark.parametrize("name", FP32)
def test_kernel_matches_the_fp64_oracle(cases, name):
    c = cases[name]
    assert c["rel"] < 1e-5 and c["dtype_ok"] and c["shape_ok"] and c["finite"], c


def test_oracle_is_the_matmul_path_it_replaces(cases):
    assert cases["oracle_is_the_matmul_path"]["rel"] < 1e-12


def test_a_rollout_off_cuda_refuses_the_kernel(tiny_qwen2_model, gpt2_tokenizer):
    from logitless.rollout.static import StaticEngine

    if torch.cuda.is_available():
        pytest.skip("the model here is on the CPU, but the check reads where the rollout decodes")
    with pytest.raises(ValueError, match=r"rollout\.decode_attention=triton runs a Triton kernel on a CUDA GPU, "
                                         r"but the rollout decodes on cpu; set rollout\.decode_attention=matmul"):
        StaticEngine(tiny_qwen2_model, gpt2_tokenizer, decode_attention="triton")
    with pytest.raises(ValueError, match=r"rollout\.decode_attention='flash': use one of"):
        StaticEngine(tiny_qwen2_model, gpt2_tokenizer, decode_attention="flash")


def test_auto_takes_the_kernel_only_for_bf16_on_a_cuda_gpu_with_triton_and_triton_refuses_fp32():
    from logitless.rollout.static import resolve_decode_attention as pick

    cuda, cpu, bf16, fp32 = torch.device("cuda", 1), torch.device("cpu"), torch.bfloat16, torch.float32
    assert pick("auto", cuda, bf16, True, (9, 0)) == "triton"  # where it was measured faster
    assert pick("auto", cuda, bf16, True, (8, 0)) == "triton"
    off = [(cpu, bf16, True), (cuda, fp32, True, (9, 0)), (cuda, bf16, False, (9, 0)),
           (cuda, torch.float16, True, (9, 0)), (cuda, bf16, True, (7, 5))]  # CPU, fp32, no triton, fp16, Turing
    assert [pick("auto", *a) for a in off] == ["matmul"] * 5
    assert pick("matmul", cuda, bf16, True) == "matmul" and pick("triton", cuda, torch.float16, True) == "triton"
    assert pick("sdpa", cpu, fp32, False) == "sdpa"  # torch's own kernel: anywhere
    with pytest.raises(ValueError, match=r"rollout\.decode_attention=triton computes scores with bf16/fp16 "
                                         r"tensor-core dots, but the rollout decodes in torch\.float32; set "
                                         r"rollout\.decode_attention=matmul \(or auto\), or load the model in bf16"):
        pick("triton", cuda, fp32, True)
    with pytest.raises(ValueError, match=r"decodes on cuda:1 without the triton package"):
        pick("triton", cuda, bf16, False)


def test_an_engine_on_cpu_resolves_auto_to_the_matmul_path(tiny_qwen2_model, gpt2_tokenizer):
    from logitless.rollout.static import StaticEngine

    if torch.cuda.is_available():
        pytest.skip("the model here is on the CPU")
    assert StaticEngine(tiny_qwen2_model, gpt2_tokenizer).decode_attention == "matmul"


def test_the_option_needs_the_static_backend():
    from logitless.trainer.config.schema import load_train_config

    with pytest.raises(ValueError, match=r"rollout\.decode_attention='triton' needs rollout\.backend=static"):
        load_train_config(None, ["rollout.backend=hf", "rollout.decode_attention=triton"])
    with pytest.raises(ValueError, match=r"rollout\.decode_attention"):
        load_train_config(None, ["rollout.backend=static", "rollout.decode_attention=flash"])
    assert load_train_config(None, []).rollout.decode_attention == "auto"  # any backend: only static reads it


@pytest.mark.gpu
@pytest.mark.parametrize("rows, length", [(128, 640), (16, 1536), (512, 384)])
def test_gpu_bf16_at_the_1_5b_shape_matches_the_matmul_path_without_a_score_buffer(rows, length):
    from logitless.ops.triton_decode import decode_attention, decode_attention_reference, num_splits, set_sm_count
    from logitless.rollout.attention import _matmul_attention

    dev = torch.device("cuda")
    set_sm_count(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    KV, G, D = 2, 6, 128  # Qwen2.5-1.5B: 12 query heads over 2 KV heads
    q = torch.randn(rows, KV, G, D, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(rows, KV, length + 128, D, device=dev, generator=g, dtype=torch.bfloat16)[:, :, :length]
    v = torch.randn(rows, KV, length + 128, D, device=dev, generator=g, dtype=torch.bfloat16)[:, :, :length]
    mask = _masks("left_pad", rows, length, torch.Generator().manual_seed(0)).to(dev)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), mask, D**-0.5)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = decode_attention(q, k, v, mask, D**-0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    dense = _matmul_attention(q, k, v, mask[:, None, None, :], D**-0.5)
    err = lambda x: float((x.double() - ref).norm() / ref.norm())  # noqa: E731
    assert err(got) <= 1.5 * err(dense) + 1e-3, (err(got), err(dense))
    splits = num_splits(rows * KV, length)
    out_bytes = got.numel() * 2
    partials = (rows * KV * splits * G * (D + 2) * 4) * 2 if splits > 1 else 0  # fp32 partials and the combine
    assert extra <= out_bytes + partials + (1 << 20), (extra, out_bytes, partials)
    if splits == 1:  # a [g, L] fp32 score buffer would not fit the bound
        assert rows * KV * G * length * 4 > out_bytes + (1 << 20)


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
