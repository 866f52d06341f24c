"""How exactly each rollout backend samples the trainer's policy on GPU: per model family and engine variant, the
engine's sampler logprobs against the trainer's `completion_logprobs` on the same model and batch, bf16.

    python bench/gpu_exactness.py --out DIR [--tokenizer GPT2_TOKENIZER] [--families llama,gemma2] [--wide]
                                  [--device cpu]

Tiny random models (hidden 256, 4 layers, GPT-2's 50,257-token vocabulary, sliding windows of 24 tokens, which
96 new tokens always exceed), 4 prompts x 4 samples at temperature 1, EOS ignored; `--wide` adds real-shape widths
(hidden 2,304-4,096, 2 layers, the real head dims), so the Triton kernels run their real tiles. The mixture-of-experts
families (`bench/gpu_exactness_moe.py`: qwen3_moe, olmoe, mixtral, qwen2_moe, gpt_oss_moe, deepseek_v3; 8 experts,
2 per token) run `hf` and `static` only (`MOE_VARIANTS`), with routing replay: the engine records each token's
experts and the trainer's logprobs replay them (`mean`, `max`: the gaps the bound holds, `hf`'s with its own routes
replayed); beside them the trainer's own routing compared with the sampler's (`own_mean`, `own_max`: the gaps without
replay, `disagreement`: the share of token x layer whose trainer top-k differs as a set from the route). Every model
runs the experts backend a run picks (model.experts_implementation=auto: grouped_mm on an H100 in bf16). Variants
(`VARIANTS`):

    hf                    transformers `generate` (the reference: its bf16 forward is the trainer's up to rounding)
    static                the static engine as a run with padded micro-batches builds it (compiled, step graph, Triton
                          draw, decode attention `trainer.placement.engines.decode_attention_for(packed=False)`: sdpa)
    static_no_step_graph  the same with rollout.step_graph=false (the forward alone a CUDA graph)
    static_eager          the same uncompiled (the eager decode; a diagnosis column, not a trainer setting)
    hf_lora               `hf` on a LoRA model (random adapters, B != 0): the reference of merged_lora
    merged_lora           the trainer's one-GPU LoRA decode weights (rollout/weights.py MergedLoraWeights: merged
                          in place, fused q/k/v and gate/up projections), static at its defaults
    rollout_device        the trainer's replica for rollout.device (trainer/distributed/parallel.py RolloutCopy, fused
                          projections) on cuda:1 when there is one, else cuda:0, static at its defaults
    static_sdpa, static_matmul, static_triton
                          diagnosis columns: static with rollout.decode_attention=sdpa, =matmul or =triton

Each variant decodes twice (the first call compiles); the second call is measured: mean and max |Δ logp| over
its completion tokens. Dynamo's compilations are counted in each call (frames compiled, recompilations of a frame
compiled before, frames that failed, e.g. on the recompile limit) from torch._dynamo's compilation metrics; the
table shows them as first+second.
The table is printed and saved as DIR/gpu_exactness_<device>_<commit>.json. The GPU test
tests/test_gpu_exactness.py runs the same measurement and holds every static variant to its reference:
mean <= 1.5x (or one fp32 spacing of the logprobs, `mean_bound`) and max <= 2x those of `hf` on the same model
(`BOUND_MEAN`, `BOUND_MAX`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitless.models import completion_logprobs  # noqa: E402
from logitless.models.experts import experts_implementation  # noqa: E402
from logitless.rollout import SamplingOptions, make_engine  # noqa: E402

from bench.gpu_exactness_moe import moe_families, routed_logprobs, use_run_experts_backend  # noqa: E402

WINDOW = 24  # tokens of every sliding window: prompts of 12-24 tokens + 96 new tokens always exceed it
NEW_TOKENS = 96
PROMPTS, SAMPLES = 4, 4
BOUND_MEAN, BOUND_MAX = 1.5, 2.0  # a static variant against its hf reference on the same model
ALTERNATING = ["sliding_attention", "full_attention"] * 2
REFERENCE = {"static": "hf", "static_no_step_graph": "hf", "static_eager": "hf", "merged_lora": "hf_lora",
             "rollout_device": "hf", "static_sdpa": "hf", "static_matmul": "hf",
             "static_triton": "hf"}
VARIANTS = ("hf", "static", "static_no_step_graph", "static_eager", "hf_lora", "merged_lora", "rollout_device",
            "static_sdpa", "static_matmul", "static_triton")
WIDE_VARIANTS = ("hf", "static", "static_sdpa", "static_matmul", "static_triton")
MOE_VARIANTS = ("hf", "static")  # with routing replay


def _tiny(eos: int) -> dict[str, Any]:
    return dict(vocab_size=50_257, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05, pad_token_id=eos,
                bos_token_id=None, eos_token_id=eos)


def _families(eos: int) -> dict[str, Callable[[], Any]]:
    """Tiny config of each family docs/guide.md lists for `static` (windows that bite where the family has one)."""
    import transformers as tf

    c = _tiny(eos)
    return {
        "llama": lambda: tf.LlamaConfig(**c),
        # layers >= max_window_layers slide: 0-1 full, 2-3 sliding
        "qwen2_window": lambda: tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=2),
        "qwen3": lambda: tf.Qwen3Config(**c, head_dim=64),
        "mistral_window": lambda: tf.MistralConfig(**c, sliding_window=WINDOW),
        "phi3_window": lambda: tf.Phi3Config(**c, sliding_window=WINDOW),
        "gemma2": lambda: tf.Gemma2Config(**c, head_dim=64, sliding_window=WINDOW, final_logit_softcapping=None,
                                          layer_types=ALTERNATING),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**c, head_dim=64, sliding_window=WINDOW, layer_types=ALTERNATING),
        # Granite 3's multipliers (embedding, residual, attention, logits)
        "granite": lambda: tf.GraniteConfig(**c, embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=1 / 64, logits_scaling=8.0),
        # attention sinks, mixture of experts, alternating sliding/full
        "gpt_oss": lambda: tf.GptOssConfig(**{**c, "max_position_embeddings": 131_072}, head_dim=64,  # its YaRN's
                                           sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                           layer_types=ALTERNATING),
        "olmo2": lambda: tf.Olmo2Config(**c),
    }


def _wide(eos: int) -> dict[str, Callable[[], Any]]:
    """Real-shape widths (2 layers): the head dims, GQA ratios and projections of the named models. Gemma 2 draws its
    weights with std 0.005, not transformers' 0.02: its tied embeddings enter scaled by sqrt(hidden), so at 0.02 the
    random model predicts its input token with p = 1 - 1.5e-4 (H100, 2026-11-26) and the gaps compared are 1e-7
    nats of logprobs near 0; at 0.005 it is near-uniform (|logp| 10.8) like the other random models here."""
    import transformers as tf

    c = dict(vocab_size=50_257, num_hidden_layers=2, max_position_embeddings=4096, pad_token_id=eos, bos_token_id=None,
             eos_token_id=eos)
    return {
        "llama_3b": lambda: tf.LlamaConfig(**c, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                                           num_key_value_heads=8, head_dim=128),
        "qwen3_4b": lambda: tf.Qwen3Config(**c, hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                                           num_key_value_heads=8, head_dim=128),
        "mistral_7b_window": lambda: tf.MistralConfig(**c, hidden_size=4096, intermediate_size=14336,
                                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                                      sliding_window=WINDOW),
        "gemma2_2b": lambda: tf.Gemma2Config(**c, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                             num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                                             sliding_window=WINDOW, final_logit_softcapping=None,
                                             layer_types=ALTERNATING[:2], initializer_range=0.005),
        "gpt_oss_20b": lambda: tf.GptOssConfig(**{**c, "max_position_embeddings": 131_072}, hidden_size=2880,
                                               intermediate_size=2880, num_attention_heads=64,
                                               num_key_value_heads=8, head_dim=64, num_local_experts=4,
                                               num_experts_per_tok=2, sliding_window=WINDOW,
                                               layer_types=ALTERNATING[:2]),
    }


def configs(eos: int, wide: bool = False, moe: bool = False) -> dict[str, Callable[[], Any]]:
    """The dense families (`_families`), their real-shape widths (`wide`) or the MoE families (`moe`)."""
    if moe:
        return moe_families(_tiny(eos), WINDOW, ALTERNATING)
    return _wide(eos) if wide else _families(eos)


MOE = tuple(configs(0, moe=True))  # the families decoded with routes recorded and replayed


def tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    return tok


def prompts() -> list[str]:
    g = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "sum", "of", "the", "numbers", "is", "42", "+", "="]
    return [" ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=g).tolist())
            for n in (12, 16, 20, 24)][:PROMPTS]


def build(make_config: Callable[[], Any], device: str | torch.device, lora: bool = False,
          seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The `dtype` model of `make_config` on `device`, random init from `seed` (the same weights on every call),
    its experts (if any) on the backend a run picks there; with `lora`, wrapped in LoRA adapters (r 16, all linear
    layers, as the trainer's defaults) whose B is random too, so the merged weights differ from the base."""
    import transformers as tf

    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(make_config(), dtype=dtype)  # the trainer's attention
    model.eval()
    use_run_experts_backend(model)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            for b in layer.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.02)
    return model.eval()


