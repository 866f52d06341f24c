"""Where the static engine's extra bf16 gap on some MoE families comes from: the exactness matrix's MoE measurement
(`bench/gpu_exactness.py measure`, routes replayed) over engine variants that each change one thing.

    hf              transformers' generate (it decodes with batched_mm experts: `_optimize_model_for_decode`)
    hf_grouped      generate with that swap off: decodes with the model's grouped_mm
    static          the run's engine: compiled, one CUDA graph per step, grouped_mm experts
    static_eager    the same engine uncompiled (eager grouped_mm, no CUDA graph)
    static_batched  the compiled engine decoding with batched_mm experts (the trainer keeps grouped_mm)
    static_router_eager  the compiled engine with each router's forward left out of the compiled graph

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

from bench import gpu_exactness as G  # noqa: E402
from logitless.models.experts import experts_implementation, set_experts_implementation  # noqa: E402

VARIANTS = ("hf", "hf_grouped", "static", "static_eager", "static_batched", "static_router_eager")


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
        if variant == "static_router_eager":
            from logitless.models.routing import routing_of

            for router in routing_of(model).routers:
                router.forward = torch.compiler.disable(router.forward)
            return original("static", model, tok, **kw)
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
        print(f"{r['family']:10s} {r['variant']:15s} replay mean {r['mean']:.4f} max {r['max']:.3f}  own mean "
              f"{r.get('own_mean', float('nan')):.4f} max {r.get('own_max', float('nan')):.3f}  "
              f"disagree {r.get('disagreement', float('nan')):.4f}  {r.get('error') or ''}")


if __name__ == "__main__":
    main()
