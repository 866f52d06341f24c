"""The chunked token-logprob op where tests/test_op.py did not look (mutants of `ops/chunked.py` it let live):
temperature 2, a frozen `hidden` with a trainable head, fp64 bias gradients to fp64 precision, which backward
strategy a call picks (what it saves), and `chunked_backward` computing only the gradients asked for."""

from __future__ import annotations

import pytest
import torch

from logitless.ops import token_logprobs, token_logprobs_reference
from logitless.ops.chunked import chunked_backward, chunked_forward, default_chunk_size
from tests.test_op import _inputs as make_inputs

N, H, V, CHUNK = 13, 7, 41, 4

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(dtype=torch.float64, seed=0):
    return make_inputs(dtype, n=N, h=H, v=V, seed=seed)


def _grads(fn, hidden, weight, bias, targets, g_lp, g_ent, *, need, temperature, with_entropy, **kw):
    """(logp, entropy, grads of the inputs flagged in `need` = (hidden, weight, bias))."""
    h = hidden.clone().requires_grad_(need[0])
    w = weight.clone().requires_grad_(need[1])
    b = bias.clone().requires_grad_(need[2])
    logp, ent = fn(h, w, targets, bias=b, temperature=temperature, with_entropy=with_entropy, **kw)
    loss = (logp * g_lp.to(logp.dtype)).sum() + ((ent * g_ent.to(ent.dtype)).sum() if with_entropy else 0)
    wrt = [x for x, n in zip((h, w, b), need) if n]
    return logp.detach(), None if ent is None else ent.detach(), torch.autograd.grad(loss, wrt)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, True), (True, True, False), (False, False, True)],
                         ids=["frozen_head", "frozen_hidden", "trainable_head_frozen_bias", "bias_only"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.6])
def test_chunked_matches_the_fp64_reference_for_every_gradient_set(need, with_entropy, temperature):
    """fp64 in, fp64 out: every output and every requested gradient to 1e-12 (a fp32 buffer anywhere fails)."""
    args = _inputs()
    lp, ent, grads = _grads(token_logprobs, *args, need=need, temperature=temperature, with_entropy=with_entropy,
                            backend="chunked", chunk_size=CHUNK)
    rlp, rent, rgrads = _grads(token_logprobs_reference, *args, need=need, temperature=temperature,
                               with_entropy=with_entropy)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, rlp, rtol=1e-12, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(ent, rent, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, rgrads, strict=True):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def _saved(need, with_entropy, dtype=torch.float32):
    hidden, weight, bias, targets, _, _ = _inputs(dtype)
    h = hidden.requires_grad_(need[0])
    w = weight.requires_grad_(need[1])
    b = bias.requires_grad_(need[2])
    logp, _ = token_logprobs(h, w, targets, bias=b, with_entropy=with_entropy, backend="chunked", chunk_size=CHUNK)
    return logp.grad_fn.saved_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_frozen_head_without_entropy_saves_only_the_fp32_partial_grad(dtype):
    """The documented strategy: a frozen head (and bias) without entropy keeps one fp32 [N, H] tensor."""
    (saved,) = _saved((True, False, False), False, dtype)
    assert saved.shape == (N, H) and saved.dtype == torch.float32


@pytest.mark.parametrize("need,with_entropy", [((True, False, True), False), ((True, False, False), True),
                                               ((True, True, False), False)],
                         ids=["trainable_bias", "entropy", "trainable_head"])
def test_other_calls_recompute_in_backward(need, with_entropy):
    saved = _saved(need, with_entropy)
    assert len(saved) == 6 and saved[0].shape == (N, H) and saved[1].shape == (V, H)  # hidden, weight, ...


def test_chunked_backward_computes_only_the_gradients_asked_for():
    hidden, weight, bias, targets, g_lp, g_ent = _inputs()
    _, entropy, lse = chunked_forward(hidden, weight, targets, bias, 1.0, True, CHUNK)
    args = (hidden, weight, targets, bias, 1.0, CHUNK, lse, entropy, g_lp, g_ent)
    gh, gw, gb = chunked_backward(*args, need_hidden=False, need_weight=False, need_bias=True)
    assert gh is None and gw is None and gb.shape == (V,) and gb.dtype == torch.float64
    gh, gw, gb = chunked_backward(*args, need_hidden=True, need_weight=False, need_bias=False)
    assert gw is None and gb is None and gh.shape == (N, H)
    gh2, gw, gb = chunked_backward(*args, need_hidden=False, need_weight=True, need_bias=False)
    assert gh2 is None and gb is None and gw.shape == (V, H)


def test_default_chunk_size_is_an_int():
    for v in (1, 7, 1009, 151_665, 50_000_000):
        for device in ("cpu", "cuda"):
            c = default_chunk_size(v, device)
            assert type(c) is int, (v, device, c)
    assert default_chunk_size(1_000_000) == 16 and default_chunk_size(1_100_000) == 15  # rounding only from 16 up


@pytest.mark.parametrize("need", [(True, False, False), (True, True, True)], ids=["frozen_head", "trainable_head"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "entropy"])
def test_a_callers_autocast_does_not_round_the_ops_gemms(need, with_entropy):
    """bf16 inputs under torch.autocast (the trainer's LoRA forwards, model.lora_compute=autocast): the same outputs
    and gradients, bit for bit, as without it. Autocast used to run the fp32 GEMMs in bf16 (logp 0.05 nats off)."""
    args = _inputs(torch.bfloat16)
    kw = dict(need=need, temperature=0.7, with_entropy=with_entropy, backend="chunked", chunk_size=CHUNK)
    plain = _grads(token_logprobs, *args, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _grads(token_logprobs, *args, **kw)
    assert torch.equal(plain[0], cast[0]) and (not with_entropy or torch.equal(plain[1], cast[1]))
    assert all(torch.equal(a, b) for a, b in zip(plain[2], cast[2], strict=True))
