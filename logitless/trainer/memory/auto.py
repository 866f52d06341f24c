"""Settings left "auto": decided once per run, before the model loads, from the device, the model's config and the
memory plan; printed as a table and saved in the run folder (`resolved.json`).

    rollout.backend               static on CUDA where its layout check passes (rollout/layouts.py), else hf
    train.packed                  on CUDA for a bf16/fp16 model whose attention runs varlen (full attention only)
    model.compile_layers          on CUDA, one process, train.max_steps >= COMPILE_MIN_STEPS
    model.liger_kernels           on CUDA, installed, the model type supported, layers not compiled (one process
                                  or FSDP2 under torchrun without a split rollout; not with train.fsdp_offload)
    model.gradient_checkpointing  \\
    model.activation_offload       |  the memory plan (trainer/memory/plan.py): the fastest settings whose
    train.micro_batch_tokens       |  predicted phases fit train.memory_budget_gib (default: the device's free
    train.offload_during_rollout   |  memory); made on CUDA (or wherever the budget is set), one process
    model.mlp_chunk_tokens         |  (tiled MLP only where nothing untiled fits; never for a mixture of experts)
    rollout.max_kv_gib (unset)    /
    model.experts_implementation  a mixture of experts only: grouped_mm on CUDA SM90+ in bf16, else eager
                                  (models/experts.py)
    objective.sampler_is_mode     token_truncate with rollout.fp8 (the sampler is the FP8 model), else off

A setting given in the config is kept as given (and listed as "set"); the checks of the settings themselves
(preflight, the engines) run on the decided values as they always did.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from logitless.models import UnsupportedModelError
from logitless.models.experts import is_moe, resolve_experts_implementation
from logitless.models.vision import is_vision_language
from logitless.rollout.engine import same_device
from logitless.rollout.kv_cache import STATIC_LAYER_TYPES, auto_kv_budget
from logitless.rollout.layouts import FULL, check_layout, layer_types, text_config
from logitless.trainer.memory import plan as mp
from logitless.trainer.config.schema import ModelConfig, TrainerConfig
from logitless.trainer.memory.model import base_model, model_memory, model_skeleton, moe_summary

# model.compile_layers=auto compiles for runs of at least this many steps. Measured at the 1.5B shape, T = 1,024
# (bench/LOG.md): the compile adds about 42 s to the first step and saves about 0.7 s of every later one (update
# 4.28 -> 3.59 s), so it pays off after about 60 steps there (more per step at longer T or larger models).
COMPILE_MIN_STEPS = 100
PACKED_ATTENTION = (None, "logitless_varlen", "flash_attention_2")  # attention that runs packed rows at varlen cost


@dataclass
class Choice:
    key: str  # dotted config key
    value: Any
    reason: str
    auto: bool  # decided here (the config said auto)


@dataclass
class Resolved:
    """A run's config with every "auto" decided, why, and the memory plan behind it (None where none is made)."""

    cfg: TrainerConfig
    choices: list[Choice] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be decided as usual, and why
    plan: mp.Plan | None = None
    model: mp.ModelMemory | None = None
    step: mp.StepShape | None = None
    facts: mp.RunFacts | None = None
    # under torchrun: the per-GPU memory of each phase on `ranks` ranks (memory_ranks.py; no settings chosen)
    ranks: int = 1
    rank_memory: mp.Plan | None = None

    def to_json(self) -> dict[str, Any]:
        ranks = {"ranks": self.ranks, **mp.to_json(self.rank_memory)} if self.rank_memory is not None else None
        return {"choices": [dataclasses.asdict(c) for c in self.choices], "notes": self.notes,
                "plan": mp.to_json(self.plan) if self.plan is not None else None, "rank_memory": ranks}


# --- the decisions ------------------------------------------------------------------------------------------------


