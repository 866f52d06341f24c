"""End-to-end GRPO training steps on one GPU: time split (generate / score / train) and peak memory per
rollout backend, for a random-init Qwen2.5-shaped model with LoRA and real GSM8K prompts.

A random model writes random text, so the reward is `distinct_chars` below (the number of distinct characters
of a completion / 100): it varies between samples, so advantages are non-zero and every step really trains.
Writes one JSON with every step's metrics.

    python bench/bench_train.py --tokenizer DIR_WITH_QWEN2.5_TOKENIZER --out DIR [--shape 1.5b] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from logitless.trainer import load_train_config, train

SHAPES = {  # Qwen2.5 shapes (vocab 151,936, tied embeddings); "tiny" checks the script on CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}


def distinct_chars(prompts: list[str], completions: list[str], **row_fields) -> list[float]:
    """A reward that varies on random text, so that the benchmark's update steps do real work."""
    return [len(set(c)) / 100 for c in completions]


def make_model_dir(shape: str, tokenizer_dir: str, root: Path) -> Path:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    cfg = Qwen2Config(vocab_size=151_936, max_position_embeddings=4096, tie_word_embeddings=True, **SHAPES[shape])
    out = root / f"qwen2.5-{shape}-random"
    Qwen2ForCausalLM(cfg).to(dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--backends", default="hf,static")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    model_dir = make_model_dir(args.shape, args.tokenizer, tmp)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    result = {
        "info": {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                 "transformers": transformers.__version__, "commit": commit or "unknown"},
        "shape": {"model": f"Qwen2.5-{args.shape} shape, random init, bf16, LoRA r16 all-linear",
                  "prompts_per_step": args.prompts, "G": args.G, "max_completion_length": args.tokens,
                  "data": "gsm8k packaged sample (chat template)", "steps": args.steps},
        "backends": {},
    }
    for backend in args.backends.split(","):
        cfg = load_train_config(None, [
            f"model.name_or_path={model_dir}", "data.task=gsm8k", "data.split=sample",
            "reward.reward_funcs=[bench.bench_train:distinct_chars]",
            f"rollout.backend={backend}", f"rollout.num_generations={args.G}",
            f"rollout.max_completion_length={args.tokens}", f"train.max_steps={args.steps}",
            f"train.prompts_per_step={args.prompts}", "train.micro_batch_size=32",
            f"train.output_dir={tmp / ('run-' + backend)}", "logging.progress=false", "checkpoint.save_steps=1000",
        ])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        res = train(cfg)
        records = [r for r in res.records if "time/generate" in r]
        steady = records[1:] or records  # step 1 includes compile / warm-up
        med = {k: statistics.median(r[k] for r in steady) for k in ("time/generate", "time/score", "time/train")}
        result["backends"][backend] = {
            "median_s_after_first_step": med,
            "first_step_generate_s": records[0]["time/generate"] if records else None,
            "peak_gib": max(r.get("memory/peak_gb", 0.0) for r in records) if records else None,
            "records": records,
        }
        print(f"{backend:8s} generate {med['time/generate']:.2f} s  score {med['time/score']:.3f} s  "
              f"train {med['time/train']:.2f} s  peak {result['backends'][backend]['peak_gib']:.1f} GiB  "
              f"(first-step generate {result['backends'][backend]['first_step_generate_s']:.1f} s)", flush=True)
    (out / f"train_{args.shape}.json").write_text(json.dumps(result, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
