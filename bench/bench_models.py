"""End-to-end completion logprobs of a causal LM: `logitless.models.completion_logprobs` vs dense HF logits.

Model: random-init Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14/2 heads, vocab 151,936, tied), bf16, on one
GPU, in train mode, full fine-tuning (every parameter needs grad), gradient checkpointing off.
Batch: B rows, prompt length P (left-padded by a few tokens), completion length T (right-padded by a few).

Variants (each timed as forward + backward of `-(logp * adv).sum()` and as a no_grad forward):
* "dense":  TRL-style `model(ids, mask, position_ids, logits_to_keep=T+1).logits[:, :-1]` -> fp32 / temperature
  -> log_softmax -> gather (the [B, T, V] logits are materialized, in bf16 and then fp32).
* "fused":  `completion_logprobs(model, ...)` (decoder body -> gather completion positions -> fused op).
* "+ent" adds the entropy (and `- 0.01 * entropy.sum()` to the loss).

Timing: CUDA events, median / p20 / p80 of --reps runs after --warmup runs. Peak extra memory =
max_memory_allocated() during a run minus memory_allocated() before it (model weights excluded; grads of the
weights included for fwd+bwd, which are the same for both variants).

Usage: python bench/bench_models.py --out DIR [--batch 8 --prompt 128 --completion 896]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitless.models import completion_logprobs, position_ids_from_mask  # noqa: E402


def dense_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature, with_entropy):
    T = c_ids.shape[1]
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                   use_cache=False, logits_to_keep=T + 1).logits[:, :-1]
    lp = torch.log_softmax(logits.float() / temperature, -1)  # [B, T, V]
    logp = lp.gather(-1, c_ids[..., None])[..., 0] * c_mask
    ent = -(lp.exp() * lp).sum(-1) * c_mask if with_entropy else None
    return logp, ent


def measure(fn, model, grad: bool, reps: int, warmup: int):
    times, peaks = [], []
    for i in range(warmup + reps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if grad:
            loss = fn()
            loss.backward()
        else:
            with torch.no_grad():
                fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    q = statistics.quantiles(times, n=5)
    return {"median_ms": statistics.median(times), "p20_ms": q[0], "p80_ms": q[3], "peak_extra_gib": max(peaks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=896)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).to(dev, torch.bfloat16).train()
    B, P, T = args.batch, args.prompt, args.completion
    g = torch.Generator(device=dev).manual_seed(0)
    p_ids = torch.randint(0, cfg.vocab_size, (B, P), device=dev, generator=g)
    c_ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    p_mask = torch.ones(B, P, dtype=torch.long, device=dev)
    c_mask = torch.ones(B, T, dtype=torch.long, device=dev)
    for b in range(B):
        p_mask[b, : (b * 7) % 17] = 0
        c_mask[b, T - (b * 13) % 50 :] = 0
    adv = torch.randn(B, T, device=dev, generator=g)
    batch = (p_ids, p_mask, c_ids, c_mask)

    # agreement of the two paths (bf16 model; both see the same bf16 hidden states up to kernel choice)
    with torch.no_grad():
        d_lp, d_ent = dense_logprobs(model, *batch, 0.9, True)
        f_lp, f_ent = completion_logprobs(model, *batch, temperature=0.9, with_entropy=True)
    m = c_mask.bool()
    check = {"max_abs_logp_diff": (d_lp - f_lp)[m].abs().max().item(),
             "max_abs_entropy_diff": (d_ent - f_ent)[m].abs().max().item()}

    rows = []
    for name in ("dense", "fused"):
        for with_entropy in (False, True):
            def fn(name=name, with_entropy=with_entropy):
                if name == "dense":
                    lp, ent = dense_logprobs(model, *batch, 0.9, with_entropy)
                else:
                    lp, ent = completion_logprobs(model, *batch, temperature=0.9, with_entropy=with_entropy)
                loss = -(lp * adv).sum()
                return loss - 0.01 * ent.sum() if with_entropy else loss

            for grad in (True, False):
                r = measure(fn, model, grad, args.reps, args.warmup)
                r.update(variant=name + ("+ent" if with_entropy else ""), mode="fwd+bwd" if grad else "forward")
                rows.append(r)
                print(f"{r['variant']:10s} {r['mode']:8s} {r['median_ms']:9.1f} ms  "
                      f"peak +{r['peak_extra_gib']:.2f} GiB", flush=True)

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    out = {
        "script": "bench/bench_models.py", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "transformers": transformers.__version__, "commit": commit,
        "model": "Qwen2.5-0.5B shapes, random init, bf16, tied, sdpa, train mode, full fine-tune",
        "shapes": {"B": B, "P": P, "T": T, "V": cfg.vocab_size, "H": cfg.hidden_size, "N": int(m.sum())},
        "temperature": 0.9, "check_vs_dense": check, "rows": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "models_completion_logprobs.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(check))


if __name__ == "__main__":
    main()
