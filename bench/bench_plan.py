"""The automatic settings and the memory plan, measured: a config that names only the model, data and reward ("auto")
against hand-tuned settings, one process each, on random-init Qwen2.5 shapes with the real tokenizer.

    # step times and predicted vs measured peak per phase, auto against the hand-tuned variants (GPU)
    python bench/bench_plan.py --tokenizer QWEN2.5_TOKENIZER --out DIR --shape 1.5b --T 1024
    # the same under a 24 GiB budget (train.memory_budget_gib=24 for auto; every process capped at 24 GiB)
    python bench/bench_plan.py --tokenizer ... --out DIR --shape 7b --T 1024 --memory-budget 24
    # the longest T each variant fits in the budget (one step per probe), from the plan's own prediction
    python bench/bench_plan.py --tokenizer ... --out DIR --memory-budget 24 --find-max-T --variants auto,lean
    # one probe per T (GPUs side by side), each decoding 256 tokens a row into its full cache, the rest filled
    python bench/bench_plan.py --tokenizer ... --out DIR --memory-budget 24 --fits-T 31744 --probe-decode 256 --variants auto
    # no GPU: the plan's predicted longest T, and predicted against measured for every run in bench/results
    python bench/bench_plan.py --predict-max-T --shape 1.5b --memory-budget 24
    python bench/bench_plan.py --check-recorded
    # variants run by separate commands (one command may not hold them all): the checks over their result files
    python bench/bench_plan.py --compare DIR/plan_7b_auto.json DIR/plan_7b_hand.json ...

Every variant gets the same step: LoRA r16, 16 prompts x G = 8, GSM8K prompts of the packaged sample in the chat
template, DAPO, beta = 0, reward = distinct characters / 100 (it varies on random text, so every row trains), and
the config's default train.max_steps (100: what decides model.compile_layers=auto); the run stops after --steps
steps. Step times are medians of the steps after the first (which compiles). Variants (--variants):

    auto         nothing but model, data, reward and the step's shape: every speed and memory setting "auto"
    hand         examples/gsm8k.yaml's hand-tuned settings: static, checkpointing, compiled layers, packed 16k-token
                 micro-batches
    fast         the fastest measured on an H200 (bench/LOG.md): as hand without checkpointing, 32k-token micro-batches
    fast16k      the same with 16k-token micro-batches (half the activations: the fastest that fits a 7B model)
    lean         the 24 GiB longest-T setting of bench/LOG.md: static, checkpointing, activation offload,
                 micro-batches of max(16384, the longest row) tokens
    --custom NAME=a=1,b=2   any other set of overrides ({longest}: the longest row's tokens, 512 + T)

model.mlp_chunk_tokens stays auto in every variant: where a variant's untiled update does not fit the budget the plan
tiles the MLP (on an 80 GB GPU: fast at 1.5B, fast16k at 7B), which the printed settings say.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_e2e import SHAPES, add_worker_options, commit, make_model_dir, versions  # noqa: E402

PHASES = ("generate", "score", "logprobs", "train")
MAX_PROMPT = 512  # rollout.max_prompt_length of every variant
VARIANTS = {
    "auto": [],
    "hand": ["rollout.backend=static", "model.gradient_checkpointing=true", "model.compile_layers=true",
             "train.packed=true", "train.micro_batch_tokens=max({longest},16384)", "model.liger_kernels=false",
             "model.activation_offload=false", "train.offload_during_rollout=false"],
    "fast": ["rollout.backend=static", "model.gradient_checkpointing=false", "model.compile_layers=true",
             "train.packed=true", "train.micro_batch_tokens=max({longest},32768)", "model.liger_kernels=false",
             "model.activation_offload=false", "train.offload_during_rollout=false"],
    "fast16k": ["rollout.backend=static", "model.gradient_checkpointing=false", "model.compile_layers=true",
                "train.packed=true", "train.micro_batch_tokens=max({longest},16384)", "model.liger_kernels=false",
                "model.activation_offload=false", "train.offload_during_rollout=false"],
    "lean": ["rollout.backend=static", "model.gradient_checkpointing=true", "model.activation_offload=true",
             "train.micro_batch_tokens=max({longest},16384)", "model.compile_layers=false", "train.packed=false",
             "model.liger_kernels=false", "train.offload_during_rollout=false"],
}


class _Stop(Exception):
    """Ends a run after --steps steps (train.max_steps stays the config's, which auto decisions read)."""


def variant_overrides(spec: str, T: int) -> tuple[str, list[str]]:
    """(name, overrides) of a --variants entry, with {longest} and max(a,b) evaluated."""
    name, _, custom = spec.partition("=")
    items = VARIANTS[name] if not custom else [s for s in custom.split(",") if s]
    if name not in VARIANTS and not custom:
        raise SystemExit(f"unknown variant {name!r}: use one of {sorted(VARIANTS)} or NAME=key=value,...")
    out = []
    for item in items:
        item = item.replace("{longest}", str(MAX_PROMPT + T))
        item = re.sub(r"max\((\d+),(\d+)\)", lambda m: str(max(int(m[1]), int(m[2]))), item)
        out.append(item)
    return name, out


def base_overrides(model_dir: Path, T: int, a: argparse.Namespace, out_dir: Path) -> list[str]:
    """What every variant sets: the model, data, reward and the step's shape (the user's part of a config), and
    the bench's quiet logging."""
    return [
        f"model.name_or_path={model_dir}", "data.task=gsm8k", "data.split=sample",
        "reward.reward_funcs=[bench.bench_e2e:distinct_chars]", f"train.prompts_per_step={a.prompts}",
        f"rollout.num_generations={a.G}", f"rollout.max_completion_length={T}", f"rollout.max_prompt_length={MAX_PROMPT}",
        "train.skip_zero_advantage=false", f"train.output_dir={out_dir}", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false", "logging.log_completions=false", "checkpoint.save_steps=0",
        "checkpoint.save_at_end=false",
    ]


# ------------------------------------------------------------------------------ worker: one variant per process


def truncate_decode(tokens: int) -> None:
    """--probe-decode N: in this process the static engine decodes N steps of each wave, into its full-length
    cache, and the rest of each row is drawn uniformly from the tokenizer's regular vocabulary (never an
    end-of-sequence id; the sampler's logprob of those tokens is the row's mean), so the update trains on rows of
    the full T tokens. A memory probe at a long T then holds what a real step holds, the step's KV caches, waves
    and micro-batches, in minutes instead of the hour a full decode of 16 x 8 rows of 32K tokens takes; its
    generate seconds, rewards and mismatch are not a real step's (bench_plan records the probe as such)."""
    import dataclasses

    from logitless.models.routing import no_route
    from logitless.rollout.static import StaticEngine

    decode = StaticEngine._decode_wave

    def short_wave(self, module, call, rows, prompt_of_row, pad_to):  # noqa: ANN001, ANN202 - the engine's own
        S = call.options.max_new_tokens
        if S <= tokens:
            return decode(self, module, call, rows, prompt_of_row, pad_to)
        short = dataclasses.replace(call, options=dataclasses.replace(call.options, max_new_tokens=tokens))
        ids, logp, steps, routes = decode(self, module, short, rows, prompt_of_row, pad_to)
        fill = torch.randint(0, self.tokenizer.vocab_size, (ids.shape[0], S - steps), device=ids.device)
        if call.eos.numel():
            fill = torch.where(torch.isin(fill, call.eos), torch.zeros_like(fill), fill)
        mean = logp.mean(1, keepdim=True) if steps else torch.zeros_like(logp[:, :1])
        if routes is not None:  # the drawn tokens were never routed: the sentinel ("no route") after the decoded ones
            routes = torch.cat([routes, routes.new_full((routes.shape[0], S - steps, *routes.shape[2:]),
                                                        no_route(routes.dtype))], 1)
        return torch.cat([ids, fill], 1), torch.cat([logp, mean.expand(-1, S - steps)], 1), S, routes

    StaticEngine._decode_wave = short_wave


def worker(a: argparse.Namespace) -> None:
    from logitless.trainer import load_train_config, train

    if a.probe_decode:
        truncate_decode(a.probe_decode)
    if a.memory_budget and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.memory_budget * 2**30 / total))
    name, overrides = variant_overrides(a.variant, a.T)
    error, t0 = None, time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        sets = base_overrides(Path(a.model_dir), a.T, a, Path(run_dir) / "run") + overrides + a.set
        if a.memory_budget and name == "auto":
            sets.append(f"train.memory_budget_gib={a.memory_budget}")

        def stop_after(event: str, step: int) -> None:
            if event == "step_start" and step > a.steps:
                raise _Stop

        try:
            train(load_train_config(None, sets), hook=stop_after)
        except _Stop:
            pass
        except torch.OutOfMemoryError as e:
            error = f"out of memory: {str(e).splitlines()[0]}"
        run = Path(run_dir) / "run"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
            if (run / "metrics.jsonl").is_file() else []
        resolved = json.loads((run / "resolved.json").read_text()) if (run / "resolved.json").is_file() else None
    steps = [{
        "step": r["step"], "seconds": {p: r.get(f"time/{p}", 0.0) for p in PHASES},
        "peak_gib": {p: r.get(f"memory/peak_gb/{p}") for p in PHASES},
        "predicted_gib": {p: r.get(f"memory/predicted_gb/{p}") for p in PHASES},
        "oom_retries": r.get("memory/oom_retries", 0.0), "rollout_tokens_per_s": r.get("tokens_per_s"),
        "mfu": r.get("train/mfu"), "completion_tokens": r["completion/length_mean"] * a.prompts * a.G,
    } for r in records]
    Path(a.worker_out).write_text(json.dumps({"variant": name, "overrides": overrides, "steps": steps,
                                              "resolved": resolved, "error": error,
                                              "wall_s": time.perf_counter() - t0}, indent=1))


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians over the steps after the first; peaks are the largest of any step; the plan's peak per phase."""
    steps = res["steps"]
    steady = steps[1:] or steps
    med = lambda f: statistics.median(f(s) for s in steady)  # noqa: E731
    out = {"step_s": med(lambda s: sum(s["seconds"].values())),
           **{f"{p}_s": med(lambda s, p=p: s["seconds"][p]) for p in PHASES}}
    for p in PHASES:
        peaks = [s["peak_gib"][p] for s in steps if s["peak_gib"][p] is not None]
        out[f"peak_gib_{p}"] = max(peaks) if peaks else None
        pred = [s["predicted_gib"][p] for s in steps if s["predicted_gib"][p] is not None]
        out[f"step_predicted_gib_{p}"] = max(pred) if pred else None
    plan = (res.get("resolved") or {}).get("plan") or {}
    out["plan_gib"] = plan.get("predicted_gib")
    out["peak_gib"] = max((v for k, v in out.items() if k.startswith("peak_gib_") and v is not None), default=None)
    out["oom_retries"] = sum(s["oom_retries"] or 0 for s in steps)
    out["mfu"] = statistics.median([s["mfu"] for s in steady if s["mfu"] is not None] or [math.nan])
    return out