def run_device(cfg: TrainerConfig, model: Any = None) -> torch.device:
    """The training device: the given model's, else model.device ("auto": cuda if available)."""
    from logitless.trainer.policy.modeling import resolve_device

    if model is not None:
        return next(model.parameters()).device
    return resolve_device(cfg.model.device)


def compute_dtype(cfg: ModelConfig, device: torch.device, model: Any = None) -> torch.dtype:
    from logitless.trainer.policy.modeling import resolve_dtype

    if model is not None:
        return base_model(model).get_input_embeddings().weight.dtype
    return resolve_dtype(cfg.dtype, device)


UNREAD = "the model's config could not be read"


def rollout_backend(cfg: TrainerConfig, device: torch.device, model: Any) -> tuple[str, str]:
    """(backend, why) for rollout.backend=auto; `model`: the model, loaded or a skeleton (None: unknown)."""
    static_set = cfg.rollout.static_settings()
    if static_set:
        return "static", f"rollout.{static_set[0]} is set, which only the static engine reads"
    if cfg.train.async_rollout:
        return "static", "train.async_rollout=true samples from the static engine"
    if device.type != "cuda":
        return "hf", f"{device.type}: transformers generate (the static engine's compiled decode step needs CUDA)"
    if model is None:
        return "hf", f"{UNREAD}: transformers generate runs every layout"
    if is_vision_language(base_model(model)):
        return "hf", ("a vision-language model: transformers generate (the static engine decodes images too, "
                      "rollout.backend=static, but its compiled bf16 decode of them is not yet measured on a GPU)")
    try:
        check_layout(base_model(model), "static", STATIC_LAYER_TYPES)
    except UnsupportedModelError as e:
        return "hf", str(e).split(": ", 1)[-1].split(". Use")[0]
    return "static", "CUDA, and the static engine decodes this model's attention layout exactly"


def _packed(cfg: TrainerConfig, device: torch.device, dtype: torch.dtype, model: Any,
            loaded: bool = False) -> tuple[bool, str]:
    """`loaded`: `model` is the run's own (given to `train`), whose attention is what it is; a skeleton's is what
    the run loads (`model_checks.model_config`: logitless_varlen when packed and none is named)."""
    impl = cfg.model.attn_implementation
    if loaded:
        impl = getattr(base_model(model).config, "_attn_implementation", None)
    if device.type != "cuda":
        return False, f"{device.type}: padded micro-batches (the varlen path runs one attention call per row here)"
    if model is None:
        return False, UNREAD
    base = base_model(model)
    if is_vision_language(base):
        return False, ("a vision-language model: packed rows (train.packed=true, M-RoPE models) are not chosen "
                       "automatically before a GPU has measured them")
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"the model computes in {str(dtype).removeprefix('torch.')}; varlen flash attention needs bf16/fp16"
    if impl not in PACKED_ATTENTION:
        return False, f"attention {impl!r} packs rows with a dense [S, S] mask, slower than padding"
    if not getattr(type(base), "_supports_attention_backend", False):
        return False, f"{type(base).__name__} does not run transformers' attention interface"
    kinds = sorted(set(layer_types(text_config(base))) - {FULL})
    if kinds:
        return False, f"its {', '.join(kinds)} layers run sdpa's dense mask when packed"
    return True, "CUDA, bf16/fp16, varlen attention: padding-free micro-batches cost the rows' own lengths"


def _compile(cfg: TrainerConfig, device: torch.device, single: bool) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"{device.type}: compiled layers are for CUDA"
    if not single:
        return False, "not measured under torchrun or train.fsdp_offload"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if cfg.train.max_steps < COMPILE_MIN_STEPS:
        return False, (f"train.max_steps={cfg.train.max_steps} < {COMPILE_MIN_STEPS}: too short to repay the first "
                       "step's compile (about 45 s)")
    return True, f"train.max_steps >= {COMPILE_MIN_STEPS} repays the first step's compile (about 45 s)"


