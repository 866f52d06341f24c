"""Compiled against eager routers of the MoE families (bf16, CUDA): how many of a router's outputs (logits, top-k
weights, expert indices) differ bitwise from eager mode, compiled with logitless's EAGER_NUMERICS, with them
plus inductor's exact division, and with no options. The tiny configs of bench/gpu_exactness.py, 8,192 random
hidden states.

    python bench/moe_router_probe.py --out DIR      # DIR/moe_router_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench import gpu_exactness as G  # noqa: E402
from logitless.models.compiled import EAGER_NUMERICS, exact_division  # noqa: E402


def compare(router: torch.nn.Module, x: torch.Tensor, options: dict) -> list[dict]:
    """Per output of `router(x)`: dtype, shape, how many elements the compiled router gives unlike eager's."""
    with torch.no_grad():
        ref = router(x)
        torch._dynamo.reset()
        got = torch.compile(router, options=options)(x)
    return [{"dtype": str(a.dtype), "shape": list(a.shape), "n_diff": int((a != b).sum()),
             "max_abs": float((a.float() - b.float()).abs().max())} for a, b in zip(ref, got)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default="qwen3_moe,mixtral,olmoe,qwen2_moe")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    base = {k: v for k, v in EAGER_NUMERICS.items() if k not in exact_division()}
    variants = {"eager_numerics": base, "plus_div": {**base, **exact_division()}, "none": {}}
    out = {}
    for family in args.families.split(","):
        cfg = G.configs(0, moe=True)[family]()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16)
        router = next(m for m in model.modules() if type(m).__name__.endswith("Router"))
        x = torch.randn(args.tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        out[family] = {"router": type(router).__name__,
                       **{name: {"opts": o, "outputs": compare(router, x, o)} for name, o in variants.items()}}
        print(family, json.dumps(out[family]))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "moe_router_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
