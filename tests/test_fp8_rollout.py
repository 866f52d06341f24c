"""FP8 rollouts (rollout.fp8, logitless/rollout/fp8.py): e4m3 weights with per-output-channel scales and per-token
activation scales in the decode's projections.

CPU: the quantization against an independent fp64 oracle of e4m3 rounding; the FP8 layer's output is exactly the
emulated formula; a tiny model's FP8 rollout (static engine) samples the FP8 model's logprobs, which differ from the
fp32 trainer's by a measured amount that is nonzero and within a bound derived from the rounding of every projection
(`quantization_sigma`: each rounding error an independent uniform, propagated to first order by the model's own
gradients); every weight source requantizes at its sync after an optimizer step (a stale copy fails);
a 2-step run logs rollout/mismatch_* with the IS correction on; the memory plan counts the FP8 copy and replica at
their size; the refusals name rollout.fp8.
GPU (`python -m pytest -m gpu tests/test_fp8_rollout.py`, Hopper or Ada): torch._scaled_mm against the emulation on
the same inputs, and the FP8 sampler's mean |Δ logp| against the bf16 trainer within the same bound.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.fp8 import (FP8, Fp8Linear, Fp8Weights, fp8_layers, fp8_unsupported, is_projection, quantize,
                                   to_fp8)
from logitless.rollout.weights import LiveWeights, MergedLoraWeights, lora_layers
from logitless.trainer.config.schema import load_train_config
from logitless.trainer.distributed.parallel import MergedRolloutCopy, RolloutCopy
from logitless.trainer.memory.auto import resolve
from logitless.trainer import preflight
from logitless.trainer.preflight import check_fp8
from tests.test_rollout_families import TOK, make_model
from tests.test_rollout_weights import lora_model, perturb
from tests.test_trainer import _cfg, _train, rewards_module, tok  # noqa: F401 (fixtures)

PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is"]
OPTS = SamplingOptions(num_generations=2, temperature=0.8, max_new_tokens=10, seed=3, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- the oracle (fp64)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """`v` (fp64, |v| <= 448) rounded to the nearest e4m3fn value, ties to even: 3 mantissa bits above 2^-6, steps of
    2^-9 below it (subnormals). Independent of torch's float8 cast."""
    a = v.abs()
    exponent = torch.floor(torch.log2(a.clamp(min=2.0**-6))).clamp(min=-6)
    step = 2.0 ** (exponent - 3)
    return torch.round(v / step) * step  # torch.round: half to even


def oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quantized values x_q, scales s, x_q / s distance to the nearest rounding midpoint) of `x`'s rows in fp64:
    s = max |x| / 448 (1 for a zero row), x_q = e4m3(x / s)."""
    x = x.double()
    amax = x.abs().amax(-1)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    v = (x / s[..., None]).clamp(-448.0, 448.0)
    q = e4m3_round(v)
    step = 2.0 ** (torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))).clamp(min=-6) - 3)
    midpoint = ((v / step) - torch.floor(v / step) - 0.5).abs() * step  # 0 at a tie
    return q, s, midpoint


def rounding_bound(t: torch.Tensor) -> torch.Tensor:
    """|e4m3 rounding error| of each element of `t` (fp64) at its row's scale s: half a unit in the last place, at
    most 2^-4 |t| for the normal range and 2^-10 s for subnormals (fp32's rounding of t / s on top: 1e-6)."""
    s = t.abs().amax(-1, keepdim=True) / 448.0
    return torch.maximum(t.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)


def product_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of |Q(x) Q(W)ᵀ - x Wᵀ| [..., out] for x [..., in], W [out, in] (fp64): from
    Q(x)_k Q(w)_k - x_k w_k = e_x w + x e_w + e_x e_w."""
    x, w = x.double(), w.double()
    ex, ew = rounding_bound(x), rounding_bound(w)
    return ex @ w.abs().t() + x.abs() @ ew.t() + ex @ ew.t()


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The e4m3 unit in the last place of each element of `t` (fp64) at its row's scale s: 2^(⌊log2 |t/s|⌋ - 3) s in
    the normal range, 2^-9 s for subnormals."""
    s = t.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    exponent = torch.floor(torch.log2((t / s).abs().clamp(min=2.0**-6))).clamp(min=-6)
    return 2.0 ** (exponent - 3) * s


def quantization_sigma(model: nn.Module, b, temperature: float) -> torch.Tensor:
    """[B, T] the standard deviation that FP8 rounding gives each completion token's logprob of batch `b` under
    `model` (fp32), to first order: Δ logp_t = Σ over projections l of <∂logp_t / ∂y_l, δ_l>, δ_l = Q(x)Q(W)ᵀ - xWᵀ =
    E_x Wᵀ + x E_wᵀ (+ E_x E_wᵀ, second order), with every rounding error an independent uniform of variance ulp²/12
    (`ulp`). The weight errors are shared by all positions, so their term is <∂logp_t / ∂W_l, E_w>, ∂logp_t / ∂W_l =
    Σ_positions g xᵀ; each activation's error is its own: Σ (g W)² ulp_x² / 12. The derivatives g (through every later
    layer) come from a zero probe added to each projection's output."""
    probes, seen = [], []

    def hook(module, inputs, output):
        seen.append((inputs[0].detach().double(), module.weight.detach().double()))
        probe = torch.zeros_like(output, requires_grad=True)
        probes.append(probe)
        return output + probe

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if type(m) is nn.Linear and is_projection(n)]
    try:
        with torch.enable_grad():
            logp, _ = completion_logprobs(model, *_inputs(model, b), temperature=temperature)
            var_x = [ulp(x) ** 2 / 12 for x, _ in seen]
            var_w = [ulp(w) ** 2 / 12 for _, w in seen]
            out = torch.zeros(logp.shape, dtype=torch.float64)
            for i, j in b.completion_mask.nonzero().tolist():
                grads = torch.autograd.grad(logp[i, j], probes, retain_graph=True)
                for g, (x, w), vx, vw in zip(grads, seen, var_x, var_w):
                    g = g.double()
                    out[i, j] += float((torch.einsum("...o,...i->oi", g, x) ** 2 * vw).sum())
                    out[i, j] += float(((g @ w) ** 2 * vx).sum())
    finally:
        for h in handles:
            h.remove()
    assert probes, "no projection was probed"
    return out.sqrt().cpu()


def _inputs(model: nn.Module, b) -> list[torch.Tensor]:
    """The batch's prompt and completion ids and masks on `model`'s device."""
    device = next(model.parameters()).device
    return [t.to(device) for t in (b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)]


def logprobs(model: nn.Module, b, temperature: float = OPTS.temperature) -> torch.Tensor:
    """[B, T] fp64 on the host: the trainer's logprobs of the batch's completions under `model`."""
    with torch.no_grad():
        return completion_logprobs(model, *_inputs(model, b), temperature=temperature)[0].double().cpu()


# --------------------------------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (5, 33), (4, 3, 24)])
def test_quantization_matches_an_fp64_oracle(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])  # normal and subnormal e4m3 ranges
    x = x[..., torch.randperm(shape[-1], generator=g)]
    x.reshape(-1, shape[-1])[0] = 0.0  # an all-zero row: scale 1, quantized to zeros
    if shape[-1] > 2:
        x.reshape(-1, shape[-1])[-1, :2] = torch.tensor([448.0 * 3, -448.0 * 3])  # its amax at both signs
    q, s = quantize(x)
    q64, s64, midpoint = oracle(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == x.shape and s.shape == x.shape[:-1]
    assert torch.equal(s, s64.float())  # amax / 448, rounded once to fp32
    assert torch.equal(q.reshape(-1, shape[-1])[0].double(), torch.zeros(shape[-1], dtype=torch.float64))
    differ = q.double() != q64
    # fp32's x / s may fall on the other side of a rounding midpoint than fp64's: only right at one
    assert (midpoint[differ] < 1e-6 * q64[differ].abs().clamp(min=1.0)).all(), int(differ.sum())
    deq = q.double() * s.double()[..., None]
    assert ((deq - x.double()).abs() <= rounding_bound(x.double())).all()
    assert (q.double().abs() <= 448.0).all()


def test_weight_scales_are_per_output_channel_and_activation_scales_per_token():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-896.0, 1.0, 3.0]])
    _, s = quantize(w)
    assert torch.equal(s, torch.tensor([2.0 / 448, 1.0, 896.0 / 448], dtype=torch.float32))  # per output row
    x = torch.tensor([[[3.0, -4.0], [1e-3, 0.0]]])
    _, sx = quantize(x)
    assert sx.shape == (1, 2) and torch.equal(sx, torch.tensor([[4.0, 1e-3]]) / 448)  # per token


