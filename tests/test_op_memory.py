"""The fused op never allocates or saves an [N, V] tensor, and a frozen head does no weight-gradient GEMM.

A TorchDispatchMode records every aten op's outputs during forward + backward and saved_tensors_hooks record
what autograd keeps; each detector is shown to catch the dense oracle, so a passing check means something.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from logitless.ops import token_logprobs, token_logprobs_reference

N, H, V, CHUNK = 512, 8, 301, 16  # N ≫ CHUNK, so an [N, V] tensor (154k) dwarfs a [CHUNK, V] tile (4.8k)
_GEMMS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.addmm_.default", "aten.matmul.default"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...]]] = []  # (op, shape) of every tensor produced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape)))
        return out

    def max_numel(self) -> int:
        return max((torch.Size(s).numel() for _, s in self.outputs), default=0)

    def gemm_shapes(self) -> set[tuple[int, ...]]:
        return {s for f, s in self.outputs if f in _GEMMS}


def _trace(fn, *, train_weight: bool, use_bias: bool, with_entropy: bool, grad: bool = True):
    """Runs fn forward (+ backward on both outputs) under the recorders; returns (recorder, saved numels)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).requires_grad_(grad)
    weight = torch.randn(V, H, generator=g).requires_grad_(grad and train_weight)
    bias = torch.randn(V, generator=g).requires_grad_(grad and train_weight) if use_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    saved: list[int] = []
    rec = _Recorder()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t), rec:
        logp, ent = fn(hidden, weight, targets, bias=bias, temperature=0.9, with_entropy=with_entropy)
        if grad:
            loss = logp.sum() + (ent.sum() if with_entropy else 0)
            n_fwd = len(rec.outputs)
            loss.backward()
            assert len(rec.outputs) > n_fwd + 2, "the recorder must also see the backward ops"
    return rec, saved


def _op(*args, **kw):
    return token_logprobs(*args, chunk_size=CHUNK, backend="chunked", **kw)


def test_detectors_catch_the_dense_oracle():
    rec, saved = _trace(token_logprobs_reference, train_weight=True, use_bias=True, with_entropy=True)
    assert rec.max_numel() >= N * V
    assert max(saved) >= N * V
    assert (V, H) in rec.gemm_shapes()  # the oracle computes grad_W


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "logp_only"])
@pytest.mark.parametrize("train_weight,use_bias", [(True, True), (True, False), (False, False), (False, True)],
                         ids=["trainable+bias", "trainable", "frozen", "frozen+bias"])
def test_no_n_by_v_buffer_allocated_or_saved(train_weight, use_bias, with_entropy):
    rec, saved = _trace(_op, train_weight=train_weight, use_bias=use_bias, with_entropy=with_entropy)
    biggest = max(CHUNK * V, N * H, V * H)  # a tile, the hidden-sized grads, the weight-sized grad
    assert rec.max_numel() <= biggest < N * V, sorted(rec.outputs, key=lambda o: -torch.Size(o[1]).numel())[:3]
    assert max(saved, default=0) <= max(N * H, V * H)


def test_no_grad_forward_allocates_only_tiles_and_saves_nothing():
    rec, saved = _trace(_op, train_weight=True, use_bias=True, with_entropy=True, grad=False)
    assert rec.max_numel() <= CHUNK * V
    assert saved == []


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "logp_only"])
def test_frozen_head_does_no_weight_gradient_gemm(with_entropy, use_bias):
    rec, _ = _trace(_op, train_weight=False, use_bias=use_bias, with_entropy=with_entropy)
    shapes = rec.gemm_shapes()
    assert (CHUNK, V) in shapes and (CHUNK, H) in shapes  # logits and grad_hidden GEMMs were seen
    assert (V, H) not in shapes and (H, V) not in shapes
    # Control: the same trace with a trainable head does show the grad_W GEMM.
    rec_t, _ = _trace(_op, train_weight=True, use_bias=use_bias, with_entropy=with_entropy)
    assert (V, H) in rec_t.gemm_shapes()
