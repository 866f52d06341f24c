"""Benchmark of the GRPO objective (`logitless.objectives.policy_loss`) against the fused token-logprob op.

The objective is plain torch over [B, T] tensors; this script shows what it costs next to the op that
produces its input at the same training shapes. Timed per micro-batch (median, p20, p80 of `--reps` runs
after `--warmup` runs, synchronized wall clock):

* objective fwd+bwd: `policy_loss(logp, mask, adv, options, normalizer, ...)` then `loss.backward()` into
  the [B, T] logp leaf (and entropy leaf when the entropy bonus is on), for several option sets
  ("dapo" = TRL default; "grpo_kl" = grpo + β·k3; "gspo" = sequence-level ratio; "all" = dapo with
  sequence-level sampler IS, KL, off-policy mask, top-entropy mask and entropy bonus);
* op fwd+bwd: `token_logprobs(hidden [N, H], weight [V, H], targets [N], with_entropy=...)` of the N =
  mask.sum() completion tokens, trainable head, then a sum of logp (and entropy) backward.

Peak extra memory (CUDA) = max_memory_allocated during one run minus memory_allocated before it.

Usage: python bench/bench_objective.py [--small] [--device cpu|cuda] [--out DIR]
  --small: tiny shapes that run in seconds on a CPU (smoke test); default: training shapes (needs a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitless.objectives import (  # noqa: E402
    ObjectiveOptions,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    loss_normalizer,
    policy_loss,
)

CONFIGS = {
    "dapo": dict(loss_type="dapo"),
    "grpo_kl": dict(loss_type="grpo", beta=0.04),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "all": dict(loss_type="dapo", epsilon_high=0.28, beta=0.04, sampler_is_mode="sequence_mask",
                sampler_is_sequence_reduction="product", off_policy_mask_threshold=0.5,
                top_entropy_quantile=0.8, entropy_coef=0.01),
}
# (B, T) micro-batch shapes; model dims (H, V) of Qwen2.5-0.5B/1.5B-like heads.
TRAIN_SHAPES = [(16, 1024), (8, 4096), (64, 1024)]
TRAIN_HV = [(896, 151_665), (1536, 151_665)]
SMALL_SHAPES = [(8, 64), (4, 256)]
SMALL_HV = [(64, 4096)]


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def measure(step, dev, warmup, reps):
    for _ in range(warmup):
        step()
    _sync(dev)
    times, peak = [], 0.0
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
        if dev == "cuda":
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
    q = statistics.quantiles(times, n=5) if len(times) > 1 else times * 4
    return dict(median_ms=statistics.median(times), p20_ms=q[0], p80_ms=q[3], peak_extra_gib=peak)


def objective_inputs(b, t, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    logp = -torch.rand(b, t, generator=g) * 3
    d = dict(
        logp=logp, mask=mask, adv=torch.randn(b, generator=g),
        old_logp=logp + 0.05 * torch.randn(b, t, generator=g), ref_logp=logp + 0.1 * torch.randn(b, t, generator=g),
        sampler_logp=logp + 0.05 * torch.randn(b, t, generator=g), entropy=torch.rand(b, t, generator=g) * 2,
    )
    return {k: v.to(dev) for k, v in d.items()}


def objective_step(name, inp):
    opts = ObjectiveOptions(**CONFIGS[name])
    norm = loss_normalizer(opts, [inp["mask"]])
    logp = inp["logp"].clone().requires_grad_()
    ent = inp["entropy"].clone().requires_grad_(opts.entropy_coef > 0)
    kw = dict(old_logp=inp["old_logp"], entropy=ent)
    if opts.beta:
        kw["ref_logp"] = inp["ref_logp"]
    if opts.sampler_is or opts.off_policy_mask_threshold is not None:
        kw["sampler_logp"] = inp["sampler_logp"]
    if opts.top_entropy_quantile < 1.0:  # one threshold and bonus token count over the step, as the trainer
        kw["entropy_threshold"] = entropy_quantile_threshold(ent, inp["mask"], opts.top_entropy_quantile)
    if opts.entropy_coef > 0:
        kw["entropy_normalizer"] = entropy_bonus_normalizer(opts, [inp["mask"]], entropies=[ent],
                                                            threshold=kw.get("entropy_threshold"))

    def step():
        logp.grad = None
        out = policy_loss(logp, inp["mask"], inp["adv"], opts, norm, **kw)
        out.loss.backward()

    return step


def op_step(n, h, v, dev, with_entropy):
    from logitless.ops import token_logprobs

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hidden = (torch.randn(n, h, device=dev) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=dev) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device=dev)

    def step():
        hidden.grad = weight.grad = None
        logp, ent = token_logprobs(hidden, weight, targets, with_entropy=with_entropy)
        (logp.sum() + (ent.sum() if ent is not None else 0.0)).backward()

    return step


def env_info(dev):
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        commit = None
    return dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                commit=commit, threads=torch.get_num_threads())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke test")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--no-op", action="store_true", help="skip timing the fused op")
    ap.add_argument("--out", default=None, help="folder for a JSON result file")
    args = ap.parse_args()
    dev = args.device
    shapes, hvs = (SMALL_SHAPES, SMALL_HV) if args.small else (TRAIN_SHAPES, TRAIN_HV)
    warmup = args.warmup if args.warmup is not None else (1 if args.small else 5)
    reps = args.reps if args.reps is not None else (3 if args.small else 20)
    info = env_info(dev)
    print(json.dumps(info), flush=True)
    rows = []
    for b, t in shapes:
        inp = objective_inputs(b, t, dev)
        n = int(inp["mask"].sum())
        for name in args.configs.split(","):
            r = measure(objective_step(name, inp), dev, warmup, reps)
            rows.append(dict(kind="objective", config=name, B=b, T=t, N=n, **r))
            print(json.dumps(rows[-1]), flush=True)
        if not args.no_op:
            for h, v in hvs:
                for ent in (False, True):
                    r = measure(op_step(n, h, v, dev, ent), dev, warmup, reps)
                    rows.append(dict(kind="op", config=f"H{h}_V{v}{'+ent' if ent else ''}", B=b, T=t, N=n, **r))
                    print(json.dumps(rows[-1]), flush=True)
                    if dev == "cuda":
                        torch.cuda.empty_cache()
    print("\n| kind | config | B×T | N | median ms | p20–p80 ms | peak extra GiB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['config']} | {r['B']}×{r['T']} | {r['N']} | {r['median_ms']:.3f} | "
              f"{r['p20_ms']:.3f}–{r['p80_ms']:.3f} | {r['peak_extra_gib']:.3f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = "objective_small" if args.small else "objective"
        (out / f"{tag}_{dev}.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))


if __name__ == "__main__":
    main()
