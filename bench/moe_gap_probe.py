"""Where the static engine's extra bf16 gap on some MoE families comes from: the exactness matrix's MoE measurement
(`bench/gpu_exactness.py measure`, routes replayed) over engine variants that each change one thing.

    hf              transformers' generate (it decodes with batched_mm experts: `_optimize_model_for_decode`)
    hf_grouped      generate with that swap off: decodes with the model's grouped_mm
    static          the run's engine: compiled, one CUDA graph per step, grouped_mm experts
    static_eager    the same engine uncompiled (eager grouped_mm, no CUDA graph)
    static_batched  the compiled engine decoding with batched_mm experts (the trainer keeps grouped_mm)
    static_div_exact     the compiled engine with inductor's exact fp32 division (Triton's `/` is the approximate
                    `div.full`; eager divides exactly): the renormalised top-k weights are such a quotient

A family name with the suffix `:nonorm` runs its config with norm_topk_prob=False (no renormalised top-k weights).

    python bench/moe_gap_probe.py --tokenizer DIR --out DIR [--families qwen3_moe,mixtral,olmoe]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402

from bench import gpu_exactness as G  # noqa: E402
from logitless.models.compiled import EAGER_NUMERICS, exact_division  # noqa: E402
from logitless.models.experts import experts_implementation, set_experts_implementation  # noqa: E402

VARIANTS = ("hf", "hf_grouped", "static", "static_eager", "static_batched", "static_div_exact")


def division_rounding() -> dict:
    """{inductor's key for exact fp32 division: True} (`models.compiled.exact_division`; EAGER_NUMERICS holds it
    since the run that measured this variant, so `static_div_exact` is now `static`)."""
    return exact_division()


class ExactDivision:
    """An engine whose `generate` compiles the model's decode with inductor's exact division (the decode compiles
    at the first call, reading `EAGER_NUMERICS` then)."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, *args, **kw):
        extra = {k: v for k, v in division_rounding().items() if k not in EAGER_NUMERICS}
        EAGER_NUMERICS.update(extra)
        try:
            return self.engine.generate(*args, **kw)
        finally:
            for k in extra:
                EAGER_NUMERICS.pop(k)


class DecodeWith:
    """An engine whose `generate` runs with `model`'s experts on `impl`, set back afterwards."""

    def __init__(self, engine, model, impl: str):
        self.engine, self.model, self.impl = engine, model, impl

    def generate(self, *args, **kw):
        own = experts_implementation(self.model)
        set_experts_implementation(self.model, self.impl)
        try:
            return self.engine.generate(*args, **kw)
        finally:
            set_experts_implementation(self.model, own)


def engine_of(original):
    def make(variant, model, tok, **kw):
        if variant == "static_batched":
            engine, keep = original("static", model, tok, **kw)
            return DecodeWith(engine, model, "batched_mm"), keep
        if variant == "static_div_exact":
            engine, keep = original("static", model, tok, **kw)
            return ExactDivision(engine), keep
        if variant == "hf_grouped":
            model._optimize_model_for_decode = contextlib.nullcontext  # generate decodes with the model's own
            return original("hf", model, tok, **kw)
        return original(variant, model, tok, **kw)

    return make


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default="qwen3_moe,mixtral,olmoe")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", help="cpu: fp32, a smoke run of the code path (4 new tokens)")
    args = ap.parse_args()
    tok = G.tokenizer(args.tokenizer)
    G.engine_of = engine_of(G.engine_of)
    rows = []
    for family in args.families.split(","):
        name, _, option = family.partition(":")
        make = G.configs(tok.eos_token_id, moe=True)[name]
        if option == "nonorm":
            make = (lambda m: lambda: setattr(cfg := m(), "norm_topk_prob", False) or cfg)(make)
        kw = {} if args.device == "cuda" else dict(device=args.device, dtype=torch.float32, new_tokens=4, samples=1)
        results = G.run_family(name, make, tuple(args.variants.split(",")), tok, **kw)
        rows += [dict(dataclasses.asdict(r), family=family) for r in results]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_gap_probe.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        num = {k: float("nan") if r.get(k) is None else r[k] for k in ("own_mean", "own_max", "disagreement")}
        print(f"{r['family']:10s} {r['variant']:17s} replay mean {r['mean']:.4f} max {r['max']:.3f}  own mean "
              f"{num['own_mean']:.4f} max {num['own_max']:.3f}  disagree {num['disagreement']:.4f}  "
              f"{r.get('error') or ''}")


if __name__ == "__main__":
    main()