def run_variant(a: argparse.Namespace, spec: str, T: int, model_dir: Path, steps: int,
                probing: bool = False) -> dict[str, Any]:
    """One variant at completion length T in a worker process (`probing`: a memory probe, --probe-decode applies)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = Path(f.name)
    cmd = [sys.executable, __file__, "--worker", "--variant", spec, "--T", str(T), "--model-dir", str(model_dir),
           "--worker-out", str(path), "--steps", str(steps), "--prompts", str(a.prompts), "--G", str(a.G),
           "--memory-budget", str(a.memory_budget or 0), "--probe-decode", str(a.probe_decode if probing else 0)] + \
        [x for s in a.set for x in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, env=env, cwd=REPO)
    res = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else {"steps": [], "error": None}
    path.unlink(missing_ok=True)
    if proc.returncode != 0 and not res.get("error"):
        res["error"] = f"worker exited with {proc.returncode}"
    res.update({"T": T, "spec": spec})
    if res["steps"]:
        res["summary"] = summarize(res)
    s = res.get("summary")
    print(f"{spec.split('=')[0]:8s} T={T:6d}: " + (json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                                               for k, v in s.items()}) if s else
                                                    f"FAILED ({res.get('error')})"), flush=True)
    return res


def verdict(runs: list[dict[str, Any]], budget: float | None) -> dict[str, Any]:
    """The acceptance checks: auto's step time against the fastest hand-tuned variant that ran, and (under a
    budget) auto's measured peak against its plan."""
    ok = {r["variant"]: r["summary"] for r in runs if r.get("summary")}
    out: dict[str, Any] = {}
    hand = {k: v["step_s"] for k, v in ok.items() if k != "auto"}
    if "auto" in ok and hand:
        best = min(hand, key=hand.get)
        out["auto_vs_fastest_hand"] = {"fastest": best, "ratio": ok["auto"]["step_s"] / hand[best],
                                       "within_10_percent": ok["auto"]["step_s"] <= 1.10 * hand[best]}
    if "auto" in ok and ok["auto"]["plan_gib"]:
        plan_peak = max(ok["auto"]["plan_gib"].values())
        measured = ok["auto"]["peak_gib"]
        out["auto_peak_vs_plan"] = {"measured_gib": measured, "plan_gib": plan_peak,
                                    "error": measured / plan_peak - 1,
                                    "within_15_percent": abs(measured / plan_peak - 1) <= 0.15,
                                    "fits_budget": budget is None or measured <= budget}
    return out