def _liger(cfg: TrainerConfig, device: torch.device, world_size: int, compiled: bool, model: Any) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"{device.type}: Liger's kernels are for CUDA"
    if cfg.train.fsdp_offload:
        return False, "refused with train.fsdp_offload (not tested on host-offloaded FSDP2 units)"
    if world_size > 1 and cfg.rollout.tensor_parallel > 1:
        return False, "refused with rollout.tensor_parallel > 1 (the split replica would run them; not tested)"
    if compiled:
        return False, "compiled layers run the model's own code (Liger added nothing beside them: bench/LOG.md)"
    if importlib.util.find_spec("liger_kernel") is None:
        return False, "liger-kernel is not installed (pip install 'logitless[liger]')"
    if model is None:
        return False, UNREAD
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(text_config(base_model(model)), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return False, f"Liger-Kernel has no kernels for model type {model_type!r}"
    if world_size > 1:
        return True, f"installed, with kernels for {model_type} (FSDP2 runs them on each layer's gathered weights)"
    return True, f"installed, with kernels for {model_type}"


def _sampler_is(cfg: TrainerConfig) -> tuple[str | None, str]:
    """(objective.sampler_is_mode, why) for "auto": the rollout IS correction wherever the sampler is not the trained
    model in its own dtype by design (rollout.fp8)."""
    if cfg.rollout.fp8:
        return "token_truncate", ("rollout.fp8=true samples from the FP8 model, whose logprobs are not the trainer's: "
                                  "each token weighted by min(π_trainer / π_sampler, "
                                  f"objective.sampler_is_clip_max={cfg.objective.sampler_is_clip_max})")
    return None, "off: the rollout samples from the trained weights in their own dtype"


class _Choices:
    """Collects the decisions of `resolve`: a setting given in the config is kept, an "auto" one decided."""

    def __init__(self, out: Resolved):
        self.out = out
        self.changes: dict[str, dict[str, Any]] = {"model": {}, "train": {}, "rollout": {}, "objective": {}}

    def __call__(self, key: str, given: Any, decide) -> Any:
        if given != "auto":
            self.out.choices.append(Choice(key, given, "set in the config", False))
            return given
        value, why = decide()
        self.add(key, value, why)
        return value

    def add(self, key: str, value: Any, why: str) -> None:
        self.out.choices.append(Choice(key, value, why, True))
        section, name = key.split(".", 1)
        self.changes[section][name] = value

    def config(self, cfg: TrainerConfig) -> TrainerConfig:
        return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v)
                                           for s, v in self.changes.items() if v})


AUTO_KEYS = ("rollout.backend", "train.packed", "train.micro_batch_tokens", "train.offload_during_rollout",
             "model.compile_layers", "model.liger_kernels", "model.gradient_checkpointing", "model.activation_offload",
             "model.mlp_chunk_tokens", "objective.sampler_is_mode")


def has_auto(cfg: TrainerConfig) -> bool:
    """Whether a setting of `cfg` is still "auto" (not yet `resolve`d)."""
    return any(getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) == "auto" for k in AUTO_KEYS)


def _fixed_knobs(cfg: TrainerConfig, packed: bool) -> mp.Knobs:
    """The plan's settings as the config gives them (None where it says auto)."""
    t, m = cfg.train, cfg.model
    given = lambda v: None if v == "auto" else v  # noqa: E731
    fixed = mp.Knobs(
        gradient_checkpointing=given(m.gradient_checkpointing), activation_offload=given(m.activation_offload),
        micro_batch_tokens=t.micro_batch_tokens if isinstance(t.micro_batch_tokens, int) else None,
        by_rows=t.micro_batch_tokens is None, micro_batch_size=t.micro_batch_size, packed=packed,
        max_kv_gib=cfg.rollout.max_kv_gib, offload_during_rollout=given(t.offload_during_rollout),
        tiled_mlp=None if m.mlp_chunk_tokens == "auto" else m.mlp_chunk_tokens is not None,
        mlp_chunk_tokens=m.mlp_chunk_tokens if isinstance(m.mlp_chunk_tokens, int) else mp.MLP_CHUNK_TOKENS)
    if fixed.activation_offload and fixed.gradient_checkpointing is None:  # offload needs checkpointing
        fixed = dataclasses.replace(fixed, gradient_checkpointing=True)
    return fixed