@dataclasses.dataclass
class Compiles:
    """Dynamo's frame compilations while a block ran (torch._dynamo.utils' compilation metrics; the metrics a compiled
    graph records when it runs, `is_runtime`, are counted apart: they compile no frame)."""

    frames: int = 0  # frames compiled (a first compilation or a recompilation)
    recompiles: int = 0  # compilations of a frame compiled before, whose guards failed
    failures: list[str] = dataclasses.field(default_factory=list)  # e.g. the recompile limit hit
    reasons: list[str] = dataclasses.field(default_factory=list)  # the first recompile reasons
    names: list[str] = dataclasses.field(default_factory=list)  # the first frames compiled (code name, file:line)
    runtime: int = 0  # runtime events of compiled graphs (is_runtime metrics: CUDA-graph recording, autotuning)

    @classmethod
    def start(cls) -> None:
        from torch._dynamo import utils

        utils.clear_compilation_metrics()

    @classmethod
    def read(cls) -> Compiles:
        from torch._dynamo import utils

        out = cls()
        for m in utils.get_compilation_metrics():
            if getattr(m, "is_runtime", False):  # work a compiled graph did when it ran (e.g. a CUDA graph recorded)
                out.runtime += 1
                continue
            out.frames += 1
            out.names = (out.names + [f"{m.co_name} {Path(m.co_filename or '').name}:{m.co_firstlineno}"])[:4]
            reason = getattr(m, "recompile_reason", None)
            if reason:
                out.recompiles += 1
                out.reasons = (out.reasons + [f"{m.co_name}: {reason.splitlines()[0][:200]}"])[:3]
            fail = getattr(m, "fail_type", None)
            if fail:
                out.failures = (out.failures + [f"{fail}: {str(getattr(m, 'fail_reason', ''))[:200]}"])[:3]
        return out