class Block(nn.Module):
    """A stand-in decoder block: projections named as the families name them (odd sizes, biases)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(24, n, bias=True, dtype=dtype) for n in (40, 8, 8))
        self.o_proj = nn.Linear(40, 24, bias=False, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.q_proj.weight[3] = 0.0  # a zero output row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x)) + self.k_proj(x).sum(-1, keepdim=True) * self.v_proj(x).mean(-1, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_linear_computes_the_emulated_formula_exactly(dtype):
    block = Block(dtype)
    x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    plain = {n: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for n, m in block.named_children()}
    layers = to_fp8(block)
    assert len(layers) == 4 and all(isinstance(getattr(block, n), Fp8Linear) for n in plain)
    for name, (w, bias) in plain.items():
        layer = getattr(block, name)
        inp = x if name != "o_proj" else torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
        # the formula, written out: per-token and per-channel scales, e4m3 values, fp32 product, one rounding
        xs = inp.float().abs().amax(-1) / 448
        xq = (inp.float() / xs[..., None]).clamp(-448, 448).to(FP8).float()
        ws = w.float().abs().amax(-1)
        ws = torch.where(ws > 0, ws / 448, torch.ones_like(ws))
        wq = (w.float() / ws[:, None]).clamp(-448, 448).to(FP8).float()
        want = ((xq.reshape(-1, inp.shape[-1]) @ wq.t()) * xs.reshape(-1, 1) * ws[None, :]).to(dtype)
        want = want.reshape(*inp.shape[:-1], -1) + (bias if bias is not None else 0)
        got = layer(inp)
        assert got.dtype == dtype and torch.equal(got, want), name
        # and within the quantization error of the exact product (the check can fail: it is not 0)
        exact = inp.double() @ w.double().t()
        err = (got.double() - (bias.double() if bias is not None else 0) - exact).abs()
        slack = exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 1e-6) + 1e-5
        assert (err <= product_error_bound(inp, w) + slack).all() and err.max() > 0, name


def test_a_fused_fp8_group_computes_what_its_members_compute():
    from logitless.rollout.fused import SlicedLinear

    block, fused = Block(torch.float32), Block(torch.float32)
    assert all(len(layer.sizes) == 1 for layer in to_fp8(block))  # no group without fuse
    groups = [layer for layer in to_fp8(fused, fuse=True) if len(layer.sizes) > 1]
    assert len(groups) == 1 and groups[0].sizes == [40, 8, 8] and isinstance(fused.q_proj, SlicedLinear)
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(4))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(fused, name)(x), getattr(block, name)(x)), name  # per-row scales: the same rows
    assert torch.equal(fused(x), block(x))


# --------------------------------------------------------------------------------------------- decode and sync


def test_fp8_rollout_samples_the_fp8_models_logprobs_within_the_quantization_bound(one_thread):
    model = make_model("llama")  # fp32: the trainer
    weights = Fp8Weights(LiveWeights(model))
    assert weights.extra_bytes == sum(m.qweight.numel() + 4 * m.qweight.shape[0] for m in fp8_layers(weights.module))
    b = make_engine("static", model, TOK, check_every=4, weights=weights).generate(PROMPTS, OPTS)
    mask = b.completion_mask.bool()
    sampler = b.sampler_logp.double()
    fp8_model = logprobs(weights.module, b)  # the FP8 model teacher-forced: what the sampler is
    trainer = logprobs(model, b)
    engine_gap = (sampler - fp8_model)[mask].abs()
    assert engine_gap.max() < 1e-4
    gap = (sampler - trainer)[mask].abs()
    sigma = quantization_sigma(model, b, OPTS.temperature)[mask]
    expected = sigma.mean() * (2 / math.pi) ** 0.5  # E|Δ| of a normal Δ of standard deviation σ
    print(f"\nFP8 sampler vs fp32 trainer: mean |Δ logp| {gap.mean():.4f} (max {gap.max():.4f}); expected from the "
          f"rounding {expected:.4f}, bound {1.5 * expected:.4f}; max |Δ| / σ {(gap / sigma).max():.2f}; engine vs "
          f"teacher-forced FP8 model: max {engine_gap.max():.2e}")
    assert gap.mean() > 100 * engine_gap.max()  # nonzero: the FP8 rounding, not the engine's own
    assert gap.mean() <= 1.5 * expected  # the mean gap is the rounding's
    assert (gap <= 5 * sigma + engine_gap).all()  # and so is every token's


def _quantized_from(layers: list[Fp8Linear], sources: list[torch.Tensor]) -> bool:
    """Whether each FP8 layer holds exactly the quantization of its source weight now."""
    for layer, w in zip(layers, sources):
        q, s = quantize(w)
        if not (torch.equal(layer.qweight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, s)):
            return False
    return True


def _optimizer_step(model: nn.Module, b) -> None:
    """One AdamW step on the trainable parameters, the gradient of the batch's mean completion logprob."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    logp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                  temperature=OPTS.temperature)
    (-(logp * b.completion_mask).sum() / b.completion_mask.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_each_sync_after_an_optimizer_step_requantizes_the_full_model_copy(one_thread):
    model = make_model("llama").requires_grad_(True)
    weights = Fp8Weights(LiveWeights(model), fuse=False)
    engine = make_engine("static", model, TOK, check_every=4, weights=weights)
    sources = [w for layer in weights.layers for w in layer._sources]
    before = engine.generate(PROMPTS, OPTS)
    old = [layer.qweight.detach().clone() for layer in weights.layers]
    _optimizer_step(model, before)
    assert not _quantized_from(weights.layers, sources)  # stale until the next sync: the check can fail
    after = engine.generate(PROMPTS, OPTS)  # syncs first
    assert _quantized_from(weights.layers, sources)
    assert all(not torch.equal(o.view(torch.uint8), layer.qweight.view(torch.uint8))
               for o, layer in zip(old, weights.layers))
    torch.testing.assert_close(after.sampler_logp.double(), logprobs(weights.module, after), atol=1e-4, rtol=0)


def test_the_merged_lora_copy_requantizes_w_plus_delta_and_leaves_the_base_as_it_was(one_thread):
    model = lora_model("llama")
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    weights = Fp8Weights(MergedLoraWeights(model, "in_place"), fuse=True)
    assert weights.groups  # q/k/v, gate/up
    engine = make_engine("static", model, TOK, check_every=4, weights=weights)
    for step in range(2):
        b = engine.generate(PROMPTS, OPTS)
        merged = MergedLoraWeights(model, "resident")  # W + ΔW of the adapters now, as the trainer has them
        for (name, _), (_, w) in zip(lora_layers(model), merged._pairs):
            path = name.removeprefix("base_model.model.")
            parent, attr = path.rsplit(".", 1)
            member = weights.module.get_submodule(parent).get_submodule(attr)
            group, start = (member.group, member.start) if hasattr(member, "group") else (member, 0)
            q, s = quantize(w)
            rows = slice(start, start + w.shape[0])
            assert torch.equal(group.qweight[rows].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(group.weight_scale[rows], s), name
        torch.testing.assert_close(b.sampler_logp.double(), logprobs(weights.module, b), atol=1e-4, rtol=0)
        perturb(model, step + 1)  # an adapter update: the next generate requantizes
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n  # the merge was written back after each quantization


@pytest.mark.parametrize("kind", ["full", "merged"])
def test_an_fp8_replica_quantizes_each_sync_as_it_writes(kind, one_thread):
    """The replicas of torchrun / rollout.device (here of an unsharded model, as one rank sees it): FP8 projections,
    rewritten from the trainer's weights (merged LoRA: W + ΔW) at every sync; a stale replica fails."""
    model = make_model("llama").requires_grad_(True) if kind == "full" else lora_model("llama")
    make = RolloutCopy if kind == "full" else MergedRolloutCopy
    replica = make(model, fuse=True, fp8=True)
    assert replica.groups and fp8_layers(replica.model)
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    layers = fp8_layers(replica.model)
    projections = sum(layer.qweight.numel() for layer in layers)
    # the projections take 1 byte a weight and a scale a row instead of 4 bytes (fp32 here) a weight
    assert size(make(model, fuse=True).model) - size(replica.model) == \
        3 * projections - sum(4 * layer.weight_scale.numel() for layer in layers)

    def expected() -> dict[str, torch.Tensor]:
        if kind == "full":
            return {n: p.detach() for n, p in model.named_parameters() if is_projection(n.rsplit(".", 1)[0])}
        pairs = MergedLoraWeights(model, "resident")._pairs
        return {f"{n.removeprefix('base_model.model.')}.weight": w for (n, _), (_, w) in zip(lora_layers(model), pairs)}

    def holds(want: dict[str, torch.Tensor]) -> bool:
        for name, w in want.items():
            member = replica.model.get_submodule(name.rsplit(".", 1)[0])
            group, start = (member.group, member.start) if hasattr(member, "group") else (member, 0)
            q, s = quantize(w)
            rows = slice(start, start + w.shape[0])
            if not (torch.equal(group.qweight[rows].view(torch.uint8), q.view(torch.uint8))
                    and torch.equal(group.weight_scale[rows], s)):
                return False
        return True

    replica.sync(model)
    assert holds(expected())
    engine = make_engine("static", replica.model, TOK, check_every=4)
    b = engine.generate(PROMPTS, OPTS)
    if kind == "full":
        _optimizer_step(model, b)
    else:
        perturb(model, 9)
    assert not holds(expected())  # stale until synced
    replica.sync(model)
    assert holds(expected())


def test_a_two_step_run_logs_the_mismatch_with_the_is_correction_on(tmp_path, tok, rewards_module):  # noqa: F811
    cfg = _cfg(tmp_path / "run", "rollout.backend=static", "rollout.fp8=true", "train.max_steps=2")
    result = _train(cfg, tok)
    assert len(result.records) == 2
    resolved = json.loads((tmp_path / "run" / "resolved.json").read_text())
    choice = next(c for c in resolved["choices"] if c["key"] == "objective.sampler_is_mode")
    assert choice["value"] == "token_truncate" and choice["auto"] and "rollout.fp8" in choice["reason"]
    for r in result.records:
        # the FP8 sampler's logprobs against the trainer's: the same run without rollout.fp8 measured 1.8e-7 and
        # 3.0e-7 (fp32 on the CPU), with it 6.9e-4 and 1.4e-3
        assert r["rollout/mismatch_mean"] > 1e-5 and r["rollout/mismatch_max"] >= r["rollout/mismatch_mean"]
        assert r["rollout/mismatch_kl"] >= 0
        # the IS correction ran, against the same sampler logprobs, its weights clamped at sampler_is_clip_max
        assert r["is/logp_diff"] == pytest.approx(r["rollout/mismatch_mean"], rel=1e-4)
        assert 0 < r["is/ratio/min"] <= 1 <= r["is/ratio/max"] <= 3.0
        assert r["rollout/weights_copy_gib"] > 0  # the FP8 copy
    print(f"\n2-step run: rollout/mismatch_mean {[round(r['rollout/mismatch_mean'], 4) for r in result.records]}")


# ------------------------------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize("lora", [False, True])
def test_the_memory_plan_counts_the_fp8_copy_and_replica_at_their_size(lora):
    """The plan's FP8 sizes are the bytes the copy and the replicas hold (bf16, odd sizes): on one process the
    rollout's copy replaces the merged copy in the generate phase; a replica counts its projections at 1 byte a
    weight and a scale a row, its LoRA-targeted part sleeping."""
    from logitless.trainer.memory import plan as mp
    from logitless.trainer.memory import ranks as mr
    from logitless.trainer.memory.model import model_memory
    from tests.conftest import tiny_qwen2

    model = tiny_qwen2(vocab_size=1000, hidden=48, layers=3, tie=False).to(torch.bfloat16)
    cfg = load_train_config(None, [f"model.lora={str(lora).lower()}", "model.lora_r=4",
                                   "model.lora_target_modules=[q_proj,v_proj,down_proj]"])
    m = model_memory(model, cfg.model, torch.bfloat16)
    copy = Fp8Weights(LiveWeights(model))
    assert m.fp8_bytes == copy.extra_bytes > 0
    projections = [mod for n, mod in model.named_modules() if type(mod) is nn.Linear and is_projection(n)]
    assert m.fp8_source_bytes == sum(2 * mod.weight.numel() for mod in projections)
    replica = RolloutCopy(model, fp8=True)
    held = sum(p.numel() * p.element_size() for p in replica.model.parameters())
    ranks = mr.Ranks(2, mr.units_of(model), weight_copy="resident", fp8=True)
    assert mr._replica_bytes(m, ranks) == held < m.weight_bytes
    step = mp.StepShape(prompts=2, rows=8, prompt_len=20, completion_len=30)
    knobs = mp.Knobs(micro_batch_size=4, by_rows=True)
    generate = mp.generate_bytes(m, step, mp.RunFacts(fp8=True, decode_copy=lora), knobs)
    assert generate["decode copy"] == m.fp8_bytes
    if lora:  # a merged replica that sleeps keeps its frozen FP8 projections (and the rest) mapped
        targeted = [mod for n, mod in model.named_modules() if n.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "down_proj")]
        assert m.fp8_merge_bytes == sum(mod.weight.numel() + 4 * mod.out_features for mod in targeted)
        sleeping = mr.Ranks(2, mr.units_of(model), weight_copy="sleep", fp8=True)
        assert mr._replica_mapped(m, mp.RunFacts(), sleeping) == held - m.fp8_merge_bytes


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides, match", [
    (["rollout.backend=hf"], r"rollout\.fp8=True needs rollout\.backend=static \(got 'hf'\): set rollout\.backend="
                             r"static or unset rollout\.fp8"),
    (["rollout.backend=continuous"], r"rollout\.fp8=True needs rollout\.backend=static"),
    (["rollout.tensor_parallel=2"], r"rollout\.fp8=true .* rollout\.tensor_parallel=2 .*set rollout\.tensor_parallel=1"
                                    r".* or rollout\.fp8=false"),
    (["rollout.weight_copy=in_place"], r"rollout\.weight_copy=in_place .*rollout\.fp8=true .*set rollout\.weight_copy="
                                       r"sleep or resident"),
])
def test_settings_fp8_cannot_run_with_are_refused_by_the_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_train_config(None, ["rollout.fp8=true", *overrides])


