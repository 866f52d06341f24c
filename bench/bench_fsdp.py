"""Whole GRPO steps on 1, 2, 4 and 8 GPUs (torchrun, FSDP2), LoRA and full fine-tuning: completion tokens per second
and per-GPU peak memory per rank count, each measurement beside the memory model's prediction
(logitless/trainer/memory/ranks.py). Also the cost of the rollout's weight path per step (`hf`: all-gather of the
sharded model before `generate` and its release after; `static`: the in-place sync of the persistent replica).

Scaling (--scaling): `strong` keeps --prompts the global prompt count of a step at every rank count (the same
batch, split); `weak` gives each GPU --prompts prompts (the global batch grows with the GPUs). One command per
rank count (and per mode, where one command would take too long: each adds its mode to the rank count's file);
the one-GPU run serves both scalings. --summarize then sets each against the one-GPU run of the same settings:

    for N in 1 2 4 8; do for MODE in lora full; do
      torchrun --standalone --nproc-per-node $N bench/bench_fsdp.py --tokenizer QWEN2.5_TOKENIZER --out DIR \
          --shape 1.5b --backend static --gc --tokens 512 --prompts 64 --steps 3 --modes $MODE --scaling strong
    done; done
    python bench/bench_fsdp.py --summarize --out DIR --shape 1.5b --backend static --scaling strong
    # no GPU: the model's per-GPU peaks at 1, 2, 4, 8 ranks, and predicted against measured for bench/results
    python bench/bench_fsdp.py --predict --shape 7b --backend static --gc --tokens 512 --prompts 64
    python bench/bench_fsdp.py --check-recorded
    # CPU smoke run (gloo): --shape tiny --backend hf --tokens 8 --prompts 2 --G 2 --micro 2 --steps 2
    # the rollout split over groups of 2 GPUs (rollout.tensor_parallel=2): --backend static --tp 2; an 80 GB
    # GPU's room on a larger one: --gpu-gib 76
    # a GPU no rank trains on decoding for all (3 ranks + 1): --nproc-per-node 3 ... --set rollout.device=cuda:3
    # [--set train.async_rollout=true --set rollout.max_kv_gib=G], written as fsdp_..._4gpu_rollgpu.json

With one process the run is the plain single-GPU trainer (no process group, no FSDP). Settings that "auto" decides
differently on one process and under torchrun are pinned (`PINNED`; --set overrides them), so every rank count runs
the same step. The model is a random-init Qwen2.5-shaped model (bench_e2e.py); prompts are the packaged GSM8K
sample; the reward is bench_e2e's `distinct_chars`, which varies on random text, so every step trains. Writes
`fsdp_<shape>_<backend>_1gpu[_tag].json`, `fsdp_<shape>_<backend>_<scaling>_<N>gpu[_tpT][_tag].json` (--tp T > 1)
and, with --summarize, `fsdp_<shape>_<backend>_<scaling>_summary[_tag].json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_e2e import SHAPES, commit, make_model_dir, versions  # noqa: E402
from bench.bench_plan import DEVICE_GIB, GSM8K_SAMPLE_PROMPT, longest_prompt, skeleton  # noqa: E402
from logitless.trainer import load_train_config, stages, train  # noqa: E402
from logitless.trainer.distributed import parallel  # noqa: E402
from logitless.trainer.memory import plan as mp  # noqa: E402
from logitless.trainer.memory import ranks as mr  # noqa: E402
from logitless.trainer.placement.tensor_parallel import local_bytes  # noqa: E402

PHASES = ("time/generate", "time/score", "time/logprobs", "time/train")
# "auto" settings decided differently on one process (the memory plan, compiled layers) and under torchrun (no
# plan), and Liger (left off, as in the recorded runs: every rank count runs the same layers)
PINNED = ["model.liger_kernels=false", "model.compile_layers=false", "model.activation_offload=false",
          "train.offload_during_rollout=false", "train.micro_batch_tokens=null", "train.packed=false"]
RANKS = (1, 2, 4, 8)
# The recorded runs the model is checked against (--check-recorded, tests/test_memory_ranks.py): (file, result key,
# mode, the command's settings beyond 64 prompts x 8, T = 512, GC, static, 16-row micro-batches, whether checked).
# 211128a's LoRA computed its adapters in fp32 (the default then; the model knows today's bf16 autocast only).
RECORDED = [
    ("fsdp_h200x2_1.5b_static_64x8_211128a.json", "full", "full", [], True),
    ("fsdp_h200x2_1.5b_static_64x8_211128a.json", "lora", "lora", ["model.lora_compute=fp32"], False),
    ("fsdp_h200x2_1.5b_lora_autocast_64x8_72fc56b.json", "micro_batch_size_16", "lora", [], True),
    ("fsdp_h200x2_1.5b_lora_autocast_64x8_72fc56b.json", "micro_batch_tokens_32768", "lora",
     ["train.micro_batch_tokens=32768"], True),
    ("fsdp_h200x2_1.5b_static_64x8_offload_during_rollout_fd00fae.json", "full", "full",
     ["train.offload_during_rollout=true"], True),
]


# Runs on H100s (file, shape, rollout.tensor_parallel, prompts, G, tokens, overrides), LoRA, at their own longest
# prompt: 1.5B on 1 and 2 GPUs; 7B on 2, one replica per GPU and the rollout split over both; the 32B split rollout
# on 2, whose peak is the replica's sync (the shards not yet parked beside the whole split replica)
RECORDED_H100 = [
    ("fsdp_h100_1.5b_lora_1v2gpu_packed32k_91af055.json", "1.5b", 1, 64, 8, 512,
     ["train.packed=true", "train.micro_batch_tokens=32768"]),
    ("fsdp_h100x2_7b_tp1_91af055.json", "7b", 1, 64, 8, 512, ["train.packed=true", "train.micro_batch_tokens=32768"]),
    ("fsdp_h100x2_7b_tp2_graph_91af055.json", "7b", 2, 64, 8, 512,
     ["train.packed=true", "train.micro_batch_tokens=32768", "rollout.step_graph=true"]),
    ("fsdp_h100x2_32b_tp2_graph_91af055.json", "32b", 2, 16, 8, 1024,
     ["train.packed=true", "rollout.step_graph=true", "train.micro_batch_tokens=8192",
      "train.offload_during_rollout=true", "rollout.max_kv_gib=16"]),
]

# Recorded phases of an earlier behaviour, reported by --check-recorded but not checked (file, phase): why
STALE = {("fsdp_h100x2_32b_tp2_graph_91af055.json", "generate"):
         "measured when the shards were parked after the replica's sync (67.11 GiB: shards, split replica and a unit "
         "together); since park-sync the shards are parked before it and lent back a unit at a time: to re-measure"}


def timed_rollout_weights(log: list[dict[str, float]]):
    """`parallel.rollout_weights` that records the seconds of its weight path before and after `generate`, the GiB
    it holds during the rollout (all-gathered weights) and the GiB of a persistent replica (static backend)."""
    inner = parallel.rollout_weights

    @contextmanager
    def wrapper(model, replica, lend=parallel.no_lend):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        mem = torch.cuda.memory_allocated if torch.cuda.is_available() else (lambda: 0)
        sync()
        t0, m0 = time.perf_counter(), mem()
        with inner(model, replica, lend):
            sync()
            entry = {"gather_s": time.perf_counter() - t0, "held_gib": (mem() - m0) / 2**30}
            if getattr(replica, "model", None) is not None:  # (a shared rollout's: rank 0's)
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


def global_prompts(args: argparse.Namespace, ranks: int) -> int:
    return args.prompts * ranks if args.scaling == "weak" else args.prompts


def rollout_gpu(args: argparse.Namespace) -> bool:
    """--set rollout.device=cuda:N under torchrun: one more GPU, which decodes for every rank (shared_rollout.py)."""
    return any(x.startswith("rollout.device=") for x in getattr(args, "set", []))


def split(args: argparse.Namespace) -> int:
    """--tp: rollout.tensor_parallel (1 where the arguments predate it, as the recorded runs' do)."""
    return getattr(args, "tp", 1)


def overrides(mode: str, args: argparse.Namespace, ranks: int) -> list[str]:
    """The step's settings (the model and output folder aside), --set last."""
    return [
        "data.task=gsm8k", "data.split=sample", "reward.reward_funcs=[bench.bench_e2e:distinct_chars]",
        f"rollout.backend={args.backend}", f"rollout.num_generations={args.G}",
        f"rollout.max_completion_length={args.tokens}", f"train.max_steps={args.steps}",
        f"train.prompts_per_step={global_prompts(args, ranks)}", f"train.micro_batch_size={args.micro}",
        f"model.lora={str(mode == 'lora').lower()}", f"model.gradient_checkpointing={str(args.gc).lower()}",
        *([f"rollout.tensor_parallel={split(args)}"] if split(args) > 1 else []), *PINNED, *args.set,
    ]


def prediction(mode: str, args: argparse.Namespace, ranks: int, prompt_len: int, device_gib: float) -> dict[str, Any]:
    """The per-GPU peak of each phase (GiB) for this mode at `ranks` ranks as the trainer resolves it (`resolve`:
    on one process the memory plan, with its KV cap for `device_gib`; on several the memory model of
    `auto.rank_memory`), at the step's longest prompt."""
    from logitless.trainer.memory.auto import resolve

    cfg = load_train_config(None, ["model.name_or_path=unused", f"rollout.max_prompt_length={prompt_len}",
                                   *overrides(mode, args, ranks)])
    res = resolve(cfg, world_size=ranks, device=torch.device("cuda"), skeleton=skeleton(args.shape),
                  free_gib=device_gib)
    plan = res.plan if ranks == 1 else res.rank_memory
    assert plan is not None, res.notes
    return {"peak_gib": mr.training_peak(plan.phases) / mp.GIB,  # a training GPU's (not a shared rollout GPU's)
            "phase_gib": {p: plan.peak(p) / mp.GIB for p in plan.phases},
            "parts_gib": {p: {k: round(x / mp.GIB, 4) for k, x in v.items() if x} for p, v in plan.phases.items()}}


def run_mode(mode: str, model_dir: Path, args, world: parallel.World, work: Path) -> dict:
    cfg = load_train_config(None, [f"model.name_or_path={model_dir}", f"train.output_dir={work / ('run-' + mode)}",
                                   "logging.progress=false", "logging.tensorboard=false", "logging.log_completions=false",
                                   "logging.plot=false", "checkpoint.save_steps=1000", "checkpoint.save_at_end=false",
                                   *overrides(mode, args, world.size)])
    sync_log: list[dict[str, float]] = []
    stages.rollout_weights = timed_rollout_weights(sync_log)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    records = train(cfg, overwrite=True).records  # (its run folder is this bench's own: a killed run leaves one)
    # the allocator's peak since the start, or a phase's peak: those also count sleepable weight memory, which
    # lives outside the allocator (rollout/sleep.py); on CPU the phases' own peaks only
    peak = max([max(r.get("memory/peak_gb", 0.0) for r in records)]
               + ([torch.cuda.max_memory_allocated() / 2**30] if torch.cuda.is_available() else []))
    steady = records[1:] or records  # step 1 includes warm-up
    step_s = [sum(r.get(k, 0.0) for k in PHASES) for r in steady]
    prompts = global_prompts(args, world.size)
    tokens = [r["completion/length_mean"] * prompts * args.G for r in steady]  # the global step's tokens
    out = {
        "global_prompts": prompts,
        "median_step_s": statistics.median(step_s),
        "completion_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, step_s)),
        # the rollout alone: the step's completion tokens over its generate phase (every rank decodes at once)
        "generate_tokens_per_s": statistics.median(t / r["time/generate"] for t, r in zip(tokens, steady)),
        # the engines' own decode rate, all ranks (with train.async_rollout the generate phase is only the wait)
        "decode_tokens_per_s": statistics.median(r.get("tokens_per_s", 0.0) for r in steady),
        "async_rollout": cfg.train.async_rollout,
        "median_phase_s": {k: statistics.median(r.get(k, 0.0) for r in steady) for k in PHASES},
        "peak_gib_per_gpu_max": global_max(peak),
        # where the peak sits: each phase's largest peak over steps, the largest over ranks
        "peak_gib_per_phase": {p: global_max(max(r.get(f"memory/peak_gb/{p}", 0.0) for r in records))
                               for p in (k.removeprefix("time/") for k in PHASES)},
        "peak_gib_rank0": peak,
        # a shared rollout GPU's (rollout.device under torchrun; rank 0 records it)
        "rollout_device_peak_gib": max((r.get("memory/rollout_device_peak_gb", 0.0) for r in records), default=0.0),
        # a run cut after its first step (or asked for one) has only that step's times, its compile included
        "timed_steps": len(steady), "first_step_only": not records[1:],
        "records": records,
    }
    if sync_log[1:] and world.distributed:
        out["weight_path"] = {k: statistics.median(e[k] for e in sync_log[1:]) for k in sync_log[0]}
    return out


def result_name(args: argparse.Namespace, ranks: int | str) -> str:
    """The file of a rank count's run (one GPU: the same run for strong and weak scaling) or of the summary."""
    tag = f"_{args.tag}" if args.tag else ""
    if ranks == 1:
        return f"fsdp_{args.shape}_{args.backend}_1gpu{tag}.json"
    suffix = "summary" if ranks == "summary" else (f"{ranks + 1}gpu_rollgpu" if rollout_gpu(args) else f"{ranks}gpu") \
        + (f"_tp{split(args)}" if split(args) > 1 else "")  # (a shared rollout GPU counted)
    return f"fsdp_{args.shape}_{args.backend}_{args.scaling}_{suffix}{tag}.json"


def earlier_result(path: Path, shape: dict[str, Any], modes: list[str]) -> dict[str, Any] | None:
    """The result file this run adds its modes to (one command per mode fits a time limit), or None; refuses one
    measured with other settings, or that holds a mode this run would measure again (nothing is overwritten)."""
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    again = sorted(set(modes) & set(earlier["modes"]))
    if earlier["shape"] != shape or again:
        why = f"it already holds {', '.join(again)}" if again else "it was measured with other settings"
        raise SystemExit(f"{path} exists and {why}; pass --tag NAME or another --out (or move the file away)")
    return earlier


def measure(args: argparse.Namespace) -> None:
    world = parallel.init_distributed("auto")
    if args.gpu_gib is not None and torch.cuda.is_available():  # an 80 GB GPU's room on a larger one
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(args.gpu_gib * 2**30 / total, 1.0))
    out, work = Path(args.out), Path(args.out) / f".work-fsdp-{world.size}"
    prompt_len = longest_prompt(args.tokenizer)
    shape = {"model": f"Qwen2.5-{args.shape} shape, random init, bf16",
             **({"scaling": args.scaling} if world.size > 1 else {}),  # (one GPU's run serves both)
             "global_prompts_per_step": global_prompts(args, world.size), "G": args.G,
             "max_completion_length": args.tokens, "micro_batch_size": args.micro, "gradient_checkpointing": args.gc,
             "steps": args.steps, "rollout": args.backend,
             **({"tensor_parallel": split(args)} if split(args) > 1 else {}),
             **({"gpu_gib_cap": args.gpu_gib} if args.gpu_gib is not None else {}),
             "pinned": PINNED, "overrides": args.set,
             "longest_prompt": prompt_len}
    earlier = earlier_result(out / result_name(args, world.size), shape, args.modes.split(","))  # before the runs
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        make_model_dir(args.shape, args.tokenizer, work)
    if world.distributed:
        dist.barrier()
    model_dir = work / f"qwen2.5-{args.shape}-random"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else DEVICE_GIB["H200"]
    device_gib = min(device_gib, args.gpu_gib) if args.gpu_gib is not None else device_gib
    info = {"device": gpu, "gpus": world.size + rollout_gpu(args), "training_ranks": world.size,
            "versions": versions(), "commit": args.commit or commit(),
            "date": time.strftime("%Y-%m-%d")}
    # (each mode keeps the info of the command that measured it; the file's is the latest command's)
    result = {"info": info, "shape": shape, "modes": dict(earlier["modes"]) if earlier is not None else {}}
    for mode in args.modes.split(","):
        r = run_mode(mode, model_dir, args, world, work)
        r["predicted"] = prediction(mode, args, world.size, prompt_len, device_gib)
        result["modes"][mode] = {**r, "info": info}
        if world.main:
            first = "  (its first step only, compile included)" if r["first_step_only"] else ""
            print(f"{world.size} GPU {mode:5s} step {r['median_step_s']:.2f} s{first}  "
                  f"{r['completion_tokens_per_s']:.0f} tok/s  "
                  f"generate {r['generate_tokens_per_s']:.0f} tok/s (decode {r['decode_tokens_per_s']:.0f}"
                  f"{', beside the update' if r['async_rollout'] else ''})  "
                  f"peak/GPU {r['peak_gib_per_gpu_max']:.2f} GiB (predicted {r['predicted']['peak_gib']:.2f}; "
                  f"rollout GPU {r['rollout_device_peak_gib']:.2f})  "
                  f"by phase {r['peak_gib_per_phase']}  phases {r['median_phase_s']}  weight path {r.get('weight_path')}",
                  flush=True)
    if world.distributed:
        dist.barrier()
    if world.main:
        (out / result_name(args, world.size)).write_text(json.dumps(result, indent=1, default=str))
        shutil.rmtree(work, ignore_errors=True)
    parallel.shutdown()