@dataclasses.dataclass
class Result:
    family: str
    variant: str
    mean: float  # mean |sampler logp - trainer logp| over the measured call's completion tokens (nats)
    max: float
    tokens: int
    min_length: int  # the shortest row's prompt + completion tokens (> WINDOW: the window bites)
    seconds: float  # both calls
    first: Compiles  # dynamo's compilations in the first call (the engine's compile)
    second: Compiles  # in the measured call, at the same shapes: none for a decode of a bounded number of graphs
    error: str | None = None
    spacing: float = 0.0  # the mean fp32 spacing (one ulp) of the trainer's logprobs compared: the finest gap measurable
    # MoE families (routes recorded; mean and max above are then the gaps with the routes replayed):
    experts: str | None = None  # the experts backend (model.experts_implementation=auto's choice)
    own_mean: float | None = None  # mean |Δ logp| without replay: the trainer's own routing
    own_max: float | None = None
    disagreement: float | None = None  # share of token x layer whose trainer top-k differs from the recorded route
    disagreement_replayed: float | None = None  # the same, measured in the forward with replay on
    routed: int = 0  # token x layer with a recorded route


def mean_bound(r: Result, ref: Result) -> float:
    """The largest mean gap `r` may have against its reference: BOUND_MEAN x the reference's, or one fp32 spacing of
    the logprobs compared where that is larger (a ratio of two gaps below one ulp measures the rounding of the
    comparison, not of the decode)."""
    return max(BOUND_MEAN * ref.mean, r.spacing)