def compare(paths: list[str]) -> dict[str, Any]:
    """`verdict` over the runs of several result files (same shape, budget and step), per T."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    keys = ("shape", "prompts", "G", "memory_budget_gib")
    if len({tuple(r["config"].get(k) for k in keys) for r in results}) > 1:
        raise SystemExit(f"--compare: the files differ in {keys}; compare runs of one configuration")
    budget = results[0]["config"].get("memory_budget_gib")
    by_T: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        for run in r.get("runs", []):
            by_T.setdefault(run["T"], []).append(run)
    devices = sorted({r["info"]["device"] for r in results})
    return {"devices": devices, "checks": {T: verdict(runs, budget) for T, runs in sorted(by_T.items())}}


def probe(a: argparse.Namespace, spec: str, T: int, model_dir: Path) -> dict[str, Any]:
    """One memory probe: --probe-steps steps of `spec` at T (--probe-decode applies), whether they ran under the
    budget, their peak and the plan's."""
    r = run_variant(a, spec, T, model_dir, steps=a.probe_steps, probing=True)
    s = r.get("summary") or {}
    return {"T": T, "ok": bool(r["steps"]) and not r.get("error"), "peak_gib": s.get("peak_gib"),
            "plan_gib": s.get("plan_gib"), "peak_gib_per_phase": {p: s.get(f"peak_gib_{p}") for p in PHASES},
            "resolved": {c["key"]: c["value"] for c in (r.get("resolved") or {}).get("choices", [])},
            "step_s": s.get("step_s"), "completion_tokens": max((x["completion_tokens"] for x in r["steps"]), default=0),
            "error": r.get("error")}