def summarize(args: argparse.Namespace) -> dict[str, Any]:
    """Each rank count's run against the 1-GPU run of the same settings: tokens/s speedup and efficiency
    (speedup / N; for weak scaling the same ratio is tokens/s per GPU against one GPU's), the rollout's and the
    update's speedup, per-GPU peak and its ratio, measured and predicted."""
    out = Path(args.out)
    runs = {n: json.loads((out / result_name(args, n)).read_text()) for n in RANKS
            if (out / result_name(args, n)).is_file()}
    if 1 not in runs:
        raise SystemExit(f"--summarize needs the 1-GPU run {out / result_name(args, 1)}")
    table: dict[str, list[dict[str, Any]]] = {}
    for mode, one in runs[1]["modes"].items():
        if one.get("first_step_only"):
            raise SystemExit(f"{out / result_name(args, 1)}: its {mode} run timed only its first step (compile "
                             "included); rerun it with --steps 3 or more")
        rows = []
        for n, run in sorted(runs.items()):
            r = run["modes"].get(mode)
            if r is None:
                continue
            if r.get("first_step_only"):  # (a scaling ratio against a step that compiles means nothing)
                print(f"{args.shape} {args.scaling} {mode:5s} {n} GPU  left out: only its first step was timed")
                continue
            speedup = r["completion_tokens_per_s"] / one["completion_tokens_per_s"]
            # each phase's prompts per second against one GPU's (strong scaling: t1 / tN; weak: N t1 / tN)
            scale = r["global_prompts"] / one["global_prompts"]
            phase_speedup = {k.removeprefix("time/"): scale * one["median_phase_s"][k] / v
                             for k, v in r["median_phase_s"].items() if k in ("time/generate", "time/train") and v > 0}
            pred, pred1 = r["predicted"]["peak_gib"], one["predicted"]["peak_gib"]
            rows.append({"gpus": n, "device": run["info"]["device"], "global_prompts": r["global_prompts"],
                         "step_s": r["median_step_s"], "tokens_per_s": r["completion_tokens_per_s"],
                         "speedup": speedup, "efficiency": speedup / n, "phase_s": r["median_phase_s"],
                         "phase_speedup": phase_speedup,
                         "peak_gib_per_gpu": r["peak_gib_per_gpu_max"],
                         "peak_ratio": r["peak_gib_per_gpu_max"] / one["peak_gib_per_gpu_max"],
                         "predicted_peak_gib": pred, "predicted_ratio": pred / pred1,
                         # (on CPU the measured peak is the process's memory: no prediction to check)
                         "prediction_error": None if run["info"]["device"] == "cpu" else pred / r["peak_gib_per_gpu_max"] - 1,
                         "peak_gib_per_phase": r["peak_gib_per_phase"], "predicted_phase_gib": r["predicted"]["phase_gib"]})
        table[mode] = rows
        for x in rows:
            print(f"{args.shape} {args.scaling} {mode:5s} {x['gpus']} GPU  {x['tokens_per_s']:8.0f} tok/s  "
                  f"x{x['speedup']:.2f} (eff {x['efficiency']:.2f}; rollout x{x['phase_speedup'].get('generate', 0):.2f}, "
                  f"update x{x['phase_speedup'].get('train', 0):.2f})  peak/GPU {x['peak_gib_per_gpu']:.2f} GiB "
                  f"({x['peak_ratio']:.2f}x; predicted {x['predicted_peak_gib']:.2f}, {x['predicted_ratio']:.2f}x"
                  + (f", {100 * x['prediction_error']:+.1f} %)" if x["prediction_error"] is not None else ")"))
    summary = {"shape": args.shape, "backend": args.backend, "scaling": args.scaling, "tag": args.tag,
               "files": [result_name(args, n) for n in sorted(runs)], "modes": table}
    (out / result_name(args, "summary")).write_text(json.dumps(summary, indent=1))
    return summary


