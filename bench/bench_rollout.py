"""Rollout throughput: each backend vs plain `model.generate`, one process, one GPU.

Workload: a Qwen2.5-1.5B-shaped random-init model (bf16, sdpa), the real Qwen2.5 tokenizer, 64 chat prompts of
varied length x G=8 samples, 512 new tokens with EOS ignored, temperature 1, no filters.

tokens/s = B * max_new_tokens / seconds of the generate call (synchronized; tokenization and post-processing
excluded for every variant alike; the engines' full wall time incl. post-processing is reported too). Variants
that compile are warmed up once at the same shapes first; the others with an 8-token run. Peak GiB =
torch.cuda.max_memory_allocated() during the timed call. Correctness: sampler logprobs of the first 64 rows vs
`logitless.models.completion_logprobs` (the trainer's path) on the same bf16 model.

Usage: python bench/bench_rollout.py --tokenizer DIR --out DIR [--variants plain,static,...] [--tiny]

Long tails (`--long-tail`): every static variant's row i ends after a planted number of tokens
(`StaticEngine.row_limits`), drawn once from a log-normal with median T/8 and 99th percentile T (clipped to [1, T],
seeded), the same rows in every variant, so each variant generates the same tokens. `static_waves` decodes the
rows in waves of the KV budget's rows (each wave lasts as long as its longest row), `static_refill` refills a slot
as soon as its row ends (`rollout/static_refill.py`); set --max-kv-gib so the budget holds fewer rows than the
call has. Warm-up: the same call with every row 16 tokens long (the same graph shapes). The GPU measurement of
issue 54 (1.5B shape, T = 8,192, 32 prompts x 8 = 256 rows through 64 slots: 64 x 0.225 GiB of KV each at the
prompts' ~250 tokens + 8,192), one variant per command (each well under 10 minutes on an H100):

    xz -dk tests/fixtures/tokenizers/qwen2.5/tokenizer.json.xz
    python bench/bench_rollout.py --tokenizer tests/fixtures/tokenizers/qwen2.5 --out bench/results/long_tail \
        --long-tail --prompts 32 --G 8 --new 8192 --max-kv-gib 14.6 --variants static_waves --budget_s 590
    (the same with --variants static_refill and another --out)

FP8 decode (`--fp8`: the variants static, static_fp8 and static_fp8_unfused; rollout.fp8, `rollout/fp8.py`): the
bf16 model itself against an FP8 copy of its projections (fused q/k/v and gate/up as a run decodes, and unfused),
tokens/s, peak memory and the sampler's |Δ logp| against the bf16 trainer (`logp_check`), at the 7B shape on one
H100 or H200 (about 15 GiB of bf16 weights, 7 GiB more for the FP8 copy):

    python bench/bench_rollout.py --tokenizer tests/fixtures/tokenizers/qwen2.5 --out bench/results/fp8_7b \
        --shape 7b --fp8 --prompts 32 --G 8 --new 512 --budget_s 560

CPU smoke test of the long-tail comparison (tiny 2-layer model, 32 rows, T = 64; on 2 shared cores the waves took
16.8 s and refill 10.1 s for the same 312 tokens):

    OMP_NUM_THREADS=1 python bench/bench_rollout.py --tokenizer tests/fixtures/tokenizers/qwen2.5 --out /tmp/lt \
        --tiny --long-tail --prompts 8 --G 4 --new 64 --max-kv-gib 0.0012 --variants static_waves,static_refill
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitless.rollout import SamplingOptions, make_engine  # noqa: E402

GIB = 1024**3
TOPICS = ["apples", "trains", "a rectangle", "interest rates", "a recipe", "marbles", "a marathon", "prime numbers"]


def make_prompts(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        words = " ".join(f"step{j} {TOPICS[(i + j) % len(TOPICS)]}" for j in range(4 + (i * 7) % 40))
        q = f"Problem {i}: reason about {TOPICS[i % len(TOPICS)]}. Details: {words}. What is the answer?"
        out.append([{"role": "user", "content": q}])
    return out


def make_model(tiny: bool, device: str, shape: str = "1.5b"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tiny:
        cfg = Qwen2Config(vocab_size=151_665, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    elif shape == "7b":  # Qwen2.5-7B
        cfg = Qwen2Config(vocab_size=152_064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    else:  # Qwen2.5-1.5B
        cfg = Qwen2Config(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    return model


def plain_generate(model, tok, prompts, opts):
    """The baseline: transformers `generate` as a user would call it (sampling, default dynamic cache)."""
    from transformers import GenerationConfig

    enc = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    batch = tok(enc, return_tensors="pt", padding=True).to(model.device)
    ids = batch["input_ids"].repeat_interleave(opts.num_generations, 0)
    mask = batch["attention_mask"].repeat_interleave(opts.num_generations, 0)
    model.generation_config = GenerationConfig()  # no EOS: run max_new_tokens
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=opts.max_new_tokens,
                           pad_token_id=tok.pad_token_id)
    torch.manual_seed(opts.seed or 0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    return out.shape[0] * (out.shape[1] - ids.shape[1])


VARIANTS = {
    # name: (backend or None for plain generate, engine kwargs, compiles)
    "plain": (None, {}, False),
    "static": ("static", {}, True),
    # decode slots refilled as rows end, or waves of the budget's rows (compare with --long-tail and --max-kv-gib)
    "static_refill": ("static", {"refill": True}, True),
    "static_waves": ("static", {"refill": False}, True),
    # the static engine with per-part timings (synchronizes around each part: slower, for the shares only)
    "static_profile": ("static", {"profile": True}, True),
    # the model the trainer runs: PEFT LoRA r16 on all linear layers, decoded unmerged, or from a merged copy
    "static_lora": ("static", {"weights": "live"}, True),
    "static_lora_merged": ("static", {"weights": "merged"}, True),
    # rollout.fp8: an FP8 copy of the projections (fused q/k/v and gate/up, as a run decodes; and unfused)
    "static_fp8": ("static", {"weights": "fp8"}, True),
    "static_fp8_unfused": ("static", {"weights": "fp8_unfused"}, True),
    "hf_static": ("hf", {"static_cache": True}, True),
    "continuous": ("continuous", {}, False),
    "hf": ("hf", {}, False),
}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_PEFT: dict = {}


def lora_wrapped(model, r: int = 16):
    """The model wrapped once in PEFT LoRA on all linear layers, with non-zero B (as after training)."""
    if "model" not in _PEFT:
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1e-3)
        _PEFT["model"] = peft_model.eval()
    return _PEFT["model"]


def long_tail_lengths(rows: int, T: int, seed: int = 0) -> torch.Tensor:
    """[rows] completion lengths from a log-normal with median T/8 and 99th percentile T (sigma = ln 8 / z_0.99),
    rounded and clipped to [1, T]; the same for a seed."""
    z = torch.randn(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sigma = torch.log(torch.tensor(8.0, dtype=torch.float64)) / 2.3263478740408408
    return (T / 8 * torch.exp(sigma * z)).round().clamp(1, T).long()


def run_variant(name, model, tok, prompts, opts, device, max_kv_gib=None, lengths=None):
    backend, kwargs, compiles = VARIANTS[name]
    kwargs = dict(kwargs)
    if backend == "static" and max_kv_gib is not None:
        kwargs["max_kv_gib"] = max_kv_gib
    copy_gib = None
    if "weights" in kwargs:
        from logitless.rollout.fp8 import Fp8Weights
        from logitless.rollout.weights import LiveWeights, MergedLoraWeights

        kind = kwargs.pop("weights")
        if kind.startswith("fp8"):
            weights = Fp8Weights(LiveWeights(model), fuse=kind == "fp8")
        else:
            model = lora_wrapped(model)
            weights = MergedLoraWeights(model) if kind == "merged" else LiveWeights(model)
        kwargs["weights"], copy_gib = weights, round(weights.extra_bytes / GIB, 3)
    if name == "continuous" and device == "cuda":
        B = len(prompts) * opts.num_generations
        kwargs = {"block_size": 64, "num_blocks": (B * (200 + opts.max_new_tokens)) // 64 + 64,
                  "max_batch_tokens": 4096, "max_memory_percent": 0.5}
    if name == "continuous" and device == "cpu":
        kwargs = {"num_blocks": 256, "block_size": 16, "max_batch_tokens": 256, "use_cuda_graph": False,
                  "use_async_batching": False}
    eng = make_engine(backend, model, tok, **kwargs) if backend else None
    warm = opts if compiles else SamplingOptions(**{**opts.__dict__, "max_new_tokens": 8})
    if lengths is not None and backend == "static":  # warm up at the same shapes with short rows
        eng.row_limits = torch.full_like(lengths, min(16, opts.max_new_tokens))
    t = time.perf_counter()
    if eng is None:
        plain_generate(model, tok, prompts, warm)
    else:
        eng.generate(prompts, warm)
    sync()
    warm_s = time.perf_counter() - t
    torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
    base_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
    shown = {k: (type(v).__name__ if k == "weights" else v) for k, v in kwargs.items()}
    rec = {"variant": name, "backend": backend, "engine_kwargs": shown, "warmup_s": round(warm_s, 2)}
    if copy_gib is not None:
        rec["weights_copy_gib"] = copy_gib
    if lengths is not None and backend == "static":
        eng.row_limits = lengths
    t = time.perf_counter()
    if eng is None:
        ntok = plain_generate(model, tok, prompts, opts)
        sync()
        gen_s = wall_s = time.perf_counter() - t
        batch = None
    else:
        batch = eng.generate(prompts, opts)
        wall_s = time.perf_counter() - t
        gen_s, ntok = batch.timing.generate_seconds, batch.timing.num_tokens
    rec.update(num_tokens=ntok, generate_s=round(gen_s, 3), wall_s=round(wall_s, 3),
               tokens_per_s=round(ntok / gen_s, 1), wall_tokens_per_s=round(ntok / wall_s, 1))
    if device == "cuda":
        rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        rec["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base_mem) / GIB, 2)
    if batch is not None and batch.timing.parts:
        total = sum(batch.timing.parts.values())
        rec["parts_s"] = {k: round(v, 4) for k, v in batch.timing.parts.items()}
        rec["parts_share"] = {k: round(v / total, 3) for k, v in batch.timing.parts.items()}
    if batch is not None:
        try:
            rec["logp_check"] = logp_check(model, batch, opts.logp_temperature)
        except Exception as e:
            rec["logp_check"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return rec


def logp_check(model, b, temperature, rows=64):
    from logitless.models import completion_logprobs

    dev = next(model.parameters()).device
    sl = slice(0, rows)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b.prompt_ids[sl].to(dev), b.prompt_mask[sl].to(dev),
                                    b.completion_ids[sl].to(dev), b.completion_mask[sl].to(dev),
                                    temperature=temperature)
    m = b.completion_mask[sl].bool()
    d = (lp.float().cpu() - b.sampler_logp[sl])[m].abs()
    return {"rows": rows, "max_abs_diff": round(float(d.max()), 5), "mean_abs_diff": round(float(d.mean()), 6),
            "mean_sampler_logp": round(float(b.sampler_logp[sl][m].mean()), 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="plain,static,hf_static,continuous,hf")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--tiny", action="store_true", help="2-layer model on CPU: smoke-test this script")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--max-kv-gib", type=float, default=None, help="static engine's KV-cache cap (waves beyond it)")
    ap.add_argument("--budget_s", type=float, default=480, help="skip variants once this much time has passed")
    ap.add_argument("--long-tail", action="store_true", help="plant long-tailed completion lengths in the static "
                    "variants (median new/8, 99th percentile new; see the module doc)")
    ap.add_argument("--shape", choices=("1.5b", "7b"), default="1.5b", help="the random-init model's shape (Qwen2.5)")
    ap.add_argument("--fp8", action="store_true", help="FP8 decode against bf16: the variants static, static_fp8 "
                    "and static_fp8_unfused (replaces --variants)")
    args = ap.parse_args()
    if args.fp8:
        args.variants = "static,static_fp8,static_fp8_unfused"
    from transformers import AutoTokenizer
    import transformers

    device = "cpu" if args.tiny else "cuda"
    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = make_model(args.tiny, device, args.shape)
    prompts = make_prompts(args.prompts)
    opts = SamplingOptions(num_generations=args.G, temperature=1.0, max_new_tokens=args.new, ignore_eos=True, seed=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "commit": args.commit,
        "python": platform.python_version(),
        "workload": {"model": "tiny" if args.tiny else f"Qwen2.5-{args.shape.upper()}-shaped random init", "dtype": str(
            next(model.parameters()).dtype), "attn": "sdpa", "prompts": args.prompts, "G": args.G,
            "max_new_tokens": args.new, "ignore_eos": True, "temperature": 1.0},
        "results": [],
    }
    lengths = long_tail_lengths(args.prompts * args.G, args.new) if args.long_tail else None
    if lengths is not None:
        q = torch.quantile(lengths.double(), torch.tensor([0.5, 0.99], dtype=torch.float64))
        meta["workload"]["long_tail"] = {"p50": float(q[0]), "p99": float(q[1]), "max": int(lengths.max()),
                                         "tokens": int(lengths.sum())}
    enc_len = [len(tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True)) for p in prompts]
    meta["workload"]["prompt_tokens_min_max"] = [min(enc_len), max(enc_len)]
    for name in args.variants.split(","):
        if time.perf_counter() - t_start > args.budget_s:
            meta["results"].append({"variant": name, "skipped": "time budget"})
            continue
        try:
            rec = run_variant(name, model, tok, prompts, opts, device, args.max_kv_gib, lengths)
        except Exception as e:  # record and go on: one backend failing must not lose the others' numbers
            rec = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(json.dumps(rec), flush=True)
        meta["results"].append(rec)
        (out / "bench_rollout.json").write_text(json.dumps(meta, indent=1))
        if device == "cuda":
            torch.cuda.empty_cache()
    base = next((r["tokens_per_s"] for r in meta["results"] if r.get("variant") == "plain" and "tokens_per_s" in r),
                None)
    print(f"\n{'variant':<12}{'tok/s':>10}{'x plain':>9}{'wall tok/s':>12}{'warmup s':>10}{'peak GiB':>10}"
          "  logp |diff| max/mean")
    for r in meta["results"]:
        if "tokens_per_s" not in r:
            print(f"{r['variant']:<12} {r.get('error') or r.get('skipped')}")
            continue
        x = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        lc = r.get("logp_check") or {}
        print(f"{r['variant']:<12}{r['tokens_per_s']:>10.0f}{x:>9}{r['wall_tokens_per_s']:>12.0f}{r['warmup_s']:>10.1f}"
              f"{r.get('peak_gib', 0):>10.1f}  {lc.get('max_abs_diff', '-')}/{lc.get('mean_abs_diff', '-')}")


if __name__ == "__main__":
    main()
