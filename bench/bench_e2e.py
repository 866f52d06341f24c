"""One GRPO step, side by side: logitless against TRL's GRPOTrainer (dense, and with `use_liger_kernel`), on
random-init models of real shapes (Qwen2.5 0.5B / 1.5B / 7B) with the real tokenizer.

Every configuration runs in its own process (clean CUDA memory, no shared compile caches). Per step it records
seconds split into generate / score / old-ref logprobs / train, completion tokens, peak GPU memory of each
phase, rollout tokens/s with its share of the HBM-bandwidth ceiling, and the update's MFU; both definitions are
in `logitless/trainer/report/accounting.py` and are applied to TRL's steps too (from the prompt and completion lengths
TRL generated).

A random model writes random text, so the reward is `distinct_chars` (distinct characters / 100): it varies
between samples, so advantages are non-zero and every step really trains. Both systems get the same prompts
(GSM8K questions in the chat template), LoRA r16 on all linear layers (or full fine-tuning), gradient
checkpointing, DAPO, beta = 0, one optimizer step per rollout batch.

    python bench/bench_e2e.py --tokenizer TOKENIZER_DIR --out DIR --systems logitless,trl,trl_liger --T 1024
    python bench/bench_e2e.py ... --systems logitless,trl --memory-budget 24 --find-max-T
    python bench/bench_e2e.py ... --shape tiny --systems logitless      # CPU smoke run
    python bench/bench_e2e.py ... --systems logitless --shape qwen3-8b --qlora --update-only --one-long-row \
        --prompts 1 --G 2 --micro 1 --steps 1 --T 130816 --prompt-tokens 256 --set model.mlp_chunk_tokens=8192

`--update-only` (bench/update_probe.py) measures the update of a step at T without decoding T tokens first: the
completions are given (random tokens of length T), the trainer's own step runs on them; its results are labelled
`"probe": "update-only"`, beside the full-step probe (the default). `--shape` also takes the shapes of other
families (Qwen3-8B, Llama-3.1-8B) and mixtures of experts (qwen3-30b-a3b, gpt-oss-20b, olmoe-1b-7b: LoRA on the
attention layers, and on the experts too with `--set model.lora_target_experts=true`, for TRL as for logitless;
olmoe-1b-7b needs its own, GPT-NeoX, tokenizer, or `--update-only`), `--qlora` trains LoRA on 4-bit weights
(bitsandbytes, CUDA only); gradient checkpointing, activation offload and the tiled MLP are trainer settings
(`--set model.activation_offload=true`, `--set model.mlp_chunk_tokens=8192`, `--set model.gradient_checkpointing=false`).

TRL 1.16's `use_liger_kernel` applies Liger's layer kernels (RMSNorm, SwiGLU, RoPE); its per-token logprobs
always go through TRL's own chunked fused lm_head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import update_probe  # noqa: E402
from bench.synthetic_agent import SyntheticAgent  # noqa: E402
from bench.torch_profile import StepProfiler  # noqa: E402

SHAPES = {  # Qwen2.5 shapes (vocab 151,936); "tiny" checks the script on CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False),
}
BUILT_IN_DTYPE = {"32b", "72b"}  # shapes initialized in bf16 directly (in fp32 the 32B shape takes 128 GB)
PHASES = ("generate", "score", "logprobs", "train")


def distinct_chars(prompts: list[Any], completions: list[Any], **row_fields: Any) -> list[float]:
    """A reward that varies on random text (TRL passes chat completions as message lists)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [len(set(t)) / 100 for t in texts]


def make_model_dir(shape: str, tokenizer_dir: str, root: Path, any_tokenizer: bool = False) -> Path:
    """A random-init model of a Qwen2.5 shape (SHAPES) or another family's (update_probe.FAMILY_SHAPES) with the
    real tokenizer, saved as a local folder (`any_tokenizer`: one of another family, for update-only probes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = root / (f"qwen2.5-{shape}-random" if shape in SHAPES else f"{shape}-random")
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if shape in SHAPES:
        cfg = Qwen2Config(vocab_size=151_936, max_position_embeddings=32_768, **SHAPES[shape])
    else:
        cfg = update_probe.family_config(shape, len(tokenizer), any_tokenizer)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (Qwen2.5 shapes: initialized as before)
        if shape in SHAPES and shape not in BUILT_IN_DTYPE:
            model = Qwen2ForCausalLM(cfg).to(dtype)
        elif shape in SHAPES:  # fp32 first would not fit the GPU
            model = Qwen2ForCausalLM._from_config(cfg, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    partial = out.with_name(out.name + ".partial")  # renamed when complete: a folder cut short is never reused
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    del model  # the workers run on this GPU too: hand the memory back
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def prompts(n: int) -> list[Any]:
    """GSM8K questions of the packaged sample, in logitless's gsm8k prompt format (chat messages)."""
    from logitless.data import load_task

    rows = load_task("gsm8k", "sample")
    return [rows[i % len(rows)].prompt for i in range(n)]