def predict_table(args: argparse.Namespace) -> dict[str, Any]:
    """No GPU: the model's per-GPU peak per phase at each rank count of --ranks, and its ratio to one GPU's."""
    prompt_len = longest_prompt(args.tokenizer)
    out: dict[str, Any] = {}
    for mode in args.modes.split(","):
        rows = {n: prediction(mode, args, n, prompt_len, args.device_gib) for n in args.ranks}
        one = rows[1]["peak_gib"] if 1 in rows else None
        for n, p in rows.items():
            ratio = f"{p['peak_gib'] / one:.2f}x" if one else ""
            phases = "  ".join(f"{k} {v:.2f}" for k, v in p["phase_gib"].items())
            print(f"{args.shape} {mode:5s} {args.scaling} {n} GPU: predicted peak/GPU {p['peak_gib']:.2f} GiB {ratio}  "
                  f"({phases})")
        out[mode] = rows
    return out


def check_recorded(results: Path = REPO / "bench" / "results") -> list[dict[str, Any]]:
    """Predicted against measured per-GPU peaks (generate and train phases) of the recorded runs (`RECORDED`)."""
    rows = []
    for name, key, mode, sets, checked in RECORDED:
        data = json.loads((results / name).read_text())["results"][key]
        args = argparse.Namespace(shape="1.5b", backend="static", G=8, tokens=512, steps=2, prompts=64, micro=16,
                                  gc=True, scaling="strong", set=sets)
        for gpus in (1, 2):
            measured = data[f"{gpus}gpu"]["peak_gib_per_phase"]
            pred = prediction(mode, args, gpus, GSM8K_SAMPLE_PROMPT, DEVICE_GIB["H200"])["phase_gib"]
            rows += _phase_rows(name, key, gpus, checked, pred, measured)
    for name, shape, tp, prompts, G, tokens, sets in RECORDED_H100:
        data = json.loads((results / name).read_text())
        args = argparse.Namespace(shape=shape, backend="static", G=G, tokens=tokens, steps=1, prompts=prompts, micro=16,
                                  gc=True, scaling="strong", set=sets, tp=tp)
        runs = data["runs"] if "runs" in data else {"2gpu": data}  # (a 1- and 2-GPU record holds both runs)
        for key, run in runs.items():
            gpus = int(key.removesuffix("gpu"))
            measured = run["modes"]["lora"]["peak_gib_per_phase"]
            pred = prediction("lora", args, gpus, run["shape"]["longest_prompt"], DEVICE_GIB["H100"])["phase_gib"]
            rows += [{**r, "checked": (name, r["phase"]) not in STALE}
                     for r in _phase_rows(name, f"lora tp={tp}", gpus, True, pred, measured)]
    return rows


