"""The inductor options every torch.compile of a model's forward in logitless uses: eager bf16/fp16 numerics.

Eager PyTorch computes a bf16 op by upcasting its inputs to fp32 and rounding the result back to bf16. When inductor
fuses two such ops into one kernel it drops the rounding between them (a fused RMSNorm, RoPE, residual add or
activation keeps fp32 intermediates): the compiled model computes a slightly different function. Measured on an
H200 (bench/LOG.md, "Compiled decode = eager model"): the static engine's compiled decode drifted from the eager
trainer 1.8-9x further than the eager decode did (mean |Δ logp| 0.0018 vs 0.0010 on a random Llama, 0.0045 vs 0.0005
on GPT-OSS, where a flipped expert choice costs up to 0.26 nats); with `emulate_precision_casts` it computes what
the eager model computes, to the summation order. The sampler's job is to be the policy, so every compiled copy of
a forward (the decode step, `model.compile_layers`) keeps eager numerics.

Division too: Triton lowers fp32 `x / y` to its approximate `div.full` (up to 2 ulp), eager PyTorch divides
exactly, as `tl.math.div_rn` does (the sampler's own kernel, `ops/triton_sampling.py`). Where a quotient is rounded
to bf16 next, an ulp can move it by one bf16 step: the top-k weights that Qwen3-MoE and Mixtral renormalise by their
sum are such a quotient, the two families whose compiled decode stayed further from the trainer than the eager
decode with everything else equal (bench/LOG.md). Inductor's option for exact division is named
`eager_numerics.division_rounding` in newer PyTorch and `emulate_divison_rounding` (sic) before; whichever this
PyTorch has is set (neither: the option is left out).
"""

from __future__ import annotations

import torch._inductor.config


def _division_rounding() -> dict:
    """{inductor's key for exact fp32 division: True}, under the name this PyTorch knows (none: {})."""
    known = torch._inductor.config.get_config_copy()
    key = next((k for k in ("eager_numerics.division_rounding", "emulate_divison_rounding") if k in known), None)
    return {key: True} if key else {}


# inductor: keep the bf16/fp16 roundings of eager mode, and its exact division
EAGER_NUMERICS = {"emulate_precision_casts": True, **_division_rounding()}


def inductor_options(cudagraphs: bool = False) -> dict:
    """torch.compile `options` for a model forward: eager numerics, and CUDA graphs (what mode "reduce-overhead"
    turns on) when `cudagraphs`. torch.compile takes `mode` or `options`, not both."""
    return {**EAGER_NUMERICS, "triton.cudagraphs": cudagraphs}
