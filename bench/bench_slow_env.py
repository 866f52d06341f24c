"""Slow environments (issue 55): the static engine's episode rollout with an environment whose step takes 100 ms,
against the same episodes with a 0 ms step, on CPU, in one process.

    python bench/bench_slow_env.py [--rows 32] [--turns 4] [--delay-ms 100] [--repeats 5] [--out F.json]

A tiny Llama (byte vocabulary, random weights) plays `--turns`-turn episodes through the built-in `AgentDriver` and
an environment class whose `step` sleeps `--delay-ms` and answers " ok." (done after the last turn). A model turn
ends at one of a few turn-end ids (random weights: about `--turn-tokens` tokens on average). The same seed gives
the same tokens whatever the delay (checked), so the runs time the same episodes. Modes, interleaved per repeat:

- fast: 0 ms steps; slow: `--delay-ms` steps, answered while the other rows decode (`AgentDriver.submit/ready`);
- slow_blocking: the same steps through `respond`, which holds the decode until the steps of the rows whose turns
  ended at that host check are done (what a driver without submit/ready gets).

Writes the median seconds of each mode, their ratios, every run's seconds and the machine to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from logitless.agents import Agent, AgentOptions  # noqa: E402
from logitless.data.prompts import PromptRow  # noqa: E402
from logitless.rollout import SamplingOptions, episodes, make_engine  # noqa: E402


class SleepyEnv:
    """Each step sleeps `delay_s` (a sandbox, a web call) and answers " ok."; done after `turns` steps."""

    def __init__(self, delay_s: float = 0.0, turns: int = 4):
        self.delay_s, self.turns = delay_s, turns

    def reset(self, row: dict) -> str | None:
        self.n = 0
        return None

    def step(self, text: str):
        time.sleep(self.delay_s)
        self.n += 1
        return " ok.", 1.0, self.n >= self.turns


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<pad>": len(vocab), "<eos>": len(vocab) + 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--turn-tokens", type=int, default=32, help="mean tokens of a model turn")
    ap.add_argument("--max-parallel-tools", type=int, default=8)
    ap.add_argument("--check-every", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = byte_tokenizer()
    S = args.turns * (3 * args.turn_tokens + 8)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=S + 64, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ends = list(range(max(1, len(tok) // args.turn_tokens)))  # ids that end a turn: ~1/turn_tokens of the vocabulary
    rows = [PromptRow(f"Episode {i}:", {"id": i}) for i in range(args.rows)]
    opts = SamplingOptions(num_generations=1, temperature=1.0, max_new_tokens=S, seed=args.seed, ignore_eos=True)
    engine = make_engine("static", model, tok, check_every=args.check_every)

    def run(delay_s: float, overlap: bool):
        agent = Agent(tok, AgentOptions(environment=SleepyEnv, env_options={"delay_s": delay_s, "turns": args.turns},
                                        format="raw", max_turns=args.turns, max_turn_tokens=3 * args.turn_tokens,
                                        max_parallel_tools=args.max_parallel_tools, tool_timeout_s=30))
        driver = agent.driver(rows, 1)
        driver.turn_end_ids = ends
        init = episodes.Replies.__init__

        def blocking(self, d, v):
            init(self, d, v)
            self.overlaps = False

        if not overlap:
            episodes.Replies.__init__ = blocking
        try:
            t0 = time.perf_counter()
            batch = engine.generate(driver.prompt_ids, opts, episodes=driver)
            return time.perf_counter() - t0, batch
        finally:
            episodes.Replies.__init__ = init

    load_start = os.getloadavg()
    delay = args.delay_ms / 1000
    modes = {"fast": (0.0, True), "slow": (delay, True), "slow_blocking": (delay, False)}
    run(0.0, True)  # warm-up
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    batches = {}
    for _ in range(args.repeats):
        for m, (d, overlap) in modes.items():
            s, batches[m] = run(d, overlap)
            seconds[m].append(s)
    same = all(torch.equal(batches["fast"].completion_ids, batches[m].completion_ids) for m in modes)
    turns = [r.turns for r in batches["fast"].episodes]
    model_tokens = int(batches["fast"].loss_mask().sum())
    med = {m: statistics.median(v) for m, v in seconds.items()}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    out = {
        "bench": "slow_env", "commit": commit,
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"max_new_tokens": S, "turn_end_ids": len(ends)},
        "episodes": {"turns_mean": sum(turns) / len(turns), "turns_min": min(turns), "model_tokens": model_tokens,
                     "same_tokens_in_every_mode": same},
        "median_s": med,
        "ratio_slow_over_fast": med["slow"] / med["fast"],
        "ratio_blocking_over_fast": med["slow_blocking"] / med["fast"],
        # per repeat (the runs of one repeat ran back to back, under the same load of the machine)
        "ratio_slow_over_fast_per_repeat_median": statistics.median(s / f for s, f in zip(seconds["slow"], seconds["fast"])),
        # what each episode waits for its own steps (turns x delay), against the fast run's median
        "episode_wait_s": args.turns * delay, "episode_wait_over_fast": args.turns * delay / med["fast"],
        "runs_s": seconds,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": tf.__version__,
                    "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
                    # other processes share this machine's CPUs: the 1-minute load average at the start and end
                    "loadavg_1min_start_end": [load_start[0], os.getloadavg()[0]]},
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
