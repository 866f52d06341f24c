"""Whole GRPO steps on 1 vs N GPUs (torchrun, FSDP2): completion tokens per second of the step and per-GPU peak
memory, LoRA and full fine-tuning, the same global batch. Also the cost of the rollout's weight path per step
(`hf`: all-gather of the sharded model before `generate` and its release after; `static`: the in-place sync of
the persistent replica): seconds and GiB.

    torchrun --standalone --nproc-per-node 1 bench/bench_fsdp.py --tokenizer DIR --out bench/results
    torchrun --standalone --nproc-per-node 2 bench/bench_fsdp.py --tokenizer DIR --out bench/results
    torchrun --standalone --nproc-per-node 2 bench/bench_fsdp.py --tokenizer DIR --out bench/results \
        --backend static --tp 2      # the rollout split over the 2 GPUs (rollout.tensor_parallel=2)

With one process the run is the plain single-GPU trainer (no process group, no FSDP). The model is a random-init
Qwen2.5-shaped model (bench_e2e.py); prompts are the packaged GSM8K sample; the reward is bench_e2e's
`distinct_chars`, which varies on random text, so every step trains. Writes `fsdp_<shape>_<backend>_<N>gpu.json`
(`..._<N>gpu_tp<T>.json` with --tp T > 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_e2e import SHAPES, make_model_dir  # noqa: E402
from logitless.trainer import load_train_config, parallel, stages, train  # noqa: E402
from logitless.trainer.tensor_parallel import local_bytes  # noqa: E402

PHASES = ("time/generate", "time/score", "time/logprobs", "time/train")


def timed_rollout_weights(log: list[dict[str, float]]):
    """`parallel.rollout_weights` that records the seconds of its weight path before and after `generate`, the GiB
    it holds during the rollout (all-gathered weights) and the GiB of a persistent replica (static backend)."""
    inner = parallel.rollout_weights

    @contextmanager
    def wrapper(model, replica):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        mem = torch.cuda.memory_allocated if torch.cuda.is_available() else (lambda: 0)
        sync()
        t0, m0 = time.perf_counter(), mem()
        with inner(model, replica):
            sync()
            entry = {"gather_s": time.perf_counter() - t0, "held_gib": (mem() - m0) / 2**30}
            if replica is not None:
                entry["replica_gib"] = local_bytes(replica.model) / 2**30  # this rank's slices with --tp
            yield
            sync()
            t1 = time.perf_counter()
        sync()
        entry["release_s"] = time.perf_counter() - t1
        log.append(entry)

    return wrapper


def global_max(x: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_mode(mode: str, model_dir: Path, args, world: parallel.World, work: Path) -> dict:
    lora = mode == "lora"
    cfg = load_train_config(None, [
        f"model.name_or_path={model_dir}", "data.task=gsm8k", "data.split=sample",
        "reward.reward_funcs=[bench.bench_e2e:distinct_chars]", f"rollout.backend={args.backend}",
        f"rollout.num_generations={args.G}", f"rollout.max_completion_length={args.tokens}",
        f"train.max_steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        f"train.micro_batch_size={args.micro}", f"model.lora={str(lora).lower()}",
        f"model.gradient_checkpointing={str(args.gc).lower()}", f"rollout.tensor_parallel={args.tp}",
        f"train.output_dir={work / ('run-' + mode)}", "logging.progress=false", "logging.tensorboard=false",
        "logging.log_completions=false", "logging.plot=false", "checkpoint.save_steps=1000", "checkpoint.save_at_end=false",
        *args.set,
    ])
    sync_log: list[dict[str, float]] = []
    stages.rollout_weights = timed_rollout_weights(sync_log)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    res = train(cfg)
    records = res.records
    # the allocator's peak since the start, or a phase's peak: those also count sleepable weight memory, which
    # lives outside the allocator (rollout/sleep.py)
    peak = max(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan"),
               max(r.get("memory/peak_gb", 0.0) for r in records))
    steady = records[1:] or records  # step 1 includes warm-up
    step_s = [sum(r.get(k, 0.0) for k in PHASES) for r in steady]
    tokens = [r["completion/length_mean"] * args.prompts * args.G for r in steady]  # the global step's tokens
    out = {
        "median_step_s": statistics.median(step_s),
        "completion_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, step_s)),
        # the rollout alone: the step's completion tokens over its generate phase (every rank decodes at once)
        "generate_tokens_per_s": statistics.median(t / r["time/generate"] for t, r in zip(tokens, steady)),
        "median_phase_s": {k: statistics.median(r.get(k, 0.0) for r in steady) for k in PHASES},
        "peak_gib_per_gpu_max": global_max(peak),
        # where the peak sits: each phase's largest peak over steps, the largest over ranks
        "peak_gib_per_phase": {p: global_max(max(r.get(f"memory/peak_gb/{p}", 0.0) for r in records))
                               for p in (k.removeprefix("time/") for k in PHASES)},
        "peak_gib_rank0": peak,
        "records": records,
    }
    if sync_log[1:] and world.distributed:
        out["weight_path"] = {k: statistics.median(e[k] for e in sync_log[1:]) for k in sync_log[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="folder with the Qwen2.5 tokenizer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="global prompts per step")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--backend", default="hf", choices=["hf", "static"], help="rollout backend")
    ap.add_argument("--tp", type=int, default=1, help="rollout.tensor_parallel: ranks per rollout group (static)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    ap.add_argument("--commit", default="", help="the code's commit, where the checkout has no git metadata of its own")
    args = ap.parse_args()
    world = parallel.init_distributed("auto")
    out, work = Path(args.out), Path(args.out) / f".work-fsdp-{world.size}"
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        make_model_dir(args.shape, args.tokenizer, work)
    if world.distributed:
        dist.barrier()
    model_dir = work / f"qwen2.5-{args.shape}-random"
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    result = {
        "info": {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "gpus": world.size,
                 "torch": torch.__version__, "commit": commit or "unknown"},
        "shape": {"model": f"Qwen2.5-{args.shape} shape, random init, bf16", "global_prompts_per_step": args.prompts,
                  "G": args.G, "max_completion_length": args.tokens, "micro_batch_size": args.micro,
                  "gradient_checkpointing": args.gc, "steps": args.steps, "rollout": args.backend, "tensor_parallel": args.tp,
                  "overrides": args.set},
        "modes": {},
    }
    for mode in args.modes.split(","):
        r = run_mode(mode, model_dir, args, world, work)
        result["modes"][mode] = r
        if world.main:
            print(f"{world.size} GPU {mode:5s} step {r['median_step_s']:.2f} s  {r['completion_tokens_per_s']:.0f} tok/s  "
                  f"generate {r['generate_tokens_per_s']:.0f} tok/s  "
                  f"peak/GPU {r['peak_gib_per_gpu_max']:.1f} GiB  by phase {r['peak_gib_per_phase']}  "
                  f"phases {r['median_phase_s']}  weight path {r.get('weight_path')}", flush=True)
    if world.distributed:
        dist.barrier()
    if world.main:
        name = f"fsdp_{args.shape}_{args.backend}_{world.size}gpu{f'_tp{args.tp}' if args.tp > 1 else ''}.json"
        (out / name).write_text(json.dumps(result, indent=1, default=str))
        shutil.rmtree(work, ignore_errors=True)
    parallel.shutdown()


if __name__ == "__main__":
    main()
