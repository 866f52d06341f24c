"""Benchmark of the fused token-logprob op against dense torch and Liger-Kernel (one process, one GPU).

What is timed (CUDA events, median / p20 / p80 of `--reps` runs after `--warmup` runs; grads set to None
between runs, outside the timed region):

* fwd+bwd modes ("trainable": hidden and lm_head weight need grad; "frozen": only hidden needs grad):
  logp = op(hidden, weight, targets) -> GRPO token-level clipped surrogate (eps=0.2, DAPO normalization:
  sum over tokens / number of tokens, old logp and per-sequence advantages given) -> loss.backward().
  With "+ent", entropy is also computed and `- 0.01 * mean(entropy)` is added to the loss (both outputs
  receive gradients); with "+entm" entropy is computed as a metric only (detached, no gradient).
  "trainable+onp": the on-policy step of GRPO with one update per batch: the library's `policy_loss`
  (loss_type="dapo", same eps) with old logp = logp.detach(), so every ratio is 1.
* "triton_hint" (only in "+onp" modes) = the Triton op given `grad_hint` = `on_policy_logp_grad(...)`, the
  loss gradient that is known before the forward on-policy (its computation is timed too): the forward
  forms the gradients, 3 GEMMs in all instead of 4. "triton_hint32": the same with grad_W accumulated in fp32
  across the row chunks (`HINT_FP32_ACCUMULATE`) instead of in bf16.
* "forward" modes: logp (and entropy) under torch.no_grad() (old/ref log-probs).
* op variants: "dense" = the oracle `logitless.ops.reference` (F.linear -> fp32 logsumexp -> gather);
  "dense_lsm" = F.linear -> .float() -> log_softmax -> gather (fp32 softmax);
  "dense_bf16" = TRL's path for a bf16 model: F.linear -> bf16 logits -> per-sequence bf16 log_softmax -> gather
  (`selective_log_softmax`; the fastest and leanest dense variant, and the least accurate);
  "chunked" / "triton" = `logitless.ops.token_logprobs(backend=...)`; "liger" = `LigerFusedLinearGRPOLoss`
  (beta=0, no ref model, loss_type="dapo", same eps/temperature/old logp/advantages), whose fused loss
  replaces op + loss (no entropy, no forward-only mode).

Peak extra memory = torch.cuda.max_memory_allocated() during one run minus memory_allocated() before it
(inputs already allocated, grads None), so it includes the produced grads. Achieved TFLOP/s counts only the
minimal LM-head GEMMs (2·N·H·V each): 3 for trainable, 2 for frozen, 1 for forward.

Usage: python bench/bench_op.py --grid main|rest|all --out DIR [--check] [--check-main] [--sweep] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitless.ops import triton_op  # noqa: E402
from logitless.ops.reference import token_logprobs_reference  # noqa: E402
from logitless.ops.token_logprobs import token_logprobs  # noqa: E402

GIB = 1024**3
DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" only to smoke-test this script (TRITON_INTERPRET=1)
EPS = 0.2
ENT_COEF = 0.01
MODES = ("trainable", "frozen", "forward", "trainable+ent", "frozen+ent", "forward+ent")
# "+entm" modes (entropy computed as a metric, no gradient) are also accepted by --modes
GEMMS = {"trainable": 3, "frozen": 2, "forward": 1}


def _token_logprobs(hidden, weight, targets, bias, temperature, with_entropy, backend, grad_hint=None):
    if backend == "triton" and DEV != "cuda":  # smoke test: the kernels under TRITON_INTERPRET=1
        return triton_op.triton_token_logprobs(hidden, weight, targets, bias, temperature, with_entropy, grad_hint)
    return token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, with_entropy=with_entropy,
                          backend=backend, grad_hint=grad_hint)


def dense_lsm(hidden, weight, targets, bias, temperature, with_entropy):
    """Literal TRL-style dense: F.linear -> fp32 log_softmax -> gather (entropy from the same log-probs)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    lsm = torch.log_softmax(logits, dim=-1)  # [N, V]
    logp = lsm.gather(-1, targets.long()[:, None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1) if with_entropy else None
    return logp, ent


def dense_bf16(hidden, weight, targets, bias, temperature, with_entropy, seq):
    """TRL's bf16 path: F.linear -> logits in the model dtype -> per-sequence log_softmax in that dtype
    (`selective_log_softmax`'s loop over rows) -> gather; entropy as TRL's `entropy_from_logits`."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [N, V] bf16
    if temperature != 1.0:
        logits = logits / temperature
    rows = logits.view(-1, seq, logits.shape[-1])  # [B, T, V]
    tg = targets.long().view(-1, seq)
    logp, ent = [], []
    for r, t in zip(rows, tg):
        lsm = torch.log_softmax(r, dim=-1)  # [T, V] bf16
        logp.append(lsm.gather(-1, t[:, None]).squeeze(-1))
        if with_entropy:
            ent.append(-(lsm.exp() * lsm).sum(-1))
    return torch.cat(logp), (torch.cat(ent) if with_entropy else None)


def grpo_loss(logp, old_logp, adv, ent=None):
    """Token-level clipped surrogate with DAPO normalization; logp/old_logp [N], adv [N] (per-sequence, broadcast)."""
    ratio = torch.exp(logp - old_logp)
    per_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    loss = per_tok.sum() / logp.numel()
    if ent is not None:
        loss = loss - ENT_COEF * ent.mean()
    return loss


def make_inputs(n, h, v, seq, temperature, bias, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    dev, dt = DEV, torch.bfloat16
    hidden = torch.randn(n, h, device=dev, dtype=dt, generator=g)
    weight = (torch.randn(v, h, device=dev, dtype=dt, generator=g) * (2.0 / h**0.5)).to(dt)
    b = (torch.randn(v, device=dev, dtype=dt, generator=g) * 0.5) if bias else None
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    with torch.no_grad():
        lp, _ = _token_logprobs(hidden, weight, targets, b, temperature, False, "triton")
    old_logp = lp + 0.05 * torch.randn(n, device=dev, generator=g)
    adv_seq = torch.randn(n // seq, device=dev, generator=g)
    adv = adv_seq.repeat_interleave(seq)
    return dict(hidden=hidden, weight=weight, bias=b, targets=targets, old_logp=old_logp, adv=adv,
                adv_seq=adv_seq, seq=seq, temperature=temperature)


def make_step(variant, mode, inp):
    """A closure running one timed step of `variant` in `mode`, or raise if not applicable."""
    hid, w, b, tg = inp["hidden"], inp["weight"], inp["bias"], inp["targets"]
    T = inp["temperature"]
    ent = "+ent" in mode  # "+ent": entropy in the loss (gets a gradient); "+entm": entropy as a metric only
    ent_grad = mode.endswith("+ent")
    base = mode.split("+")[0]
    if base != "forward":
        hid.requires_grad_(True)
        w.requires_grad_(base == "trainable")
        if b is not None:
            b.requires_grad_(base == "trainable")
    else:
        for t in (hid, w, b):
            if t is not None:
                t.requires_grad_(False)

    if variant == "liger":
        if ent or base == "forward" or "+onp" in mode:
            raise NotImplementedError("liger: no entropy output, no forward-only mode")
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        seq = inp["seq"]
        bsz = hid.shape[0] // seq
        mod = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=EPS,
                                       epsilon_high=EPS, temperature=T)
        mask = torch.ones(bsz, seq, device=DEV, dtype=torch.long)
        ids = tg.view(bsz, seq)
        old = inp["old_logp"].view(bsz, seq)

        def step():
            out = mod(hid.view(bsz, seq, -1), w, ids, mask, inp["adv_seq"], bias=b, old_per_token_logps=old)
            out[0].backward()
        return step

    onp = "+onp" in mode
    if variant.startswith("triton_hint") and not onp:
        raise NotImplementedError("triton_hint: only on-policy (+onp) modes know the gradient before the forward")

    def op(*, grad, hint=None):
        if variant == "dense":
            return token_logprobs_reference(hid, w, tg, bias=b, temperature=T, with_entropy=ent)
        if variant == "dense_lsm":
            return dense_lsm(hid, w, tg, b, T, ent)
        if variant == "dense_bf16":
            return dense_bf16(hid, w, tg, b, T, ent, inp["seq"])
        if variant.startswith("triton_hint"):
            triton_op.HINT_FP32_ACCUMULATE = variant == "triton_hint32"
            return _token_logprobs(hid, w, tg, b, T, ent, "triton", hint)
        return _token_logprobs(hid, w, tg, b, T, ent, variant)

    if base == "forward":
        def step():
            with torch.no_grad():
                op(grad=False)
        return step

    if onp:
        from logitless.objectives import ObjectiveOptions, on_policy_logp_grad, policy_loss

        opts = ObjectiveOptions(loss_type="dapo", epsilon_low=EPS, epsilon_high=EPS)
        seq = inp["seq"]
        mask = torch.ones(hid.shape[0] // seq, seq, device=hid.device)
        n_tok = float(hid.shape[0])

        def step():
            hint = None
            if variant.startswith("triton_hint"):
                hint = on_policy_logp_grad(mask, inp["adv_seq"], opts, n_tok).view(-1)
            logp, _ = op(grad=True, hint=hint)
            policy_loss(logp.view(mask.shape), mask, inp["adv_seq"], opts, n_tok).loss.backward()
        return step

    def step():
        logp, e = op(grad=True)
        if e is not None and not ent_grad:
            e = e.detach().mean()  # metric: no gradient reaches the entropy output
            e = None
        grpo_loss(logp, inp["old_logp"], inp["adv"], e).backward()
    return step


def _empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def clear_grads(inp):
    for k in ("hidden", "weight", "bias"):
        if inp[k] is not None:
            inp[k].grad = None


def measure(step, inp, warmup, reps):
    for _ in range(warmup):
        step()
        clear_grads(inp)
    if DEV != "cuda":  # smoke test only
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
            clear_grads(inp)
        ms = (time.perf_counter() - t0) * 1e3 / reps
        return dict(median_ms=ms, p20_ms=ms, p80_ms=ms, peak_extra_gib=float("nan"), reps=reps)
    torch.cuda.synchronize()
    # memory: one run from a clean state
    _empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    clear_grads(inp)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        clear_grads(inp)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return dict(median_ms=statistics.median(times), p20_ms=q[1], p80_ms=q[7], peak_extra_gib=peak, reps=reps)


def env_info():
    info = dict(device=torch.cuda.get_device_name() if DEV == "cuda" else DEV, torch=torch.__version__,
                commit=os.environ.get("LOGITLESS_COMMIT", "unknown"))
    for mod in ("triton", "transformers", "liger_kernel"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", None) or _dist_version(mod)
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable: {exc.__class__.__name__}"
    return info


def _dist_version(mod):
    from importlib.metadata import version

    return version(mod.replace("_", "-"))


# (N, H, V, seq, temperature, bias). seq = tokens per sequence for Liger's [B, T] layout.
TINY = [(64, 32, 1003, 32, 0.7, True)]  # CPU smoke test
MAIN = [(32768, 2048, 151936, 8192, 1.0, False)]
REST = [
    (4096, 2048, 151936, 4096, 1.0, False),
    (131072, 2048, 151936, 8192, 1.0, False),
    (32768, 1536, 151936, 8192, 1.0, False),
    (32768, 4096, 151936, 8192, 1.0, False),
    (32768, 2048, 32000, 8192, 0.7, True),
    (32768, 2048, 128256, 8192, 0.7, False),
]


def run_grid(shapes, variants, modes, args, rows, info, save=lambda: None):
    for n, h, v, seq, temp, bias in shapes:
        inp = make_inputs(n, h, v, seq, temp, bias)
        for mode in modes:
            for variant in variants:
                if variant == "chunked" and n not in (32768, 64) and not args.all_chunked:
                    continue
                reps = args.liger_reps if variant == "liger" else args.reps
                rec = dict(info, N=n, H=h, V=v, seq=seq, temperature=temp, bias=bias, dtype="bfloat16",
                           variant=variant, mode=mode)
                try:
                    step = make_step(variant, mode, inp)
                    rec.update(measure(step, inp, args.warmup, reps))
                    flop = GEMMS[mode.split("+")[0]] * 2.0 * n * h * v
                    rec["tflops"] = flop / (rec["median_ms"] * 1e-3) / 1e12
                except NotImplementedError:
                    continue
                except torch.OutOfMemoryError:
                    rec["error"] = "OOM"
                except Exception as exc:  # noqa: BLE001 - record and go on (e.g. Liger compile errors)
                    rec["error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
                clear_grads(inp)
                _empty_cache()
                rows.append(rec)
                save()  # partial results survive a timeout
                print(_fmt(rec), flush=True)
        del inp
        _empty_cache()


def _fmt(r):
    head = f"N={r['N']:>6} H={r['H']} V={r['V']} T={r['temperature']} bias={int(r['bias'])} {r['mode']:<14} {r['variant']:<8}"
    if "error" in r:
        return f"{head} {r['error']}"
    return (f"{head} {r['median_ms']:8.1f} ms [{r['p20_ms']:.1f}, {r['p80_ms']:.1f}] "
            f"{r['peak_extra_gib']:6.2f} GiB {r['tflops']:6.0f} TFLOP/s")


def markdown(rows):
    """One line per (shape, mode): ms and GiB for each variant, plus triton / dense ratios."""
    keys = []
    for r in rows:
        k = (r["N"], r["H"], r["V"], r["temperature"], r["bias"], r["mode"])
        if k not in keys:
            keys.append(k)
    variants = ["dense", "dense_lsm", "dense_bf16", "chunked", "liger", "triton", "triton_hint", "triton_hint32"]
    out = ["| N | H | V | T | mode | " + " | ".join(f"{v} ms (GiB)" for v in variants)
           + " | ours / best dense time | ours / leanest dense mem |",
           "|" + "---|" * (5 + len(variants) + 2)]
    for k in keys:
        cell, got = [], {}
        for v in variants:
            r = next((r for r in rows if (r["N"], r["H"], r["V"], r["temperature"], r["bias"], r["mode"]) == k
                      and r["variant"] == v), None)
            if r is None:
                cell.append("–")
            elif "error" in r:
                cell.append(r["error"].split(":")[0])
            else:
                got[v] = r
                cell.append(f"{r['median_ms']:.1f} ({r['peak_extra_gib']:.2f})")
        rt = rm = "–"
        dense = [got[d] for d in ("dense", "dense_lsm", "dense_bf16") if d in got]
        ours = [got[x] for x in ("triton", "triton_hint", "triton_hint32") if x in got]
        if dense and ours:  # our fastest variant vs the fastest / leanest dense variant
            best = min(ours, key=lambda r: r["median_ms"])
            rt = f"{best['median_ms'] / min(d['median_ms'] for d in dense):.2f}"
            rm = f"{best['peak_extra_gib'] / min(d['peak_extra_gib'] for d in dense):.3f}"
        n, h, v, t, b, mode = k
        out.append(f"| {n} | {h} | {v}{' +bias' if b else ''} | {t} | {mode} | " + " | ".join(cell) + f" | {rt} | {rm} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", choices=["main", "rest", "all", "dense", "dense_rest", "none", "tiny"], default="main")
    ap.add_argument("--variants", default="dense,chunked,liger,triton")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--liger-reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--all-chunked", action="store_true")
    ap.add_argument("--check", action="store_true", help="fp64 accuracy check before timing")
    ap.add_argument("--check-main", action="store_true", help="fp64 accuracy at the main shape (trainable, logp)")
    ap.add_argument("--sweep", action="store_true", help="tile-size sweep of the triton path at the main shape")
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA time of the triton path, main shape")
    ap.add_argument("--merge", nargs="+", help="only print the table of these result JSONs (later files win)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--tag", default="bench_op")
    args = ap.parse_args()
    if args.merge:
        merged = {}
        for f in args.merge:
            for r in json.loads(Path(f).read_text())["rows"]:
                merged[(r["N"], r["H"], r["V"], r["temperature"], r["bias"], r["mode"], r["variant"])] = r
        print(markdown(list(merged.values())))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = env_info()
    print(json.dumps(info), flush=True)
    result = dict(info=info, what=__doc__)
    if args.check:
        t0 = time.time()
        result["accuracy"] = accuracy_report()
        print(f"accuracy check {time.time() - t0:.0f}s", flush=True)
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    if args.check_main:
        result["accuracy_main"] = accuracy_main()
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    if args.sweep:
        result["sweep"] = sweep(args)
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    if args.profile:
        result["profile"] = profile()
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    dense_fits = MAIN + [s for s in REST if s[0] <= 32768]  # "dense": every shape where dense torch fits
    shapes = {"main": MAIN, "rest": REST, "all": MAIN + REST, "dense": dense_fits, "dense_rest": dense_fits[1:],
              "none": [], "tiny": TINY}[args.grid]
    rows = []
    result["rows"] = rows
    try:
        save = lambda: (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))  # noqa: E731
        run_grid(shapes, args.variants.split(","), args.modes.split(","), args, rows, info, save)
    finally:
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
        md = markdown(rows) if rows else ""
        (out / f"{args.tag}.md").write_text(md + "\n")
        print(md)


def _grads(fn, hid, w, b, tg, temp, ent, frozen, g_lp, g_ent):
    """Run fn with fresh leaf copies; return outputs and grads (None where not required)."""
    hid = hid.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(not frozen)
    b = None if b is None else b.detach().clone().requires_grad_(not frozen)
    lp, e = fn(hid, w, tg, b, temp, ent)
    loss = (lp.double() * g_lp).sum() + ((e.double() * g_ent).sum() if ent else 0)
    loss.backward()
    return dict(logp=lp.detach(), ent=None if e is None else e.detach(), dh=hid.grad,
                dw=None if frozen else w.grad, db=None if (frozen or b is None) else b.grad)


def accuracy_report():
    """Relative errors vs fp64 (dense on upcast inputs) of dense bf16, chunked and triton (also with a matching
    grad_hint, trainable head without entropy), same bf16 inputs."""
    configs = [(4096, 2048, 151936, 1.0, False), (2000, 1536, 32003, 0.7, True)]
    if DEV != "cuda":
        configs = [(48, 32, 1003, 0.7, True)]
    fns = {
        "dense_bf16": lambda h, w, t, b, T, e: token_logprobs_reference(h, w, t, bias=b, temperature=T, with_entropy=e),
        "trl_bf16": lambda h, w, t, b, T, e: dense_bf16(h, w, t, b, T, e, h.shape[0]),
        "chunked": lambda h, w, t, b, T, e: _token_logprobs(h, w, t, b, T, e, "chunked"),
        "triton": lambda h, w, t, b, T, e: _token_logprobs(h, w, t, b, T, e, "triton"),
    }
    report = []
    for seed, (n, h, v, temp, bias) in enumerate(configs):
        inp = make_inputs(n, h, v, 16 if DEV != "cuda" else 1000, temp, bias, seed=seed + 1)
        g = torch.Generator(device=DEV).manual_seed(seed + 100)
        g_lp = torch.randn(n, device=DEV, dtype=torch.float64, generator=g)
        g_ent = torch.randn(n, device=DEV, dtype=torch.float64, generator=g)
        for frozen, ent in ((False, True), (True, True), (True, False), (False, False)):
            args = (inp["hidden"], inp["weight"], inp["bias"], inp["targets"], temp, ent, frozen)
            up = lambda t: None if t is None else t.double()  # noqa: E731
            ref = _grads(fns["dense_bf16"], up(args[0]), up(args[1]), up(args[2]), *args[3:], g_lp, g_ent)
            hinted = lambda h, w, t, b, T, e: _token_logprobs(h, w, t, b, T, e, "triton", g_lp.float())  # noqa: E731
            for name, fn in [*fns.items(), ("triton_hint", hinted)]:
                if name == "triton_hint" and (frozen or ent):
                    continue  # the hint serves a trainable head whose entropy gets no gradient
                got = _grads(fn, *args, g_lp, g_ent)
                rec = dict(N=n, H=h, V=v, temperature=temp, bias=bias, frozen=frozen, entropy=ent, impl=name)
                for k, r in ref.items():
                    if r is not None and got[k] is not None:
                        rec[k] = ((got[k].double() - r).norm() / r.norm()).item()
                        rec[k + "_finite"] = bool(torch.isfinite(got[k]).all())
                report.append(rec)
                print("acc", json.dumps(rec), flush=True)
                del got
            del ref
            _empty_cache()
        del inp
    return report


def accuracy_main():
    """Relative errors vs fp64 at the main shape, trainable head, logp only: the hinted path accumulates grad_W
    over its most row chunks here. The fp64 reference is the chunked backend on upcast inputs (bounded memory)."""
    n, h, v, seq, temp, bias = MAIN[0] if DEV == "cuda" else TINY[0]
    inp = make_inputs(n, h, v, seq, temp, bias, seed=3)
    g_lp = -inp["adv"].double() / n  # the on-policy GRPO upstream (DAPO normalization)
    args = (inp["hidden"], inp["weight"], inp["bias"], inp["targets"], temp, False, False)
    up = lambda t: None if t is None else t.double()  # noqa: E731
    chunked = lambda h, w, t, b, T, e: _token_logprobs(h, w, t, b, T, e, "chunked")  # noqa: E731
    ref = _grads(chunked, up(args[0]), up(args[1]), up(args[2]), *args[3:], g_lp, None)
    fns = {
        "dense_bf16": lambda h, w, t, b, T, e: token_logprobs_reference(h, w, t, bias=b, temperature=T, with_entropy=e),
        "trl_bf16": lambda h, w, t, b, T, e: dense_bf16(h, w, t, b, T, e, seq),
        "triton": lambda h, w, t, b, T, e: _token_logprobs(h, w, t, b, T, e, "triton"),
        "triton_hint": lambda h, w, t, b, T, e: _token_logprobs(h, w, t, b, T, e, "triton", g_lp.float()),
    }
    fns["triton_hint32"] = fns["triton_hint"]
    report = []
    for name, fn in fns.items():
        triton_op.HINT_FP32_ACCUMULATE = name == "triton_hint32"
        got = _grads(fn, *args, g_lp, None)
        rec = dict(N=n, H=h, V=v, temperature=temp, bias=bias, frozen=False, entropy=False, impl=name)
        for k, r in ref.items():
            if r is not None and got[k] is not None:
                rec[k] = ((got[k].double() - r).norm() / r.norm()).item()
        report.append(rec)
        print("acc_main", json.dumps(rec), flush=True)
        triton_op.HINT_FP32_ACCUMULATE = False
        del got
        _empty_cache()
    del ref, inp
    _empty_cache()
    return report


def profile():
    """Top CUDA kernels (total ms over 3 steps) of the triton path per mode at the main shape."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    n, h, v, seq, temp, bias = MAIN[0]
    inp = make_inputs(n, h, v, seq, temp, bias)
    res = {}
    for mode in ("trainable", "frozen", "forward"):
        step = make_step("triton", mode, inp)
        step()
        clear_grads(inp)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
                clear_grads(inp)
            torch.cuda.synchronize()
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]
        res[mode] = [dict(name=e.key[:90], ms=e.device_time_total / 1e3 / 3, calls=e.count / 3) for e in rows]
        print("profile", mode, flush=True)
        for r in res[mode]:
            print(f"  {r['ms']:8.2f} ms/step {r['calls']:6.1f} calls  {r['name']}", flush=True)
    clear_grads(inp)
    del inp
    _empty_cache()
    return res


def sweep(args):
    """Triton tile sizes at the main shape: TILE_BYTES (trainable) and ROW_CHUNK_BYTES (frozen)."""
    n, h, v, seq, temp, bias = MAIN[0]
    inp = make_inputs(n, h, v, seq, temp, bias)
    res = []
    t0, r0 = triton_op.TILE_BYTES, triton_op.ROW_CHUNK_BYTES
    for mb in (256, 512, 1024):
        triton_op.TILE_BYTES = mb << 20
        for mode in ("trainable", "forward"):
            r = measure(make_step("triton", mode, inp), inp, 2, 10)
            res.append(dict(mode=mode, tile_mib=mb, **r))
            print("sweep", res[-1], flush=True)
    triton_op.TILE_BYTES = t0
    for mb in (64, 128, 256, 512):
        triton_op.ROW_CHUNK_BYTES = mb << 20
        r = measure(make_step("triton", "frozen", inp), inp, 2, 10)
        res.append(dict(mode="frozen", row_chunk_mib=mb, **r))
        print("sweep", res[-1], flush=True)
    triton_op.ROW_CHUNK_BYTES = r0
    clear_grads(inp)
    del inp
    _empty_cache()
    return res


if __name__ == "__main__":
    main()