def test_a_cuda_gpu_without_fp8_is_refused_before_the_model_loads(monkeypatch):
    cfg = load_train_config(None, ["rollout.fp8=true"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"rollout\.fp8=true cannot run here: NVIDIA A100-SXM4-80GB has compute "
                                         r"capability 8\.0, .*8\.9 or newer .*set rollout\.fp8=false"):
        check_fp8(cfg, torch.device("cuda", 0))
    check_fp8(load_train_config(None, []), torch.device("cuda", 0))  # off: nothing to check
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8(cfg, torch.device("cuda", 0))  # Hopper
    check_fp8(cfg, torch.device("cpu"))  # emulated
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(preflight, "resolve_device", lambda name: torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"rollout\.fp8=true cannot run here"):
        preflight.check_cuda_settings(cfg)  # what `logitless train` checks before the model loads
    preflight.check_cuda_settings(cfg, training=False)  # `logitless eval` decodes in the model's dtype
    assert "mps" in fp8_unsupported(torch.device("mps"))


def test_unmerged_lora_adapters_are_refused_naming_the_setting():
    model = lora_model("llama")
    with pytest.raises(ValueError, match=r"rollout\.fp8=true .*unmerged LoRA .*unset rollout\.merge_lora"):
        Fp8Weights(LiveWeights(model))
    with pytest.raises(ValueError, match=r"rollout\.fp8=true .*unmerged .*unset rollout\.merge_lora"):
        RolloutCopy(model, fp8=True)


@pytest.mark.parametrize("given, want", [(None, "token_truncate"), ("null", None), ("token_mask", "token_mask")])
def test_fp8_turns_the_is_correction_on_unless_the_config_chooses(given, want):
    extra = [] if given is None else [f"objective.sampler_is_mode={given}"]
    cfg = resolve(load_train_config(None, ["rollout.fp8=true", "model.device=cpu", *extra]),
                  device=torch.device("cpu")).cfg
    assert cfg.objective.sampler_is_mode == want
    plain = resolve(load_train_config(None, ["model.device=cpu"]), device=torch.device("cpu")).cfg
    assert plain.objective.sampler_is_mode is None  # without fp8: off, as before


# --------------------------------------------------------------------------------------------------------- GPU


def _hopper() -> bool:
    return torch.cuda.is_available() and fp8_unsupported(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_scaled_mm_matches_the_emulation_to_bf16_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(1024, 768, bias=True, dtype=torch.bfloat16, device="cuda")
    layer = to_fp8(nn.ModuleDict({"q_proj": linear}))[0]
    assert layer.hardware
    for rows in (1, 7, 256):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) * 3
        y = layer(x)
        xq, xs = quantize(x)
        emulated = (torch.ops.aten.mm(xq.float(), layer.qweight.float().t()) * xs[:, None]
                    * layer.weight_scale[None, :]).to(torch.bfloat16) + layer.bias
        diff = (y.float() - emulated.float()).abs()
        assert (diff <= 2.0**-7 * emulated.float().abs() + 1e-2).all(), float(diff.max())  # a bf16 rounding or two


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_the_fp8_sampler_tracks_the_bf16_trainer_within_the_quantization_bound():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(TOK), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
                      pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id)
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    fp32 = Qwen2ForCausalLM(cfg).to("cuda").eval()
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opts = SamplingOptions(num_generations=4, temperature=1.0, max_new_tokens=32, seed=0, ignore_eos=True)
    weights = Fp8Weights(LiveWeights(model), fuse=True)
    assert all(layer.hardware for layer in weights.layers)
    b = make_engine("static", model, TOK, weights=weights).generate(PROMPTS, opts)
    plain = make_engine("static", model, TOK).generate(PROMPTS, opts)  # the bf16 decode's own gap
    mask = b.completion_mask.bool()
    gap = (b.sampler_logp.double() - logprobs(model, b, 1.0))[mask].abs()
    bf16_gap = (plain.sampler_logp.double() - logprobs(model, plain, 1.0))[plain.completion_mask.bool()].abs()
    expected = quantization_sigma(fp32, b, 1.0)[mask].mean() * (2 / math.pi) ** 0.5
    print(f"\nFP8 sampler vs bf16 trainer: mean |Δ logp| {gap.mean():.4f} (bf16 decode {bf16_gap.mean():.4f}); "
          f"expected from the FP8 rounding {expected:.4f}")
    assert gap.mean() > bf16_gap.mean()
    assert gap.mean() <= 1.5 * expected + bf16_gap.mean()