def _phase_rows(name: str, variant: str, gpus: int, checked: bool, pred: dict[str, float],
                measured: dict[str, float]) -> list[dict[str, Any]]:
    """check_recorded's rows of one run: its rollout and update peaks, predicted against measured (GiB)."""
    return [{"file": name, "variant": variant, "gpus": gpus, "phase": phase, "checked": checked,
             "predicted_gib": pred[phase], "measured_gib": measured[phase], "error": pred[phase] / measured[phase] - 1}
            for phase in ("generate", "train")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="folder with the Qwen2.5 tokenizer")
    ap.add_argument("--out", help="results folder")
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--scaling", default="strong", choices=["strong", "weak"],
                    help="strong: --prompts is the global count at every rank count; weak: --prompts per GPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step on one GPU (see --scaling)")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--backend", default="hf", choices=["hf", "static"], help="rollout backend")
    ap.add_argument("--tp", type=int, default=1, help="rollout.tensor_parallel: ranks per rollout group (static)")
    ap.add_argument("--gpu-gib", type=float, default=None,
                    help="cap each GPU's memory to this many GiB (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (repeatable)")
    ap.add_argument("--tag", default="", help="a suffix of the result file names")
    ap.add_argument("--commit", default="", help="the code's commit, where the checkout has no git metadata of its own")
    ap.add_argument("--summarize", action="store_true", help="ratios of the runs in --out against their 1-GPU run")
    ap.add_argument("--predict", action="store_true", help="no GPU: the memory model's per-GPU peaks at --ranks")
    ap.add_argument("--ranks", default="1,2,4,8", help="rank counts of --predict")
    ap.add_argument("--device-gib", type=float, default=DEVICE_GIB["H200"], help="--predict: one GPU's memory")
    ap.add_argument("--check-recorded", action="store_true", help="no GPU: predicted vs measured of bench/results")
    args = ap.parse_args()
    args.ranks = [int(x) for x in str(args.ranks).split(",")]
    if args.check_recorded:
        for r in check_recorded():
            print(f"{r['file'][:58]:58s} {r['variant'][:24]:24s} {r['gpus']} GPU {r['phase']:8s} predicted "
                  f"{r['predicted_gib']:6.2f} measured {r['measured_gib']:6.2f} GiB ({100 * r['error']:+5.1f} %)"
                  + ("" if r["checked"] else "  (not modelled: fp32 LoRA compute)"))
    elif args.predict:
        predict_table(args)
    elif args.summarize:
        if not args.out:
            ap.error("--summarize needs --out (the folder of the runs)")
        summarize(args)
    else:
        if not (args.tokenizer and args.out):
            ap.error("--tokenizer and --out are required")
        measure(args)


if __name__ == "__main__":
    main()