def versions() -> dict[str, str]:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("trl", "liger_kernel", "peft", "triton"):
        try:
            out[name] = version(name.replace("_", "-"))  # liger_kernel has no __version__
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def commit() -> str:
    """HEAD of the repository (`--commit` overrides it where the tree was copied without its git metadata)."""
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def add_worker_options(ap: argparse.ArgumentParser, role: str) -> None:
    """The hidden options by which a bench command starts itself as a worker process for one configuration:
    `role` names the option that picks the configuration (bench_e2e's --system, bench_plan's --variant)."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(role, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)


# ---------------------------------------------------------------- workers: one configuration per process


def run_logitless(a: argparse.Namespace, model_dir: Path, out_dir: Path) -> list[dict[str, Any]]:
    from logitless.trainer import load_train_config, train

    sets = [
        f"model.name_or_path={model_dir}", f"model.lora={not a.full}", "model.gradient_checkpointing=true",
        "data.task=gsm8k", "data.split=sample", "reward.reward_funcs=[bench.bench_e2e:distinct_chars]",
        f"rollout.backend={a.backend}", f"rollout.num_generations={a.G}", f"rollout.max_completion_length={a.T}",
        "rollout.max_prompt_length=512", "objective.loss_type=dapo", "objective.beta=0.0",
        f"train.max_steps={a.steps}", f"train.prompts_per_step={a.prompts}", f"train.micro_batch_size={a.micro}",
        "train.skip_zero_advantage=false", f"train.output_dir={out_dir}", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false", "logging.log_completions=false",
        "checkpoint.save_steps=0", "checkpoint.save_at_end=false",
        *(["model.load_in_4bit=true"] if a.qlora else []),
        *(update_probe.settings(a.prompt_tokens) if a.update_only else []), *a.set,
    ]
    if a.update_only:  # completions given, not decoded (bench/update_probe.py)
        update_probe.install(a.prompt_tokens, a.T, a.one_long_row)
    if a.turns > 1:  # the episode path with a synthetic environment (SyntheticAgent)
        import logitless.trainer.context as context

        os.environ.update(BENCH_TURNS=str(a.turns), BENCH_TURN_TOKENS=str(a.T // a.turns), BENCH_OBS_TOKENS=str(a.obs_tokens))
        context.Agent = SyntheticAgent
        sets += ["agent.tools=[calculator]", f"agent.max_turns={a.turns}",
                 f"rollout.max_completion_length={a.T + (a.turns - 1) * a.obs_tokens}"]
    profiler = StepProfiler(a.torch_profile, a.torch_profile_windows.split(",")) if a.torch_profile else None
    res = train(load_train_config(None, sets), hook=profiler)
    a.torch_tables = profiler.summary() if profiler is not None else None
    resolved = out_dir / "resolved.json"  # the settings the run decided ("auto" ones included)
    a.resolved = json.loads(resolved.read_text()) if resolved.is_file() else None
    steps = []
    for r in res.records:
        tokens = r["completion/length_mean"] * a.prompts * a.G
        steps.append({
            "step": r["step"], "completion_tokens": tokens,
            "seconds": {p: r.get(f"time/{p}", 0.0) for p in PHASES},
            "peak_gib": {p: r.get(f"memory/peak_gb/{p}", 0.0) for p in PHASES},
            "rollout_tokens_per_s": r["tokens_per_s"], "ceiling_fraction": r.get("rollout/ceiling_fraction"),
            "mfu": r.get("train/mfu"), "limit_s": r.get("step/limit_s"),
            # rollout.profile=true: seconds of each decode part; the merged-LoRA copy's size
            "rollout_parts_s": {k[8:-2]: v for k, v in r.items() if k.startswith("rollout/") and k.endswith("_s")},
            "weights_copy_gib": r.get("rollout/weights_copy_gib"),
            "replica_gib": r.get("rollout/replica_gib"),  # the static backend's replica (sharded, rollout.device)
            "rollout_device_peak_gib": r.get("memory/rollout_device_peak_gb"),  # rollout.device: that GPU's peak
            "mismatch_mean": r.get("rollout/mismatch_mean"), "mismatch_max": r.get("rollout/mismatch_max"),
            "turns_mean": r.get("episode/turns_mean"), "env_tokens_mean": r.get("tokens/env_mean"),
            "oom_retries": r.get("memory/oom_retries", 0.0),  # > 0: the step ran with leaner settings than asked
        })
    return steps


class _Phases:
    """Times and peaks of TRL's phases, by wrapping its methods (measurement only: the calls are unchanged)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.lengths: list[tuple[int, int]] = []

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kw: Any) -> Any:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            torch.cuda.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            self.peak[phase] = max(self.peak.get(phase, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            if phase == "generate":
                self.lengths += [(len(p), len(c)) for p, c in zip(out[0], out[1])]
            if phase == "rollout_total":  # the train phase's peak is taken from here to the step's end
                torch.cuda.reset_peak_memory_stats()
            return out

        setattr(obj, name, timed)


def trl_lora(model: Any, experts: bool = False) -> Any:
    """TRL's LoraConfig: r16 on the layers logitless adapts (all-linear; `experts`: and the fused expert stacks,
    model.lora_target_experts). For a mixture of experts the linear layers are listed by name: peft would turn
    "all-linear" into LoRA on the experts and the router there (its rewrite for transformers-4 adapters, which
    logitless turns off, trainer/policy/lora_targets.py add_lora), and TRL's run would train other adapters than logitless's."""
    from peft import LoraConfig

    from logitless.models.experts import is_moe
    from logitless.trainer.config.schema import ModelConfig
    from logitless.trainer.checks.model import linear_names
    from logitless.trainer.policy.lora_targets import lora_config

    if not is_moe(model):
        return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    return lora_config(ModelConfig(lora_r=16, lora_alpha=32, lora_target_modules=linear_names(model),
                                   lora_target_experts=experts), model)


def run_trl(a: argparse.Namespace, model_dir: Path, out_dir: Path, liger: bool) -> list[dict[str, Any]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from logitless.trainer.report.accounting import ModelShape, decode_ideal_seconds, device_peaks, update_flops

    B = a.prompts * a.G
    args = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=a.micro, gradient_accumulation_steps=B // a.micro,
        num_generations=a.G, max_completion_length=a.T, learning_rate=1e-5, loss_type="dapo", beta=0.0,
        bf16=True, gradient_checkpointing=True, max_steps=a.steps, logging_steps=1, report_to="none",
        save_strategy="no", use_liger_kernel=liger, temperature=1.0, seed=0, num_iterations=1,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    peft_config = None if a.full else trl_lora(model, "model.lora_target_experts=true" in a.set)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[distinct_chars], args=args, peft_config=peft_config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts(a.prompts * max(a.steps, 4))]),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    ph = _Phases()
    ph.wrap(trainer, "_generate", "generate")
    ph.wrap(trainer, "_calculate_rewards", "score")
    ph.wrap(trainer, "_generate_and_score_completions", "rollout_total")
    shape, (peak_flops, hbm) = ModelShape.of(trainer.model), device_peaks(torch.device("cuda"))
    steps: list[dict[str, Any]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            ph.seconds, ph.peak, ph.lengths = {}, {}, []
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            total = time.perf_counter() - self.t0
            s = ph.seconds
            logprobs = s.get("rollout_total", 0.0) - s.get("generate", 0.0) - s.get("score", 0.0)
            train_s = total - s.get("rollout_total", 0.0)
            p_lens, t_lens = [p for p, _ in ph.lengths], [t for _, t in ph.lengths]
            flops = update_flops(shape, ph.lengths)
            steps.append({
                "step": len(steps) + 1, "completion_tokens": sum(t_lens),
                "seconds": {"generate": s.get("generate", 0.0), "score": s.get("score", 0.0),
                            "logprobs": logprobs, "train": train_s},
                "peak_gib": {"generate": ph.peak.get("generate", 0.0), "score": ph.peak.get("score", 0.0),
                             "logprobs": ph.peak.get("rollout_total", 0.0),
                             "train": torch.cuda.max_memory_allocated() / 2**30},
                "rollout_tokens_per_s": sum(t_lens) / max(s.get("generate", 1e-9), 1e-9),
                "ceiling_fraction": decode_ideal_seconds(shape, p_lens, t_lens, hbm) / max(s.get("generate", 1e-9), 1e-9),
                "mfu": flops / max(train_s, 1e-9) / peak_flops,
                "limit_s": decode_ideal_seconds(shape, p_lens, t_lens, hbm) + flops / peak_flops,
            })
            print(f"trl step {len(steps)}: {total:.1f} s", flush=True)

    trainer.add_callback(Clock())
    trainer.train()
    return steps


def worker(a: argparse.Namespace) -> None:
    model_dir, out = Path(a.model_dir), Path(a.worker_out)
    if a.memory_budget and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.memory_budget * 2**30 / total))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    error = None
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            if a.system == "logitless":
                steps = run_logitless(a, model_dir, Path(run_dir))
            else:
                steps = run_trl(a, model_dir, Path(run_dir), liger=a.system == "trl_liger")
        except torch.OutOfMemoryError as e:
            steps, error = [], f"out of memory: {str(e).splitlines()[0]}"
    # (the step's peak is the largest phase peak: the phase clocks reset the allocator's peak counters)
    out.write_text(json.dumps({"steps": steps, "error": error, "wall_s": time.perf_counter() - t0,
                               "resolved": getattr(a, "resolved", None),
                               "torch_profile": getattr(a, "torch_tables", None)}, indent=1))