def resolve(cfg: TrainerConfig, *, world_size: int = 1, model: Any = None, device: torch.device | None = None,
            skeleton: Any = None, free_gib: float | None = None) -> Resolved:
    """Decide every "auto" of `cfg` for this run. `model`: a model given to `train` (else the config's is built as
    a skeleton when a decision needs it, or `skeleton` is that). `device`: the training device (default:
    `run_device`). `free_gib`: the device memory the budget defaults to (default: measured on the device)."""
    device = device or run_device(cfg, model)
    dtype = compute_dtype(cfg.model, device, model)
    single = world_size == 1 and not cfg.train.fsdp_offload
    budget_set = cfg.train.memory_budget_gib is not None
    r, t, m = cfg.rollout, cfg.train, cfg.model
    out = Resolved(cfg)
    subject = model if model is not None else skeleton
    if subject is None and (device.type == "cuda" or budget_set):  # CPU without a budget decides without it
        try:
            subject = model_skeleton(m, dtype)
        except Exception as e:  # noqa: BLE001 - without it only the decisions that read the model fall back
            out.notes.append(f"{UNREAD} without weights ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); the settings that read it fall back to "
                             "the plain path (hf rollout, padded micro-batches) and no memory plan is made")
    choose = _Choices(out)
    backend = choose("rollout.backend", r.backend, lambda: rollout_backend(cfg, device, subject))
    packed = choose("train.packed", t.packed, lambda: _packed(cfg, device, dtype, subject, loaded=model is not None))
    compiled = choose("model.compile_layers", m.compile_layers, lambda: _compile(cfg, device, single))
    liger = choose("model.liger_kernels", m.liger_kernels, lambda: _liger(cfg, device, world_size, compiled is True, subject))
    kernels = layer_kernels(compiled, liger)
    choose("objective.sampler_is_mode", cfg.objective.sampler_is_mode, lambda: _sampler_is(cfg))
    if subject is not None and is_moe(base_model(subject)):  # (a dense model has no experts to run)
        choose("model.experts_implementation", m.experts_implementation,
               lambda: resolve_experts_implementation("auto", device, dtype))

    fixed = _fixed_knobs(cfg, packed is True)
    if single and subject is not None and (device.type == "cuda" or budget_set):
        out.model = model_memory(subject, m, dtype)
        out.step = step_shape(cfg, subject, world_size)
        out.facts = run_facts(cfg, backend, kernels, device)
        budget = budget_bytes(cfg, device) if free_gib is None or budget_set else free_gib * mp.GIB
        out.plan = mp.plan(out.model, out.step, out.facts, fixed, budget)
        knobs = out.plan.knobs
        why = (f"memory plan: fits {budget / mp.GIB:.1f} GiB" if out.plan.fits else
               "memory plan: the leanest (nothing fits the budget)")
        off = {"model.gradient_checkpointing": "memory plan: the activations fit without it",
               "model.activation_offload": "memory plan: the layer inputs fit on the device",
               "train.offload_during_rollout": "memory plan: the rollout fits beside the optimizer states"}
    else:
        knobs = dataclasses.replace(fixed, gradient_checkpointing=bool(fixed.gradient_checkpointing),
                                    activation_offload=bool(fixed.activation_offload),
                                    offload_during_rollout=bool(fixed.offload_during_rollout),
                                    tiled_mlp=bool(fixed.tiled_mlp))
        why = "no memory plan: " + ("not made under torchrun or train.fsdp_offload" if not single else
                                    UNREAD if subject is None and (device.type == "cuda" or budget_set) else
                                    "CPU without train.memory_budget_gib")
        off = dict.fromkeys(("model.gradient_checkpointing", "model.activation_offload",
                             "train.offload_during_rollout"), why + "; off")
    for key, given, value in (("model.gradient_checkpointing", m.gradient_checkpointing, knobs.gradient_checkpointing),
                              ("model.activation_offload", m.activation_offload, knobs.activation_offload),
                              ("train.offload_during_rollout", t.offload_during_rollout, knobs.offload_during_rollout)):
        choose(key, given, lambda value=value, key=key: (value, why if value else off[key]))
    choose("model.mlp_chunk_tokens", m.mlp_chunk_tokens, lambda: _mlp_chunk(knobs, out, why))
    choose("train.micro_batch_tokens", t.micro_batch_tokens,
           lambda: (knobs.micro_batch_tokens, why if out.plan is not None else
                    f"{why}: micro-batches of train.micro_batch_size={t.micro_batch_size} rows"))
    if out.plan is not None:
        if r.max_kv_gib is None and knobs.max_kv_gib is not None:
            choose.add("rollout.max_kv_gib", knobs.max_kv_gib,
                       f"memory plan: {out.plan.rows_per_wave} rows per wave, {out.plan.waves} wave(s)")
        out.choices.append(Choice("train.memory_budget_gib", round(out.plan.budget / mp.GIB, 2),
                                  "set in the config" if budget_set else "the device's free memory at start",
                                  not budget_set))
    out.cfg = choose.config(cfg)
    if world_size > 1 and not t.fsdp_offload and subject is not None and (device.type == "cuda" or budget_set):
        out.ranks = world_size
        budget = budget_bytes(cfg, device) if free_gib is None or budget_set else free_gib * mp.GIB
        out.rank_memory = rank_memory(out.cfg, subject, dtype, device, world_size, budget)
        out.notes.extend(out.rank_memory.notes)
    return out


