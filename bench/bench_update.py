"""The update phase alone: forward + backward of one micro-batch through `completion_logprobs` (the trainer's
call: fused op, entropy on), per way of running the model, with its MFU and what the GPU was busy with.

Variants (the model is a random-init Qwen2.5-shaped model with the real tokenizer, bf16, gradient checkpointing
unless --no-checkpointing):
* full            full fine-tuning, bf16 weights
* lora_fp32       PEFT LoRA as PEFT sets it up: fp32 adapters, each LoRA layer casts its input to fp32 and adds
                  an fp32 [N, out] result to the bf16 base output (PEFT's default, autocast_adapter_dtype=True)
* lora_autocast   the same fp32 adapters, the forward under torch.autocast(bf16) with PEFT's input cast off:
                  the adapter GEMMs run in bf16, the fp32 weights stay the optimizer's masters
                  (`model.lora_compute=autocast`)
* lora_bf16       adapters stored in bf16 (what FSDP2's bf16 param_dtype computes with)
* +liger          Liger-Kernel's RMSNorm/SwiGLU/RoPE (`model.liger_kernels=true`) on top of a variant
* +packed         padding-free rows (`train.packed=true`)
* +compiled       every decoder layer compiled with torch.compile (`model.compile_layers=true`; the warm-up compiles)

Timing: CUDA events, median of --reps after one warm-up; peak = max_memory_allocated during a rep minus the
memory before it. `gpu_busy` = summed kernel time / wall time of one profiled rep (torch.profiler): well under 1
means the GPU waits for the CPU to launch kernels. MFU counts forward + backward FLOPs once, attention included,
recompute not (logitless.trainer.report.accounting.update_flops), at the device's dense bf16 peak.
Attention runs with the trainer's sdpa backends (cuDNN's off: `model.cudnn_attention`); the numbers recorded before
that change ran cuDNN's kernels, whose per-shape setup a repeated micro-batch does not show.

    python bench/bench_update.py --tokenizer DIR --out DIR [--rows 8 --prompt 128 --completion 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_e2e import commit, make_model_dir, versions  # noqa: E402
from logitless.models import completion_logprobs  # noqa: E402
from logitless.trainer.report.accounting import ModelShape, device_peaks, update_flops  # noqa: E402
from logitless.trainer.config.schema import ModelConfig  # noqa: E402
from logitless.trainer.policy.modeling import LoraCompute, attention_backends, load_model_and_tokenizer  # noqa: E402

VARIANTS = {
    "full": dict(lora=False),
    "lora_fp32": dict(lora_compute="fp32"),
    "lora_autocast": dict(lora_compute="autocast"),
    "lora_bf16": dict(lora_compute="fp32", adapters_bf16=True),
    "lora_autocast+packed": dict(lora_compute="autocast", packed=True),
    "lora_autocast+packed+compiled": dict(lora_compute="autocast", packed=True, compiled=True),
    "full+compiled": dict(lora=False, compiled=True),
    # Liger patches the model type's module for the rest of the process: these come last
    "lora_autocast+liger": dict(lora_compute="autocast", liger_kernels=True),
    "full+liger": dict(lora=False, liger_kernels=True),
}


def batch(rows: int, prompt: int, completion: int, vocab: int, device: torch.device, seed: int = 0):
    """Left-padded prompts and right-padded completions of slightly different lengths (like a real micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(0, vocab, (rows, prompt), generator=g)
    c_ids = torch.randint(0, vocab, (rows, completion), generator=g)
    p_len = torch.randint(prompt * 3 // 4, prompt + 1, (rows,), generator=g)
    c_len = torch.randint(completion * 3 // 4, completion + 1, (rows,), generator=g)
    c_len[0] = completion
    p_mask = torch.arange(prompt)[None] >= (prompt - p_len)[:, None]
    c_mask = torch.arange(completion)[None] < c_len[:, None]
    adv = torch.randn(rows, 1, generator=g).expand(rows, completion)
    seq = [(int(p), int(c)) for p, c in zip(p_len, c_len)]
    return [t.to(device) for t in (p_ids, p_mask, c_ids, c_mask, adv.contiguous())], seq


def run_variant(name: str, spec: dict, a: argparse.Namespace, model_dir: Path) -> dict:
    packed = spec.get("packed", False)
    cfg = ModelConfig(
        name_or_path=str(model_dir), lora=spec.get("lora", True), gradient_checkpointing=a.checkpointing,
        liger_kernels=spec.get("liger_kernels", False), lora_compute=spec.get("lora_compute", "auto"),
        attn_implementation="logitless_varlen" if packed else None, compile_layers=spec.get("compiled", False),
    )
    model, _, device = load_model_and_tokenizer(cfg)
    torch._dynamo.utils.counters.clear()
    if spec.get("adapters_bf16"):
        model.to(torch.bfloat16)
    model.train()
    (p_ids, p_mask, c_ids, c_mask, adv), seq = batch(a.rows, a.prompt, a.completion, model.config.vocab_size, device)
    n = float(c_mask.sum())
    compute = LoraCompute(model, cfg)

    # --hint: the trainer's on-policy default (DAPO, no entropy bonus): d loss / d logp is known before the
    # forward, so the fused op forms its gradient there (2 GEMMs for the frozen head, no recompute)
    def onp_loss(logp: torch.Tensor) -> torch.Tensor:
        return -(logp * adv * c_mask).sum() / n

    hint = None
    if a.hint:  # by autograd through the loss itself, so the backward's gradient equals it bit for bit
        z = torch.zeros(c_mask.shape, device=device, requires_grad=True)
        hint = torch.autograd.grad(onp_loss(z), z)[0]

    def step() -> None:  # the trainer's attention backends (cuDNN's sdpa off unless model.cudnn_attention)
        with attention_backends(cfg), compute.stage():
            with compute.forward():
                logp, ent = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, with_entropy=True, packed=packed,
                                                grad_hint=hint)
            if a.hint:
                loss = onp_loss(logp)
            else:
                loss = -(logp * adv).sum() / n - 1e-3 * (ent * c_mask).sum() / n
            loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times, peaks = [], []
    for _ in range(a.reps):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
        model.zero_grad(set_to_none=True)
    busy, top, groups = profile(step) if a.profile else (None, None, None)
    model.zero_grad(set_to_none=True)
    shape = ModelShape.of(model)
    flops = update_flops(shape, seq)
    peak_flops, _ = device_peaks(device)
    ms = statistics.median(times)
    out = {"median_ms": ms, "ms": times, "peak_gib": max(peaks), "tokens": sum(p + c for p, c in seq),
           "completion_tokens": int(n), "tflops": flops / 1e12, "mfu": flops / (ms / 1e3) / peak_flops,
           "gpu_busy": busy, "top_kernels_ms": top, "kernel_groups_ms": groups,
           "dynamo": {"graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
                      "graph_breaks": int(sum(torch._dynamo.utils.counters["graph_break"].values()))}}
    model = None  # free it before the next variant loads
    torch.cuda.empty_cache()
    return out


KERNEL_GROUPS = (  # (group, substrings of a kernel's name), first match wins
    ("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce")),
    ("attention", ("flash", "fmha", "attention")),
    ("logprob_op", ("block_stats_kernel", "combine_kernel", "grad_tile_kernel")),
    ("triton_fused", ("triton_",)),
    ("copy", ("copy", "cat")),
    ("elementwise", ("elementwise", "reduce", "multi_tensor")),
)


def profile(step) -> tuple[float, dict[str, float], dict[str, list[float]]]:
    """(summed kernel time / wall time, the 20 kernels with most time in ms, {group: [ms, calls]}) of one call of
    `step`; groups by KERNEL_GROUPS (GEMMs, attention, the logprob op's passes, inductor's fused kernels, ...)."""
    from torch.profiler import ProfilerActivity, profile as prof

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    groups: dict[str, list[float]] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] = kernels.get(e.name[:90], 0.0) + e.device_time / 1e3
            g = next((g for g, keys in KERNEL_GROUPS if any(k in e.name for k in keys)), "other")
            acc = groups.setdefault(g, [0.0, 0])
            acc[0] += e.device_time / 1e3
            acc[1] += 1
    total = sum(kernels.values())
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:20])
    groups["wall"] = [wall * 1e3, 0]
    return total / 1e3 / wall, top, groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="gradient checkpointing (the trainer's default); --no-checkpointing keeps the activations")
    ap.add_argument("--hint", action="store_true",
                    help="the trainer's on-policy loss (no entropy bonus) with the fused op's gradient hint")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(a.shape, a.tokenizer, Path("/tmp/bench_models"))
    res = {"info": {"device": torch.cuda.get_device_name(), **versions(), "commit": a.commit or commit()},
           "shape": {"model": f"Qwen2.5-{a.shape} shape, random init, bf16",
                     "gradient_checkpointing": a.checkpointing, "grad_hint": a.hint,
                     "rows": a.rows, "prompt": a.prompt, "completion": a.completion, "reps": a.reps},
           "variants": {}}
    for name in a.variants:
        t0 = time.perf_counter()
        try:
            res["variants"][name] = run_variant(name, VARIANTS[name], a, model_dir)
        except Exception as e:  # a variant that cannot run here (e.g. Liger missing) is recorded, not fatal
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc()
        r = res["variants"][name]
        print(f"{name:22s} {r.get('median_ms', float('nan')):8.1f} ms  peak {r.get('peak_gib', float('nan')):6.2f} "
              f"GiB  MFU {r.get('mfu', float('nan')):.3f}  busy {r.get('gpu_busy')}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        (out / f"update_{a.shape}{'' if a.checkpointing else '_nogc'}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