# ---------------------------------------------------------------- driver


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steady steps (the first step compiles and warms up)."""
    steady = steps[1:] or steps
    med = lambda f: statistics.median(f(s) for s in steady)  # noqa: E731
    total = med(lambda s: sum(s["seconds"].values()))
    out = {"step_s": total, **{f"{p}_s": med(lambda s, p=p: s["seconds"][p]) for p in PHASES}}
    out.update({f"peak_gib_{p}": max(s["peak_gib"][p] for s in steps) for p in PHASES})
    out["peak_gib"] = max(out[f"peak_gib_{p}"] for p in PHASES)
    out["completion_tokens"] = med(lambda s: s["completion_tokens"])
    out["step_tokens_per_s"] = out["completion_tokens"] / total
    rollout_gpu = [s["rollout_device_peak_gib"] for s in steps if s.get("rollout_device_peak_gib") is not None]
    out["rollout_device_peak_gib"] = max(rollout_gpu) if rollout_gpu else None  # rollout.device: its own GPU
    for k in ("rollout_tokens_per_s", "ceiling_fraction", "mfu", "mismatch_mean", "mismatch_max", "turns_mean",
              "env_tokens_mean", "limit_s"):
        vals = [s[k] for s in steady if s.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    # the step against its physical limit on this GPU: decode at the HBM bandwidth plus the update at peak FLOP/s
    out["x_limit"] = total / out["limit_s"] if out["limit_s"] else None
    return out


def run_config(a: argparse.Namespace, system: str, T: int, model_dir: Path, steps: int | None = None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = Path(f.name)
    cmd = [sys.executable, __file__, "--worker", "--system", system, "--T", str(T), "--model-dir", str(model_dir),
           "--worker-out", str(path), "--steps", str(steps or a.steps), "--prompts", str(a.prompts), "--G", str(a.G),
           "--micro", str(a.micro), "--backend", a.backend, "--memory-budget", str(a.memory_budget or 0)]
    cmd += ["--full"] if a.full else []
    cmd += ["--qlora"] if a.qlora else []
    cmd += ["--update-only", "--prompt-tokens", str(a.prompt_tokens)] if a.update_only else []
    cmd += ["--one-long-row"] if a.one_long_row else []
    cmd += ["--turns", str(a.turns), "--obs-tokens", str(a.obs_tokens), "--torch-profile", str(a.torch_profile),
            "--torch-profile-windows", a.torch_profile_windows]
    for s in a.set:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, env=env, cwd=REPO)
    res = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else {"steps": [], "error": None}
    path.unlink(missing_ok=True)
    if proc.returncode != 0 and not res.get("error"):
        res["error"] = f"worker exited with {proc.returncode}"
    if any(s.get("oom_retries") for s in res["steps"]):  # what fitted is not the configuration asked for
        res["error"] = "out of memory with the settings asked for: the trainer retried leaner (steps[].oom_retries)"
    res.update({"system": system, "T": T, "probe": PROBE[a.update_only]})
    if a.update_only:
        res["row_tokens"] = a.prompt_tokens + T  # the longest row (prompt + completion)
    if res["steps"]:
        res["summary"] = summarize(res["steps"])
    print(f"{system:10s} [{res['probe']}] T={T:6d}: "
          + (json.dumps(res.get("summary")) if res["steps"] else "FAILED")
          + (f" ({res['error']})" if res.get("error") else ""), flush=True)
    return res


SAME_CONFIG = ("shape", "tuning", "prompts", "G", "micro_batch", "backend", "memory_budget_gib", "overrides", "probe")
PROBE = {False: "full step", True: "update-only"}  # update-only: completions given, not decoded (update_probe.py)


def known_probes(paths: list[str], system: str, config: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Probe outcomes of earlier bench_e2e.py results (their `max_T` probes and their runs) for `system`, so that a
    bisection can go on across several commands. A run counts when it ended with steps (fits) or out of memory
    (does not); one cut short otherwise decides nothing. The files must share this run's configuration."""
    known: dict[int, dict[str, Any]] = {}
    config = {"probe": PROBE[False], **config}  # (results before update-only probes were all full steps)
    for path in paths:
        res = json.loads(Path(path).read_text())
        theirs = {"probe": PROBE[False], **res.get("config", {})}
        for key in SAME_CONFIG:
            if key in theirs and theirs[key] != config[key] and not (key == "overrides" and system != "logitless"):
                raise SystemExit(f"--probes-from {path}: its config.{key}={theirs[key]!r} differs from this run's "
                                 f"{config[key]!r}; use results of the same configuration, or drop the file")
        entries = [dict(p, reused_from=path) for p in res.get("max_T", {}).get(system, {}).get("probes", [])]
        for r in res.get("runs", []):
            if r.get("system") == system:
                oom = str(r.get("error") or "").startswith("out of memory")
                entries.append({"T": r["T"], "ok": False if oom else True if r.get("steps") else None,
                                "peak_gib": r.get("summary", {}).get("peak_gib"), "error": r.get("error"), "reused_from": path})
        known.update({e["T"]: e for e in entries if e.get("ok") is not None})
    return known