def engine_of(variant: str, model: torch.nn.Module, tok: Any, **kw: Any) -> tuple[Any, Any]:
    """(engine, what it keeps alive) of `variant` decoding `model` (the trainer's model for that variant; off CUDA
    the static variants run eagerly and rollout_device's replica stays on the host); `kw` (record_routes) go to
    `make_engine` (not taken by merged_lora and rollout_device, which the trainer builds)."""
    from logitless.trainer.placement.engines import make_rollout_engine
    from logitless.trainer.config.schema import RolloutConfig

    from logitless.trainer.placement.engines import decode_attention_for

    padded = decode_attention_for(packed=False)  # what a run with padded micro-batches (as trainer_logprobs) decodes with
    if variant in ("hf", "hf_lora"):
        return make_engine("hf", model, tok, **kw), None
    if variant == "static":
        return make_engine("static", model, tok, decode_attention=padded, **kw), None
    if variant == "static_no_step_graph":
        return make_engine("static", model, tok, step_graph=False, decode_attention=padded, **kw), None
    if variant == "static_eager":
        return make_engine("static", model, tok, compile=False, decode_attention=padded, **kw), None
    if variant in ("static_sdpa", "static_matmul", "static_triton"):
        return make_engine("static", model, tok, decode_attention=variant.split("_")[1], **kw), None
    if kw:
        raise ValueError(f"variant {variant!r} decodes as the trainer builds it: no {sorted(kw)} here")
    if variant == "merged_lora":  # as the placement builds it on one GPU: in place, fused projections
        return make_rollout_engine(RolloutConfig(backend="static"), model, tok), None
    if variant == "rollout_device":  # as the placement builds it for rollout.device (placement/placement.py)
        from logitless.trainer.distributed.parallel import make_replica

        here = model.get_input_embeddings().weight.device
        device = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0) if here.type == "cuda" else here
        replica = make_replica(model, None, device=device, fuse=True)
        replica.sync(model)
        cfg = RolloutConfig(backend="static", device=str(device), weight_copy="resident", decode_attention=padded)
        return make_rollout_engine(cfg, replica.model, tok), replica
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


@contextlib.contextmanager
def trainer_forward(model: torch.nn.Module, batch: Any) -> Iterator[list[torch.Tensor]]:
    """Inside, `model` computes as the trainer's update does (no grad; LoRA under the default model.lora_compute,
    autocast in the model's dtype); yields the batch's prompt ids and mask, completion ids and mask on its device."""
    from logitless.trainer.config.schema import ModelConfig
    from logitless.trainer.policy.modeling import LoraCompute

    device = model.get_input_embeddings().weight.device
    compute = LoraCompute(model, ModelConfig())
    with torch.no_grad(), compute.stage(), compute.forward():
        yield [x.to(device) for x in (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)]


def trainer_logprobs(model: torch.nn.Module, batch: Any, temperature: float) -> torch.Tensor:
    """[B, T] fp32 on the host: `completion_logprobs` as the trainer's update computes it."""
    with trainer_forward(model, batch) as args:
        return completion_logprobs(model, *args, temperature=temperature)[0].float().cpu()