def find_max_T(a: argparse.Namespace, spec: str, model_dir: Path, lo: int, hi: int,
               saved: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """Longest T (to --resolution) whose one-step probe runs under the budget: from `lo` (which must fit), double
    while it fits (up to --max-T-cap, the context window less the prompt), then bisect. `saved` gets the search so
    far after each probe (a call cut by a time limit keeps them)."""
    out: dict[str, Any] = {"max_T": None, "probes": [], "done": False}

    def fits(T: int) -> bool:
        out["probes"].append(probe(a, spec, T, model_dir))
        saved(out)
        return out["probes"][-1]["ok"]

    if not fits(lo):
        return {**out, "done": True}
    while True:  # double up to the cap (the context window): fitting there ends the search
        if lo >= a.max_T_cap:
            return {**out, "max_T": lo, "capped": True, "done": True}
        nxt = min(hi, a.max_T_cap)
        if not fits(nxt):
            hi = nxt
            break
        lo, hi = nxt, nxt * 2
        out["max_T"] = lo
    while hi - lo > a.resolution:
        mid = (lo + hi) // 2 // a.resolution * a.resolution
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        out["max_T"] = lo
    return {**out, "max_T": lo, "done": True}


# ------------------------------------------------------------------------------ no GPU: the plan's own numbers

GSM8K_SAMPLE_PROMPT = 166  # longest GSM8K-sample prompt in the Qwen2.5 chat template (tokens; --tokenizer recounts)
DEVICE_GIB = {"H200": 139.8, "H100": 79.1}  # total memory of the recorded runs' GPUs (torch's view)
# Recorded commits from before the current memory layout: LoRA computed in fp32 by default (until f12a697) and,
# before 8b9068a, a merged copy resident beside the model. The plan models today's defaults: their runs are
# printed (marked "old") but not checked.
OLDER_LAYOUT = {"e1840a4", "d563d04", "5278ce2", "82560a0", "0d4a846", "8b9068a", "fd00fae"}


@functools.lru_cache(maxsize=None)
def skeleton(shape: str) -> torch.nn.Module:
    """A Qwen2.5-shaped model on the meta device (bf16): the plan reads its shapes, no memory is allocated."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151_936, max_position_embeddings=32_768, **SHAPES[shape])
    with torch.device("meta"):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def longest_prompt(tokenizer: str | None) -> int:
    """The longest prompt of the packaged GSM8K sample in the chat template (the bench's data)."""
    if not tokenizer:
        return GSM8K_SAMPLE_PROMPT
    from transformers import AutoTokenizer

    from logitless.data import load_task

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return max(len(tok.apply_chat_template(r.prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"]) for r in load_task("gsm8k", "sample"))


def predict_max_T(a: argparse.Namespace) -> dict[str, Any]:
    """The longest T (to --resolution) whose automatic plan fits --memory-budget, by the plan's prediction."""
    from logitless.trainer import load_train_config
    from logitless.trainer.memory.auto import resolve

    model = skeleton(a.shape)
    best, T = None, a.resolution
    while T <= a.max_T_cap:
        sets = base_overrides(Path("unused"), T, a, Path("unused")) + a.set + [f"train.memory_budget_gib={a.memory_budget}"]
        res = resolve(load_train_config(None, sets), device=torch.device("cuda"), skeleton=model)
        if not res.plan.fits:
            break
        best = {"T": T, "predicted_gib": {k: round(v, 2) for k, v in mp_json(res)["predicted_gib"].items()},
                "settings": {c.key: c.value for c in res.choices}, "waves": res.plan.waves}
        T += a.resolution
    print(json.dumps({"shape": a.shape, "budget_gib": a.memory_budget, "max_T": best}, indent=1))
    return {"max_T": best}


def mp_json(res: Any) -> dict[str, Any]:
    from logitless.trainer.memory import plan as mp

    return mp.to_json(res.plan)


def recorded_prediction(result: dict[str, Any], run: dict[str, Any], prompt_len: int) -> dict[str, Any] | None:
    """Predicted peak per phase of one recorded bench_e2e run of logitless (its shape, overrides and budget; the
    settings "auto" resolved where the run recorded them, else the defaults of its time: nothing auto; bench_e2e's
    multi-turn runs as episodes), beside the measured one; None for runs the plan does not model (several GPUs, a
    rollout device, train.fsdp_offload)."""
    import dataclasses

    from logitless.trainer import load_train_config
    from logitless.trainer.memory import plan as mp
    from logitless.trainer.memory.auto import model_memory, run_facts, setting_text

    c, shape = result.get("config"), record_shape(result)
    if shape is None or run.get("system") != "logitless" or not run.get("steps") or shape not in SHAPES:
        return None
    overrides = list(c.get("overrides") or [])
    if any(o.split("=")[0] in ("train.fsdp_offload", "rollout.device") for o in overrides):
        return None
    T, prompts, G = run["T"], c["prompts"], c["G"]
    then = ["rollout.backend=static", "model.gradient_checkpointing=true", "model.activation_offload=false",
            "model.compile_layers=false", "model.liger_kernels=false", "train.packed=false",
            "train.micro_batch_tokens=null", "train.offload_during_rollout=false", "model.lora_compute=autocast"]
    turns, completion = int(c.get("turns") or 1), T
    if turns > 1:  # bench_e2e's synthetic agent: T model tokens a row and (turns - 1) observations
        completion = T + (turns - 1) * int(c.get("obs_tokens") or 0)
        then += ["agent.tools=[calculator]", f"agent.max_turns={turns}"]
    # a run that recorded its resolved settings ("auto" decided them): those, as the run used them
    resolved = [f"{x['key']}={setting_text(x['value'])}" for x in (run.get("resolved") or {}).get("choices", [])
                if x["key"] != "train.memory_budget_gib"]
    sets = ["data.task=gsm8k", f"rollout.num_generations={G}", f"rollout.max_completion_length={completion}",
            f"train.prompts_per_step={prompts}", f"train.micro_batch_size={c.get('micro_batch') or 8}",
            f"model.lora={not str(c.get('tuning', '')).startswith('full')}", *then, *resolved, *overrides]
    try:
        cfg = load_train_config(None, sets)
    except ValueError:  # a key of an older version
        return None
    model = skeleton(shape)
    kernels = "compiled" if cfg.model.compile_layers else "liger" if cfg.model.liger_kernels else "eager"
    mem = model_memory(model, cfg.model, torch.bfloat16)
    device = next((k for k in DEVICE_GIB if k in str(result.get("info", {}).get("device", "H200"))), "H200")
    budget = (c.get("memory_budget_gib") or DEVICE_GIB[device]) * mp.GIB
    step = mp.StepShape(prompts=prompts, rows=prompts * G, prompt_len=prompt_len, completion_len=completion,
                        context=32_768, episodes=turns > 1)
    facts = run_facts(cfg, "static", kernels, torch.device("cuda"))
    knobs = mp.knobs_of(cfg)
    if knobs.max_kv_gib is None:  # the engine's own cap: 85 % of the memory free when the rollout starts
        rest = mp.generate_bytes(mem, step, facts, dataclasses.replace(knobs, max_kv_gib=0.0))
        free = budget - sum(v for k, v in rest.items() if k not in ("kv cache", "sampler"))
        row = step.cache_len * mem.kv_bytes_per_token + mp.SAMPLER_BYTES_PER_VOCAB * mem.vocab
        rows = min(step.rows, int(0.85 * free // row))
        waves = -(-step.rows // max(rows, 1))
        knobs = dataclasses.replace(knobs, max_kv_gib=-(-step.rows // waves) * step.cache_len * mem.kv_bytes_per_token / mp.GIB)
    predicted = mp.predict(mem, step, facts, knobs)
    measured = {p: max(s["peak_gib"].get(p, 0.0) for s in run["steps"]) for p in ("generate", "logprobs", "train")}
    return {"T": T, "overrides": overrides, "commit": result.get("info", {}).get("commit"),
            "predicted_gib": {p: sum(v.values()) / mp.GIB for p, v in predicted.items()}, "measured_gib": measured}


def check_recorded(paths: list[str], prompt_len: int) -> list[dict[str, Any]]:
    """Predicted against measured peaks of every recorded logitless run the plan models."""
    rows = []
    for path in sorted(paths):
        result = json.loads(Path(path).read_text())
        runs = result.get("runs") if isinstance(result.get("runs"), list) else []
        for run in runs:
            pred = recorded_prediction(result, run, prompt_len) if isinstance(run, dict) else None
            if pred is not None:
                rows.append({"file": Path(path).name, **pred,
                             "checked": str(pred["commit"]).split()[0] not in OLDER_LAYOUT})
    return rows


def check_plan_records(paths: list[str]) -> list[dict[str, Any]]:
    """The plan's peak per phase (today's memory model) of every run bench_plan recorded (its shape, overrides and
    the settings "auto" resolved, pinned), beside the largest measured in any of its steps."""
    rows = []
    for path in sorted(paths):
        result = json.loads(Path(path).read_text())
        shape, runs = record_shape(result), result.get("runs")
        if shape is None or not isinstance(runs, list):
            continue
        # each timed run, and the memory probes (--fits-T, --find-max-T) that ran: one step at their T
        measured = [(run["T"], run["variant"], {x["key"]: x["value"] for x in run["resolved"]["choices"]},
                     {p: max(s["peak_gib"].get(p) or 0.0 for s in run["steps"]) for p in PHASES})
                    for run in runs
                    if not run.get("error") and run.get("steps") and (run.get("resolved") or {}).get("choices")]
        probes = [(v, p) for v, by_T in (result.get("fits") or {}).items() for p in by_T.values()]
        probes += [(v, p) for v, search in (result.get("max_T") or {}).items() for p in search.get("probes", [])]
        measured += [(p["T"], f"{v} probe", p["resolved"], p["peak_gib_per_phase"]) for v, p in probes
                     if p.get("ok") and p.get("resolved") and p.get("peak_gib_per_phase")]
        for T, variant, settings, peaks in measured:
            predicted = _plan_gib(result["config"], shape, T, settings)
            rows.append({"file": Path(path).name, "T": T, "variant": variant, "shape": shape,
                         "predicted_gib": predicted, "measured_gib": {p: peaks.get(p) or 0.0 for p in predicted},
                         "checked": True})
    return rows


def record_shape(result: dict[str, Any]) -> str | None:
    """The Qwen2.5 shape ("1.5b", "7b") a bench result file's config names, or None."""
    c = result.get("config")
    m = re.search(r"Qwen2\.5-(\w+(?:\.\d+)?b)", str(c.get("shape", ""))) if isinstance(c, dict) else None
    return m[1] if m else None


def _plan_gib(c: dict[str, Any], shape: str, T: int, settings: dict[str, Any]) -> dict[str, float]:
    """The plan's peak per phase (GiB) of a recorded bench_plan step: its config `c`, T and the settings it resolved
    (pinned)."""
    from logitless.trainer import load_train_config
    from logitless.trainer.memory import plan as mp
    from logitless.trainer.memory.auto import resolve, setting_text

    a = argparse.Namespace(prompts=c["prompts"], G=c["G"])
    pinned = [f"{k}={setting_text(v)}" for k, v in settings.items()]
    sets = base_overrides(Path("unused"), T, a, Path("unused")) + list(c.get("overrides") or []) + pinned
    res = resolve(load_train_config(None, sets), device=torch.device("cuda"), skeleton=skeleton(shape))
    return {p: sum(v.values()) / mp.GIB for p, v in res.plan.phases.items()}


def print_recorded(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        cells = []
        for p in ("generate", "train"):
            pred, meas = r["predicted_gib"][p], r["measured_gib"][p]
            cells.append(f"{p} {pred:6.2f}/{meas:6.2f} ({100 * (pred / meas - 1):+5.1f} %)")
        print(f"{r['file'][:62]:62s} T={r['T']:5d} " + "  ".join(cells) + ("" if r["checked"] else "  old"))


# ------------------------------------------------------------------------------ driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="folder of the Qwen2.5 tokenizer")
    ap.add_argument("--out", help="folder for the results JSON")
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--T", default="1024", help="completion lengths, comma-separated")
    ap.add_argument("--variants", default="auto,hand,fast,fast16k", help="comma-separated names (see the docstring)")
    ap.add_argument("--custom", action="append", default=[], metavar="NAME=key=value,...",
                    help="one more variant: its name and overrides (repeatable)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--memory-budget", type=float, default=0, help="GiB: auto plans for it, every process is capped")
    ap.add_argument("--find-max-T", action="store_true")
    ap.add_argument("--fits-T", default="", metavar="T,...",
                    help="one probe per variant at each of these T (no search: several GPUs probe side by side)")
    ap.add_argument("--predict-max-T", action="store_true", help="no GPU: the plan's own longest T in the budget")
    ap.add_argument("--check-recorded", action="store_true", help="no GPU: predicted vs measured of bench/results")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="the checks over results of several commands")
    ap.add_argument("--probe-steps", type=int, default=1)
    ap.add_argument("--probe-decode", type=int, default=0, metavar="N",
                    help="--find-max-T / --fits-T probes decode N tokens a row into the full-length cache and fill "
                         "the rest at random (memory as a real step, minutes instead of an hour at 32K; 0: off)")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--max-T-cap", type=int, default=32_256, help="the bench shapes' context is 32,768 tokens")
    ap.add_argument("--lo-T", type=int, default=4096)
    ap.add_argument("--hi-T", type=int, default=8192)
    ap.add_argument("--set", action="append", default=[], help="an override for every variant (key=value)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--commit", default="", help="the code's commit, where the checkout has no git metadata")
    add_worker_options(ap, "--variant")
    a = ap.parse_args()
    if a.worker:
        a.T = int(a.T)
        return worker(a)
    if a.check_recorded:
        rows = check_recorded([str(p) for p in (REPO / "bench" / "results").glob("e2e_*.json")],
                              longest_prompt(a.tokenizer))
        print_recorded(rows)
        print_recorded(check_plan_records([str(p) for p in (REPO / "bench" / "results").glob("plan_*.json")]))
        return None
    if a.compare:
        print(json.dumps(compare(a.compare), indent=1))
        return None
    if a.predict_max_T:
        if not a.memory_budget:
            ap.error("--predict-max-T needs --memory-budget")
        predict_max_T(a)
        return None
    if not (a.tokenizer and a.out):
        ap.error("--tokenizer and --out are required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [v for v in a.variants.split(",") if v] + a.custom
    model_dir = make_model_dir(a.shape, a.tokenizer, Path(tempfile.mkdtemp()))
    result: dict[str, Any] = {
        "info": {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "versions": versions(), "commit": a.commit or commit(), "date": time.strftime("%Y-%m-%d")},
        "config": {"shape": f"Qwen2.5-{a.shape} shape, random init, bf16", "tuning": "LoRA r16 all-linear",
                   "prompts": a.prompts, "G": a.G, "steps": a.steps, "memory_budget_gib": a.memory_budget or None,
                   "overrides": a.set, "variants": {v.split("=")[0]: v for v in specs},
                   "loss": "dapo, beta=0", "reward": "distinct_chars", "data": "gsm8k packaged sample, chat template"},
        "runs": [], "max_T": {},
    }
    budget = f"_budget{a.memory_budget:g}" if a.memory_budget else ""
    names = "-".join(s.split("=")[0] for s in specs)
    mode = "_maxT" if a.find_max_T else "_fits" if a.fits_T else ""
    name = f"plan_{a.shape}{budget}{mode}_{names}{('_' + a.tag) if a.tag else ''}.json"
    if a.probe_decode and (a.find_max_T or a.fits_T):
        result["config"]["probe_decode"] = a.probe_decode

    def save() -> None:  # after every run and probe: a call cut by its time limit keeps what ran
        (out / name).write_text(json.dumps(result, indent=1, default=str))

    if a.find_max_T:
        for spec in specs:
            key = spec.split("=")[0]

            def saved(so_far: dict[str, Any], key: str = key) -> None:
                result["max_T"][key] = so_far
                save()

            found = find_max_T(a, spec, model_dir, a.lo_T, a.hi_T, saved)
            saved(found)
            print(f"{key}: max T = {found['max_T']}", flush=True)
    elif a.fits_T:
        for spec in specs:
            key = spec.split("=")[0]
            for T in (int(t) for t in a.fits_T.split(",")):
                p = result.setdefault("fits", {}).setdefault(key, {})[str(T)] = probe(a, spec, T, model_dir)
                save()
                print(f"{key} T={T}: {'fits' if p['ok'] else 'does not fit'} ({p['error'] or p['peak_gib']})", flush=True)
    else:
        for T in (int(t) for t in a.T.split(",")):
            runs = [run_variant(a, spec, T, model_dir, a.steps) for spec in specs]
            result["runs"] += runs
            checks = verdict(runs, a.memory_budget or None)
            result.setdefault("checks", {})[str(T)] = checks
            save()
            print(f"T={T}: {json.dumps(checks)}", flush=True)
    save()
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