def rank_memory(cfg: TrainerConfig, model: Any, dtype: torch.dtype, device: torch.device, ranks: int,
                budget: float) -> mp.Plan:
    """The per-GPU memory of each phase of a step of the resolved `cfg` on `ranks` FSDP2 ranks
    (`memory_ranks.predict`, at the longest prompt the config allows), against one GPU's `budget` (bytes): fits is
    False, with a note, where the update (or an hf rollout, which has no waves) is predicted over its headroom."""
    from logitless.trainer.memory import ranks as mr

    kernels = layer_kernels(cfg.model.compile_layers, cfg.model.liger_kernels)
    copy = cfg.rollout.weight_copy or ("sleep" if device.type == "cuda" and not cfg.train.async_rollout else "resident")
    layout = mr.Ranks(ranks, mr.units_of(model), weight_copy="resident" if copy == "resident" else "sleep",
                      merged_replica=cfg.rollout.merge_lora is not False,
                      tensor_parallel=cfg.rollout.tensor_parallel if ranks % cfg.rollout.tensor_parallel == 0 else 1,
                      rollout_gpu=cfg.rollout.device is not None, fp8=cfg.rollout.fp8)
    knobs, step = mp.knobs_of(cfg), step_shape(cfg, model)
    phases = mr.predict(model_memory(model, cfg.model, dtype), step, run_facts(
        cfg, cfg.rollout.backend, kernels, device), knobs, layout)
    out = mp.Plan(knobs=knobs, budget=budget, phases=phases, rows_per_wave=mr.decode_step(step, layout).rows)
    # (the static engine decodes in waves under its own KV cap where rollout.max_kv_gib is unset)
    capped = cfg.rollout.backend == "static" and cfg.rollout.max_kv_gib is None
    over = [p for p in phases if out.peak(p) > mp.HEADROOM * out.budget
            and not (p in ("generate", mr.ROLLOUT_DEVICE) and capped)]
    if over:
        out.fits = False
        worst = max(over, key=out.peak)
        rollout = worst == "generate"
        leaner = [k for k, done in (("model.gradient_checkpointing=true", knobs.gradient_checkpointing or rollout),
                                    ("train.offload_during_rollout=true", knobs.offload_during_rollout or not rollout),
                                    ("rollout.weight_copy=sleep", copy != "resident")) if not done]
        leaner += ["fewer train.prompts_per_step" if rollout else
                   "a smaller train.micro_batch_tokens (or train.micro_batch_size)", "more ranks"]
        out.notes.append(
            f"memory model on {ranks} ranks: the {worst} phase is predicted at {out.peak(worst) / mp.GIB:.2f} GiB per "
            f"GPU, over {mp.HEADROOM:.0%} of {out.budget / mp.GIB:.2f} GiB; the run may run out of memory. Leaner: "
            f"{', '.join(leaner)}")
    return out