def measure(family: str, variant: str, model: torch.nn.Module, tok: Any, new_tokens: int = NEW_TOKENS,
            samples: int = SAMPLES) -> Result:
    """Decode the prompts twice with `variant`'s engine over `model` (compiles in the first call) and compare the
    second call's sampler logprobs with the trainer's on the same batch; a MoE family (`MOE`) records its routes
    and the trainer replays them (and, apart, compares its own routing with them)."""
    t0 = time.perf_counter()
    Compiles.start()
    moe = family in MOE
    engine, keep = engine_of(variant, model, tok, **({"record_routes": True} if moe else {}))
    def opts(seed: int) -> SamplingOptions:
        return SamplingOptions(num_generations=samples, temperature=1.0, max_new_tokens=new_tokens, seed=seed,
                               ignore_eos=True)

    engine.generate(prompts(), opts(1))
    first = Compiles.read()
    Compiles.start()
    batch = engine.generate(prompts(), opts(0))
    second = Compiles.read()
    m = batch.completion_mask.bool()
    routing: dict[str, Any] = {}
    if moe:
        with trainer_forward(model, batch) as args:
            replayed = routed_logprobs(model, args, batch, 1.0, replay=True)
            own = routed_logprobs(model, args, batch, 1.0, replay=False)
        lp, gap = replayed.logp, (batch.sampler_logp - own.logp)[m].abs()
        routing = dict(experts=experts_implementation(model), own_mean=float(gap.mean()), own_max=float(gap.max()),
                       disagreement=own.disagreement, disagreement_replayed=replayed.disagreement, routed=own.routed)
    else:
        lp = trainer_logprobs(model, batch, 1.0)
    diff = (batch.sampler_logp - lp)[m].abs()
    spacing = (torch.nextafter(lp[m].abs(), torch.tensor(float("inf"))) - lp[m].abs()).mean()
    del engine, keep
    return Result(family, variant, float(diff.mean()), float(diff.max()), int(m.sum()),
                  int((batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)).min()), time.perf_counter() - t0,
                  first, second, spacing=float(spacing), **routing)


