"""Time and peak memory of loading a large JSON-lines prompt file, as `logitless train` loads it.

    python bench/bench_data.py --rows 1000000 --out DIR [--file FILE] [--chat] [--check]

Writes a synthetic file of `--rows` rows (GSM8K-like: a ~150-character question, a numeric answer, an id and a
source tag; made once, seeded) unless `--file` names one, then loads it in a fresh child process through
`logitless.trainer.builders.load_rows` (data.task=jsonl), as a run does before its model loads; with `--check` it
then checks every prompt's length against the limit (`check_prompt_lengths`, as a run does after its tokenizer
loads; the demo's SmolLM2 tokenizer and 8192 positions). Reports wall seconds (load and check) and the child's peak
RSS. Prints one JSON record and writes it to DIR/data_load_<rows>[_chat][_check].json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from logitless.trainer.builders import check_prompt_lengths, load_rows, sampling_options
from logitless.trainer.config.schema import DataConfig
from logitless.trainer.demo import demo_config

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

path, chat, check = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
if check:  # the demo's tokenizer (SmolLM2, byte-level BPE) and its 8192 positions, loaded before the clock starts
    from transformers import AutoConfig
    from logitless.trainer.policy.modeling import load_tokenizer

    cfg = demo_config()
    tokenizer = load_tokenizer(cfg.model)

    class Model:  # the prompt check reads only the model's context window
        config = AutoConfig.for_model("llama", max_position_embeddings=8192)

before = rss_mib()
t0 = time.perf_counter()
rows = load_rows(DataConfig(task="jsonl", options={"path": path, "prompt_field": "question", "chat": chat}))
load_s = time.perf_counter() - t0
if check:
    check_prompt_lengths(rows, tokenizer, Model(), sampling_options(cfg.rollout, seed=None), "data")
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"rows": len(rows), "seconds": round(seconds, 2), "load_seconds": round(load_s, 2),
                  "check_seconds": round(seconds - load_s, 2) if check else None, "peak_rss_mib": round(peak),
                  "rss_before_mib": round(before), "rss_after_mib": round(rss_mib())}))
"""


def write_rows(path: Path, n: int) -> None:
    """`n` GSM8K-like rows: question (~150 chars), answer, id, source; seeded, so every run writes the same file."""
    rng = random.Random(0)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina"]
    things = ["clips", "apples", "books", "marbles", "stickers", "cookies", "pencils", "shells"]
    with path.open("w") as f:
        for i in range(n):
            a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
            name, thing = rng.choice(names), rng.choice(things)
            q = (f"{name} sold {thing} to {a} of her friends in April, and then she sold {b} more {thing} in May, "
                 f"{c} times as many as before. How many {thing} did {name} sell altogether?")
            f.write(json.dumps({"id": i, "question": q, "answer": str(a + b * c), "source": "synthetic"}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--out", required=True, help="folder for the data file (unless --file) and the result")
    ap.add_argument("--file", help="an existing JSONL file with a 'question' field instead of the synthetic one")
    ap.add_argument("--chat", action="store_true", help="chat prompts (data.options.chat=true) instead of raw text")
    ap.add_argument("--check", action="store_true",
                    help="then check every prompt's length as a run does before training (the demo's tokenizer)")
    ap.add_argument("--tag", default="", help="appended to the result's file name")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(args.file) if args.file else out / f"prompts_{args.rows}.jsonl"
    if not path.is_file():
        t0 = time.perf_counter()
        write_rows(path, args.rows)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    flags = ["1" if args.chat else "0", "1" if args.check else "0"]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), *flags], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(file_mib=round(path.stat().st_size / 2**20), chat=args.chat, check=args.check,
                  python=sys.version.split()[0])
    print(json.dumps(result))
    name = f"data_load_{args.rows}{'_chat' if args.chat else ''}{'_check' if args.check else ''}{args.tag}.json"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