def _mlp_chunk(knobs: mp.Knobs, out: Resolved, why: str) -> tuple[int | None, str]:
    """(model.mlp_chunk_tokens, why) for "auto": the plan's chunk where it tiles the MLPs, else null."""
    if knobs.tiled_mlp:
        fits = out.plan is not None and out.plan.fits
        return knobs.mlp_chunk_tokens, (f"memory plan: only with the tiled MLP does the update fit "
                                        f"{out.plan.budget / mp.GIB:.1f} GiB" if fits else why)
    if out.plan is None:
        return None, why + "; off"
    if not out.model.mlp_tileable:
        if out.model.expert_bytes:
            return None, ("a mixture of experts: its MoE layers route each token to experts, and models/tiled_mlp.py "
                          "tiles only dense gated MLPs")
        return None, "the model's MLPs are not all dense gated MLPs (models/tiled_mlp.py)"
    return None, "memory plan: an untiled setting fits"


def budget_bytes(cfg: TrainerConfig, device: torch.device) -> float:
    """train.memory_budget_gib in bytes, else what this process can still use of the device plus what it already
    holds (a model given to `train` counts as part of the budget)."""
    if cfg.train.memory_budget_gib is not None:
        return cfg.train.memory_budget_gib * mp.GIB
    if device.type != "cuda":
        return math.inf
    return auto_kv_budget(device, 1.0) + torch.cuda.memory_allocated(device)


