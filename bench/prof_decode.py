"""Kernel and host profile of one `static` rollout call: where a decode step's time goes.

Qwen2.5-1.5B shape (random init, bf16), `rows` = prompts x 8 samples, `new` tokens each, EOS ignored; one warm-up
call at the same shapes, one timed call, one call under torch.profiler (CUDA kernels and host events).

    python bench/prof_decode.py --tokenizer QWEN2.5_TOKENIZER --out DIR --rows 128 --new 512

`--compile-mode MODE` (e.g. max-autotune) also times the decode step compiled with that torch.compile mode in the
same process, to compare (the engine's own is "reduce-overhead"). `--fuse-projections` also times a copy of the
model with fused QKV and gate-up projections (`logitless/rollout/fused.py`), before the plain model.
Every timed engine also reports its share of the HBM ceiling (`trainer/report/accounting.py`, over the decode's own
seconds). `--fuse-baseline` makes the timed and profiled engine decode a copy with fused projections, as the
trainer's merged decode weights do. The timed and profiled engine decodes with `--baseline-attention` (default
matmul, named since the engine's own default, auto, takes the Triton kernel for bf16 on CUDA); `--length-buckets N`
sets rollout.length_buckets for every engine of the run, `--min-rows-per-sm N` the programs per SM below which the
kernel splits the cache length. `--baseline-sampler` sets the timed engine's rollout.sampler_kernel (default torch, the
sampler of the runs before the Triton one; the engine's own default, auto, takes triton on CUDA); `--sampler KIND`
also times the same model with that sampler and the share of tokens equal to the baseline's.
`--baseline-step-graph on|off|auto` sets the timed engine's rollout.step_graph (default off, the decode of the runs
before it; auto takes it on CUDA); `--step-graph on|off` also times the same model with that setting and the share
of tokens equal to the baseline's.
`--decode-attention triton` also times the plain model decoding with the
flash-decoding kernel (`logitless/ops/triton_decode.py`) and the share of its sampled tokens that equal the
baseline's (same seeds; bf16 rounding differs, so a few rows diverge).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_rollout import make_model, make_prompts  # noqa: E402
from logitless.rollout import SamplingOptions, make_engine  # noqa: E402
from logitless.trainer.report.accounting import ModelShape, decode_ideal_seconds, device_peaks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=128, help="a multiple of 8 (G = 8 samples per prompt)")
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--compile-mode", default=None, help="also time the decode step compiled with this mode")
    ap.add_argument("--fuse-projections", action="store_true",
                    help="also time a copy with fused QKV and gate-up projections (logitless/rollout/fused.py)")
    ap.add_argument("--baseline-attention", default="matmul", choices=["matmul", "triton", "sdpa"],
                    help="rollout.decode_attention of the timed and profiled engine (its default is auto)")
    ap.add_argument("--decode-attention", default=None, choices=["matmul", "triton"],
                    help="also time this rollout.decode_attention against the baseline's")
    ap.add_argument("--length-buckets", type=int, default=1,
                    help="rollout.length_buckets of every engine here (1: attend over the whole cache)")
    ap.add_argument("--fuse-baseline", action="store_true",
                    help="the timed and profiled engine decodes a copy with fused projections, as the trainer's "
                         "merged decode weights do (rollout.fuse_projections, on by default)")
    ap.add_argument("--baseline-sampler", default="torch", choices=["torch", "triton"],
                    help="rollout.sampler_kernel of the timed and profiled engine (its default is auto)")
    ap.add_argument("--sampler", default=None, choices=["torch", "triton"],
                    help="also time the timed engine's model with this rollout.sampler_kernel, and the share of "
                         "its tokens equal to the baseline's")
    ap.add_argument("--baseline-step-graph", default="off", choices=["auto", "on", "off"],
                    help="rollout.step_graph of the timed and profiled engine (its default is auto)")
    ap.add_argument("--step-graph", default=None, choices=["on", "off"],
                    help="also time the timed engine's model with this rollout.step_graph")
    ap.add_argument("--block-scan", type=int, default=None,
                    help="the decode kernel's BLOCK_SCAN (ops/triton_decode.py): its mask scan's most slots per load")
    ap.add_argument("--few-stages-from", type=int, default=None,
                    help="the decode kernel's FEW_STAGES_FROM: programs per SM from which it pipelines 2 stages")
    ap.add_argument("--min-rows-per-sm", type=int, default=None,
                    help="the decode kernel's MIN_ROWS_PER_SM (ops/triton_decode.py), below which it splits the cache")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    prompts = make_prompts(a.rows // 8)
    opts = SamplingOptions(num_generations=8, temperature=1.0, max_new_tokens=a.new, ignore_eos=True, seed=0)
    model = make_model(False, "cuda")

    from logitless.ops import triton_decode

    if a.min_rows_per_sm is not None:
        triton_decode.MIN_ROWS_PER_SM = a.min_rows_per_sm
    if a.block_scan is not None:
        triton_decode.BLOCK_SCAN = a.block_scan
    if a.few_stages_from is not None:
        triton_decode.FEW_STAGES_FROM = a.few_stages_from
    common = {"length_buckets": a.length_buckets}
    graph_flag = {"auto": None, "on": True, "off": False}
    base = {"decode_attention": a.baseline_attention, "sampler_kernel": a.baseline_sampler,
            "step_graph": graph_flag[a.baseline_step_graph], **common}

    _, hbm = device_peaks(torch.device("cuda"))

    def timed(engine) -> dict:
        """Seconds of a call after a warm-up call at the same shapes (`s`), its rates, its share of the HBM
        ceiling (`trainer/report/accounting.py`, the decode's own wall time), and the warm-up's seconds."""
        t = time.perf_counter()
        engine.generate(prompts, opts)  # compiles and captures at these shapes
        torch.cuda.synchronize()
        warm = time.perf_counter() - t
        t = time.perf_counter()
        batch = engine.generate(prompts, opts)
        torch.cuda.synchronize()
        s = time.perf_counter() - t
        ideal = decode_ideal_seconds(ModelShape.of(engine.weights.module), batch.prompt_mask.sum(1).tolist(),
                                     batch.completion_mask.sum(1).tolist(), hbm)
        return {"s": s, "tok_s": a.rows * a.new / s, "ms_per_step": s / a.new * 1e3, "first_call_s": warm,
                "generate_s": batch.timing.generate_seconds, "ceiling": ideal / batch.timing.generate_seconds}

    other = None
    if a.compile_mode:
        from transformers.generation.configuration_utils import CompileConfig

        from logitless.rollout.engine import unwrap_model
        from logitless.rollout.static import StaticEngine

        class Mode(StaticEngine):
            def _forward(self, module, device, rows):
                cfg = CompileConfig(fullgraph=False, mode=a.compile_mode, dynamic=False)
                return unwrap_model(module).get_compiled_call(cfg), "cudagraphs" not in a.compile_mode
        other = {"mode": a.compile_mode, **timed(Mode(model, tok, **common))}
        print(other, flush=True)
    def fused_copy() -> tuple[torch.nn.Module, int]:
        """A copy of the model with fused q/k/v and gate/up projections (as the trainer's decode weights), and
        how many groups it fused."""
        from logitless.rollout.fused import fuse_projections
        from logitless.rollout.weights import fresh_copy

        copy_ = fresh_copy(model)
        return copy_, len(fuse_projections(copy_))

    fused = None
    if a.fuse_projections:
        copy_, groups = fused_copy()
        fused = {"groups": groups, **timed(make_engine("static", copy_, tok, **base))}
        print({"fused_projections": fused}, flush=True)
        del copy_
        torch.cuda.empty_cache()
    kernel = None
    if a.decode_attention:
        alt = make_engine("static", model, tok, decode_attention=a.decode_attention, **common)
        kernel = {"kernel": a.decode_attention, **timed(alt)}
        alt_ids = alt.generate(prompts, opts).completion_ids
        del alt
        print({"decode_attention": kernel}, flush=True)
    if a.fuse_baseline:
        decoded, _ = fused_copy()
        del model
        torch.cuda.empty_cache()
    else:
        decoded = model
    eng = make_engine("static", decoded, tok, **base)
    baseline = timed(eng)
    plain_s = baseline["s"]
    print({"baseline": baseline}, flush=True)
    if kernel is not None:
        kernel["same_tokens"] = float((eng.generate(prompts, opts).completion_ids == alt_ids).float().mean())
    sampler = None
    if a.sampler:
        alt = make_engine("static", decoded, tok, **{**base, "sampler_kernel": a.sampler})
        sampler = {"kernel": a.sampler, **timed(alt)}
        sampler["same_tokens"] = float((alt.generate(prompts, opts).completion_ids ==
                                        eng.generate(prompts, opts).completion_ids).float().mean())
        del alt
        print({"sampler": sampler}, flush=True)
    step_graph = None
    if a.step_graph:
        alt = make_engine("static", decoded, tok, **{**base, "step_graph": graph_flag[a.step_graph]})
        step_graph = {"step_graph": a.step_graph, **timed(alt)}
        step_graph["same_tokens"] = float((alt.generate(prompts, opts).completion_ids ==
                                           eng.generate(prompts, opts).completion_ids).float().mean())
        del alt
        print({"step_graph": step_graph}, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        eng.generate(prompts, opts)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total)
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    res = {
        "info": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": a.commit,
                 "date": time.strftime("%Y-%m-%d")},
        "workload": f"static engine, Qwen2.5-1.5B shape random init bf16, {a.rows // 8} prompts x G=8 = {a.rows} rows, "
                    f"{a.new} new tokens, EOS ignored, temperature 1, after a warm-up call at the same shapes",
        "rows": a.rows, "new": a.new, "baseline_attention": a.baseline_attention, "length_buckets": a.length_buckets,
        "min_rows_per_sm": a.min_rows_per_sm, "block_scan": triton_decode.BLOCK_SCAN,
        "few_stages_from": triton_decode.FEW_STAGES_FROM, "baseline_sampler": a.baseline_sampler, "sampler": sampler,
        "baseline_step_graph": a.baseline_step_graph, "step_graph": step_graph,
        "fuse_baseline": a.fuse_baseline, "baseline": baseline,
        "plain_s": plain_s, "tok_s": a.rows * a.new / plain_s,
        "ms_per_step": plain_s / a.new * 1e3, "other_compile_mode": other, "fused_projections": fused, "decode_attention": kernel,
        "profiled_wall_ms": wall * 1e3, "kernel_ms_sum": kernel_ms,
        "kernel_ms_per_step": kernel_ms / a.new,
        "top_kernels_ms_calls_name": [[round(e.self_device_time_total / 1e3, 1), e.count, e.key[:110]] for e in kernels[:25]],
        "top_host_ms_calls_name": [[round(e.self_cpu_time_total / 1e3, 1), e.count, e.key[:80]] for e in host[:12]],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    default = (a.baseline_attention, a.length_buckets) == ("matmul", 1)
    tag = "" if default else f"_{a.baseline_attention}_lb{a.length_buckets}"
    tag += f"_rps{a.min_rows_per_sm}" if a.min_rows_per_sm is not None else ""
    tag += f"_scan{a.block_scan}" if a.block_scan is not None else ""
    tag += f"_stages{a.few_stages_from}" if a.few_stages_from is not None else ""
    tag += "_fused" if a.fuse_baseline else ""
    tag += f"_{a.baseline_sampler}_sampler" if a.baseline_sampler != "torch" else ""
    tag += f"_graph_{a.baseline_step_graph}" if a.baseline_step_graph != "off" else ""
    (out / f"decode_profile_{a.rows}x{a.new}{tag}.json").write_text(json.dumps(res, indent=1))
    print({k: v for k, v in res.items() if not k.startswith("top")})


if __name__ == "__main__":
    main()
