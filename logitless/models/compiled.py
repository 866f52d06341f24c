"""The inductor options every torch.compile of a model's forward in logitless uses: eager bf16/fp16 numerics.

Eager PyTorch computes a bf16 op by upcasting its inputs to fp32 and rounding the result back to bf16. When inductor
fuses two such ops into one kernel it drops the rounding between them (a fused RMSNorm, RoPE, residual add or
activation keeps fp32 intermediates): the compiled model computes a slightly different function. Measured on an
H200 (bench/LOG.md, "Compiled decode = eager model"): the static engine's compiled decode drifted from the eager
trainer 1.8-9x further than the eager decode did (mean |Δ logp| 0.0018 vs 0.0010 on a random Llama, 0.0045 vs 0.0005
on GPT-OSS, where a flipped expert choice costs up to 0.26 nats); with `emulate_precision_casts` it computes what
the eager model computes, to the summation order. The sampler's job is to be the policy, so every compiled copy of
a forward (the decode step, `model.compile_layers`) keeps eager numerics.
"""

from __future__ import annotations



def exact_division() -> dict:
    """{inductor's key for eager's correctly rounded fp32 division: True} under the name this PyTorch knows, or {}.
    Triton's `x / y` is the approximate `div.full` (up to 2 ulp); eager divides exactly. A mixture of experts
    renormalises its top-k weights by such a quotient: on one H100, compiled Qwen3-MoE / Mixtral routers gave
    23 / 6,224 of 16,384 weights unlike eager's without it and 9 / 2,235 with it (bench/LOG.md)."""
    import torch._inductor.config

    known = torch._inductor.config.get_config_copy()
    key = next((k for k in ("eager_numerics.division_rounding", "emulate_divison_rounding") if k in known), None)
    return {key: True} if key else {}


# inductor: keep the bf16/fp16 roundings of eager mode, and its exact division
EAGER_NUMERICS = {"emulate_precision_casts": True, **exact_division()}


def inductor_options(cudagraphs: bool = False) -> dict:
    """torch.compile `options` for a model forward: eager numerics, and CUDA graphs (what mode "reduce-overhead"
    turns on) when `cudagraphs`. torch.compile takes `mode` or `options`, not both."""
    return {**EAGER_NUMERICS, "triton.cudagraphs": cudagraphs}