def step_shape(cfg: TrainerConfig, model: Any, world_size: int = 1) -> mp.StepShape:
    """The step's sizes on one process, at the longest prompt the config allows."""
    r = cfg.rollout
    context = getattr(text_config(base_model(model)), "max_position_embeddings", None)
    prompt = r.max_prompt_length if r.max_prompt_length is not None else max((context or 0) - r.max_completion_length, 1)
    prompts = max(-(-cfg.train.prompts_per_step // max(world_size, 1)), 1)  # the largest rank share
    agent = getattr(cfg, "agent", None)
    return mp.StepShape(prompts=prompts, rows=prompts * r.num_generations, prompt_len=prompt,
                        completion_len=r.max_completion_length, context=context,
                        episodes=bool(agent is not None and agent.enabled))


def layer_kernels(compile_layers: Any, liger_kernels: Any) -> str:
    """The plan's name of the decoder layers' kernels for model.compile_layers and model.liger_kernels as decided:
    "compiled", "liger" or "eager" (compiled layers win)."""
    return "compiled" if compile_layers is True else "liger" if liger_kernels is True else "eager"


def run_facts(cfg: TrainerConfig, backend: str, kernels: str, device: torch.device) -> mp.RunFacts:
    """What the plan reads of the config (the rollout's decode copy as `placement.engines.weight_copy` decides it)."""
    r, m, o = cfg.rollout, cfg.model, cfg.objective
    merged = backend == "static" and m.lora and r.merge_lora is not False
    mode = r.weight_copy or ("resident" if cfg.train.async_rollout or device.type != "cuda" else
                             "sleep" if m.load_in_4bit else "in_place")
    elsewhere = r.device is not None and not same_device(torch.device(r.device), device)
    return mp.RunFacts(
        backend=backend, decode_copy=merged and mode in ("resident", "sleep") and not elsewhere, kernels=kernels,
        optimizer=cfg.optim.optimizer,
        logprob_pass=cfg.train.num_iterations > 1 or o.beta > 0 or o.top_entropy_quantile < 1.0,
        reference_copy=o.beta > 0 and not m.lora, async_rollout=cfg.train.async_rollout, rollout_elsewhere=elsewhere,
        fp8=backend == "static" and r.fp8 and not elsewhere,
    )


# --- output ---------------------------------------------------------------------------------------------------------


def setting_text(v: Any) -> str:
    """A decided setting's value as a config override writes it (true, null, 8192)."""
    if isinstance(v, bool) or v is None:
        return str(v).lower() if v is not None else "null"
    return str(v)


def print_resolved(res: Resolved, console: Any = None) -> None:
    """The decided settings (value, auto or set, why) and the plan's predicted peak of each phase, as tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    table = Table(title="settings of this run", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("setting", "value", "", "why"):
        table.add_column(col, overflow="fold")
    for c in res.choices:
        table.add_row(c.key, setting_text(c.value), "auto" if c.auto else "set", c.reason)
    console.print(table)
    for note in res.notes:
        console.print(f"[yellow]warning:[/] {note}", highlight=False)
    if res.model is not None and moe_summary(res.model):
        console.print(moe_summary(res.model), highlight=False)
    memory = [("memory plan: predicted peak per phase (GiB)", res.plan),
              (f"memory model on {res.ranks} ranks: predicted peak per GPU and phase (GiB)", res.rank_memory)]
    for title, plan in memory:
        if plan is None:
            continue
        table = Table(title=f"{title}, budget {plan.budget / mp.GIB:.1f}", title_justify="left", show_edge=False,
                      pad_edge=False)
        for col in ("phase", "GiB", "parts"):
            table.add_column(col, overflow="fold")
        for row in mp.describe(plan):
            table.add_row(*row)
        console.print(table)
        if plan is res.plan:  # (the rank model's notes are the run's own, above)
            for note in plan.notes:
                console.print(f"[yellow]warning:[/] {note}")


def resolve_run(cfg: TrainerConfig, world: Any, *, model: Any = None) -> Resolved:
    """`resolve` for a training run, its table printed by the main process (on stdout, as the run's summary line at
    its end; stderr is for errors and the progress bar)."""
    from rich.console import Console

    res = resolve(cfg, world_size=world.size, model=model, device=world_device(cfg, model))
    if world.main:
        print_resolved(res, Console())
    return res


def save_resolved(res: Resolved, run_dir: Any) -> None:
    """resolved.json in the run folder, beside config.yaml: every decided setting, why, and the memory plan."""
    import json
    from pathlib import Path

    (Path(run_dir) / "resolved.json").write_text(json.dumps(res.to_json(), indent=1, default=str) + "\n")


def world_device(cfg: TrainerConfig, model: Any = None) -> torch.device:
    """The training device of this process (under torchrun, the GPU of its LOCAL_RANK: the current device)."""
    device = run_device(cfg, model)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def print_dry_run(cfg: TrainerConfig, console: Any = None, ranks: int = 1) -> None:
    """`logitless train --dry-run [--ranks N]`: the settings "auto" would decide on this machine and the memory plan
    (on N > 1 ranks: the memory model's per-GPU peaks), from the model's config alone (no weights are read), on
    stderr (stdout keeps the config as YAML). A model whose config cannot be read (offline, a typo) is named with
    the reason; the model load reports the real error."""
    from rich.console import Console

    console = console or Console(stderr=True)
    print_resolved(resolve(cfg, world_size=ranks, device=run_device(cfg)), console)