def find_max_T(a: argparse.Namespace, system: str, model_dir: Path, lo: int, hi: int,
               known: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Longest T whose step runs within the budget, to --resolution: from `lo` (which must fit), double `hi`
    while it fits, then bisect. Each probe is a fresh process running --probe-steps steps; a T in `known`
    (earlier results, --probes-from) is not run again."""
    probes = []

    def fits(T: int) -> bool:
        if known and T in known:
            probes.append(known[T])
            return bool(known[T]["ok"])
        r = run_config(a, system, T, model_dir, steps=a.probe_steps)
        ok = bool(r["steps"]) and not r.get("error")  # (a step retried with leaner settings did not fit)
        probes.append({"T": T, "ok": ok, "peak_gib": r.get("summary", {}).get("peak_gib"), "error": r.get("error")})
        return ok

    if not fits(lo):
        return {"max_T": None, "probes": probes}
    while hi <= a.max_T_cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, a.max_T_cap * 2)
    while hi - lo > a.resolution:
        mid = (lo + hi) // 2 // a.resolution * a.resolution
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"max_T": lo, "probes": probes}


def shape_name(shape: str) -> str:
    return f"Qwen2.5-{shape}" if shape in SHAPES else shape


def tuning(a: argparse.Namespace) -> str:
    experts = " + experts" if "model.lora_target_experts=true" in a.set else ""
    return "full" if a.full else f"QLoRA r16 all-linear{experts} (NF4)" if a.qlora else f"LoRA r16 all-linear{experts}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="folder of the Qwen2.5 tokenizer")
    ap.add_argument("--out", help="folder for the results JSON")
    ap.add_argument("--systems", default="logitless,trl,trl_liger")
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES) + sorted(update_probe.FAMILY_SHAPES))
    ap.add_argument("--T", default="1024", help="completion lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA r16")
    ap.add_argument("--qlora", action="store_true", help="LoRA r16 on 4-bit (NF4) weights: model.load_in_4bit=true "
                    "(bitsandbytes, CUDA only)")
    ap.add_argument("--update-only", action="store_true", help="probe the update alone: completions given as random "
                    "tokens of length T instead of decoded (logitless only; bench/update_probe.py)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="--update-only: random prompt tokens per prompt")
    ap.add_argument("--one-long-row", action="store_true", help="--update-only: only the first sample of each "
                    "prompt gets T tokens, its group's others one token (one long row updated per prompt)")
    ap.add_argument("--backend", default="static", help="logitless rollout backend")
    ap.add_argument("--memory-budget", type=float, default=0, help="GiB (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--find-max-T", action="store_true")
    ap.add_argument("--probe-steps", type=int, default=1)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--max-T-cap", type=int, default=32_768)
    ap.add_argument("--lo-T", type=int, default=1024, help="--find-max-T starts here (must fit)")
    ap.add_argument("--hi-T", type=int, default=2048, help="--find-max-T's first probe above --lo-T")
    ap.add_argument("--probes-from", action="append", default=[], metavar="JSON",
                    help="earlier results of the same configuration whose probes --find-max-T reuses (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="extra logitless config override key=value")
    ap.add_argument("--turns", type=int, default=1, help="logitless: N-turn episodes of T // N model tokens a turn "
                    "(SyntheticAgent), with --obs-tokens environment tokens after each turn but the last")
    ap.add_argument("--obs-tokens", type=int, default=64)
    ap.add_argument("--torch-profile", type=int, default=0, metavar="STEP", help="logitless: torch.profiler tables "
                    "of step STEP's rollout and update in the result (bench/torch_profile.py); 0: none")
    ap.add_argument("--torch-profile-windows", default="rollout,update", help="--torch-profile: which windows of "
                    "the step to profile (rollout, update or both: the rollout alone keeps the profiled step short)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--model-root", default="", help="folder for the random-init model, reused by later commands "
                    "(default: a new temporary folder)")
    ap.add_argument("--commit", default="", help="the code's commit, where the checkout has no git metadata of its own")
    add_worker_options(ap, "--system")
    a = ap.parse_args()
    if a.worker:
        a.T = int(a.T)
        return worker(a)
    if not (a.tokenizer and a.out):
        ap.error("--tokenizer and --out are required")
    if (refused := update_probe.refusal(a)) is not None:  # before a model is built
        ap.error(refused)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_root = Path(a.model_root) if a.model_root else Path(tempfile.mkdtemp())
    model_dir = make_model_dir(a.shape, a.tokenizer, model_root, any_tokenizer=a.update_only)
    result: dict[str, Any] = {
        "info": {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "versions": versions(), "commit": a.commit or commit(), "date": time.strftime("%Y-%m-%d")},
        "config": {"shape": f"{shape_name(a.shape)} shape, random init, bf16", "tuning": tuning(a),
                   "probe": PROBE[a.update_only],
                   **({"prompt_tokens": a.prompt_tokens, "one_long_row": a.one_long_row,
                       "tokenizer": Path(a.tokenizer).name} if a.update_only else {}),
                   "prompts": a.prompts, "G": a.G, "micro_batch": a.micro, "steps": a.steps, "backend": a.backend,
                   "memory_budget_gib": a.memory_budget or None, "overrides": a.set,
                   "turns": a.turns, "obs_tokens": a.obs_tokens if a.turns > 1 else 0,
                   "gradient_checkpointing": "model.gradient_checkpointing=false" not in a.set,
                   "loss": "dapo, beta=0", "reward": "distinct_chars", "data": "gsm8k packaged sample, chat template",
                   **(update_probe.CONFIG if a.update_only else {})},
        "runs": [], "max_T": {},
    }
    systems = a.systems.split(",")
    if a.find_max_T:
        for system in systems:
            known = known_probes(a.probes_from, system, result["config"])
            result["max_T"][system] = find_max_T(a, system, model_dir, a.lo_T, a.hi_T, known)
            print(f"{system}: max T = {result['max_T'][system]['max_T']}", flush=True)
    else:
        for T in (int(t) for t in a.T.split(",")):
            for system in systems:
                result["runs"].append(run_config(a, system, T, model_dir))
    kind = ("_full" if a.full else "_qlora" if a.qlora else "") + ("_update" if a.update_only else "")
    name = f"e2e_{a.shape}{kind}{'_maxT' if a.find_max_T else ''}{('_' + a.tag) if a.tag else ''}.json"
    (out / name).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