def run_family(family: str, make_config: Callable[[], Any], variants: tuple[str, ...], tok: Any,
               device: str = "cuda", dtype: torch.dtype = torch.bfloat16, **kw: Any) -> list[Result]:
    """Every variant of one family, each on its own copy of the same weights and from a clean dynamo state (its
    compiled frames, recompile counts and limits are its own, not those of the variants or families before it, with
    which it shares code objects); a variant that raises is recorded with its error. `kw` (new_tokens, samples) go
    to `measure`."""
    out = []
    for variant in variants:
        t0 = time.perf_counter()
        gc.collect()  # the models before (transformers' compiled call keeps each in a reference cycle)
        torch._dynamo.reset()
        try:
            model = build(make_config, device, lora=variant in ("hf_lora", "merged_lora"), dtype=dtype)
            out.append(measure(family, variant, model, tok, **kw))
        except Exception as e:  # noqa: BLE001  (the table records it and goes on)
            out.append(Result(family, variant, float("nan"), float("nan"), 0, 0, time.perf_counter() - t0,
                              Compiles.read(), Compiles(), error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        finally:
            model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(row(out[-1], out), flush=True)
    return out


def within_bound(r: Result, results: list[Result]) -> bool | None:
    """Whether static variant `r` meets the bound against its reference among `results` (None: no reference)."""
    ref = next((x for x in results if x.family == r.family and x.variant == REFERENCE.get(r.variant)), None)
    if ref is None or ref.error or r.error:
        return None if ref is None or ref.error else False
    return r.mean <= mean_bound(r, ref) and r.max <= BOUND_MAX * ref.max


def row(r: Result, results: list[Result]) -> str:
    if r.error:
        return f"{r.family:18s} {r.variant:21s} ERROR {r.error}"
    ok = within_bound(r, results)
    c, fails = r.first, r.first.failures + r.second.failures
    routes = "" if r.own_mean is None else (
        f"  [{r.experts}] no replay: mean {r.own_mean:.4f} max {r.own_max:.3f} disagreement {r.disagreement:.4f} "
        f"(replayed {r.disagreement_replayed:.4f}) of {r.routed}")
    return (f"{r.family:18s} {r.variant:21s} mean {r.mean:.4f} max {r.max:.3f}  frames {c.frames:2d}+{r.second.frames} "
            f"recompiles {c.recompiles:2d}+{r.second.recompiles}{' FAILED ' + fails[0] if fails else ''}  "
            f"{r.seconds:5.1f} s"
            f"{'' if ok is None else '  within bound' if ok else '  OUT OF BOUND'}{routes}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _default_tokenizer() -> str | None:
    for root in (os.environ.get("LOGITLESS_SHARED"), Path(__file__).resolve().parents[1] / "shared",
                 Path(__file__).resolve().parents[2] / "shared"):
        if root and Path(root, "tokenizers", "gpt2").is_dir():
            return str(Path(root, "tokenizers", "gpt2"))
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=_default_tokenizer(),
                    help="GPT-2's tokenizer folder (default: tokenizers/gpt2 under $LOGITLESS_SHARED or shared/)")
    ap.add_argument("--families", default=None, help="comma-separated (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--wide", action="store_true", help="also the real-shape widths (hf and static)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the same measurement in fp32, static uncompiled (checks the code path, not the GPU)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_exactness measures the CUDA decode: no CUDA device here (--device cpu runs the code path in fp32)")
    if a.tokenizer is None:
        sys.exit("--tokenizer: GPT-2's tokenizer folder (none found under $LOGITLESS_SHARED/tokenizers/gpt2)")
    tok = tokenizer(a.tokenizer)
    variants = tuple(v for v in a.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    cases = [(n, f, variants) for n, f in configs(tok.eos_token_id).items()]
    if a.wide:
        wide = tuple(v for v in variants if v in WIDE_VARIANTS)
        cases += [(n, f, wide) for n, f in configs(tok.eos_token_id, True).items()]
    cases += [(n, f, tuple(v for v in variants if v in MOE_VARIANTS)) for n, f in configs(tok.eos_token_id,
                                                                                          moe=True).items()]
    if a.families:
        names = a.families.split(",")
        missing = [n for n in names if n not in {c[0] for c in cases}]
        if missing:
            sys.exit(f"--families: unknown {missing} (the real-shape widths need --wide); choose from "
                     f"{[c[0] for c in cases]}")
        cases = [c for c in cases if c[0] in names]
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    results: list[Result] = []
    for name, make_config, vs in cases:
        results += run_family(name, make_config, vs, tok, device=a.device, dtype=dtype)
    print("\n" + "\n".join(row(r, results) for r in results))
    import transformers

    commit = a.commit or _commit()
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    card = next((w for w in device.split() if w[:1].isalpha() and w[1:].isdigit()), a.device).lower()  # "h100"
    triton = __import__("triton").__version__ if a.device == "cuda" else None
    info = {"device": device, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "triton": triton, "transformers": transformers.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d"),
            "setup": {"window": WINDOW, "new_tokens": NEW_TOKENS, "prompts": PROMPTS, "samples": SAMPLES,
                      "temperature": 1.0, "dtype": str(dtype).removeprefix("torch."),
                      "bound": {"mean": BOUND_MEAN, "max": BOUND_MAX}, "moe_variants": list(MOE_VARIANTS)}}
    rows = [{**dataclasses.asdict(r), "within_bound": within_bound(r, results)} for r in results]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    part = f"_{a.families.replace(',', '_')}" if a.families else ""
    path = out / f"gpu_exactness_{card}_{commit}{part}.json"
    path.write_text(json.dumps({"info": info, "results": rows}, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
