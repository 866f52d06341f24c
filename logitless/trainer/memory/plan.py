"""The memory plan: the device memory each phase of a GRPO step needs, and the fastest settings that fit a budget.

Phases (the names of the measured `memory/peak_gb/<phase>`; the prediction is `memory/predicted_gb/<phase>`):

    generate   weights, trainable parameters and optimizer states (unless parked), the rollout's decode copy, the KV
               cache of one wave, the sampler's per-row buffers, the prefill of the step's prompts
    logprobs   weights and training state, one micro-batch's no-grad forward (old / reference logprobs; the phase
               only runs with num_iterations > 1, objective.beta > 0 or a top-entropy mask)
    train      weights and training state, gradients, one micro-batch's activations (all layers', or with gradient
               checkpointing each layer's input plus one layer recomputed; activation offload keeps the inputs on
               the host; a tiled MLP keeps its intermediates of one chunk of tokens, only while that chunk is
               back-propagated) and the fused op's workspace

Sizes are what torch's allocator holds (`max_memory_allocated`, what the phase clock measures), for one process.
The model is a few terms per token and per layer (`ModelMemory`); the constants below were fitted to the runs
recorded in bench/results (`python bench/bench_plan.py --check-recorded` prints predicted against measured for
every one of them; tests/test_memory_plan.py keeps them within 15 %).

`plan()` picks, for what the config leaves "auto", the fastest candidate of `TRAIN_LADDER` (untiled, then with the
tiled MLP) whose train (and logprobs) phase fits, and the KV cap (rows per wave) that fits the rollout, parking the
optimizer states during the rollout when that saves a wave. `leaner()` is the next plan after an out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30

# --- constants (bytes; fitted to bench/results, see the module docstring) -------------------------------------
ACT_SCALE = 0.9  # a decoder layer's saved activations per token = ACT_SCALE x activation_elements x dtype bytes
# One layer recomputed and back-propagated under gradient checkpointing, in units of a layer's activations:
# eager PyTorch, Liger's kernels (fewer fp32 temporaries), compiled layers (inductor keeps more for its backward).
RECOMPUTE = {"eager": 1.45, "liger": 1.2, "compiled": 1.85}
BACKWARD = 1.0  # without checkpointing: the last layer's backward transients beside all saved activations
# Compiled layers with a tiled MLP and no checkpointing: the tiled MLP runs eagerly between two compiled graphs of
# its layer, and the tensors crossing those graph breaks (kept for both graphs' backward) add about 2.25 x hidden
# elements per token and layer to what the plan counts: fitted on an H100 to the 1.5B (32k-token micro-batches,
# 25.46 GiB measured) and 7B (16k, 41.34 GiB) updates, which the plan without it put 30 % and 21 % low.
TILED_COMPILED_SAVED = 2.25
FORWARD = 1.0  # a no-grad forward holds about one layer's activations at a time
# Layer inputs still on the device under activation offload: the copies in flight to the host and the prefetched
# ones (offload kept 0.43 of 1.31 GiB of layer inputs on the device at 16k tokens, 1.5B shape).
OFFLOAD_KEPT_LAYERS = 9
OFFLOAD_RESIDUE = int(0.3 * GIB)  # measured beside activation offload in the other phases (0.2-0.38 GiB; unexplained)
# Padded (not packed) micro-batches attend with a materialized [S, S] mask per row (bool, its additive form and
# copies): bytes per position pair, fitted to the one long-row measurement (T = 16,384: 2.2 GiB above the rest).
MASK_BYTES = 7.5
HEAD_WORKSPACE = 256 * 2**20  # the fused op's row chunks (logprobs and entropy of a frozen lm_head)
HEAD_WORKSPACE_TRAINABLE = 768 * 2**20  # ... and its [V, H] weight-gradient chunks (full fine-tuning)
SAMPLER_BYTES_PER_VOCAB = 12  # per decoded row: its logits and sampling buffers over the vocabulary
CACHE_MULTIPLE = 128  # the static engine rounds its cache length up to this (StaticEngine.cache_multiple)
NF4_BYTES = 0.5 + 1 / 64  # a 4-bit (NF4, double-quantized) weight: 4 bits plus its block scales
HEADROOM = 0.9  # a plan keeps its predicted peak under this share of the budget (allocator fragmentation)
RETRY_SHARE = 0.8  # after an out-of-memory error, the next plan predicts at most this share of the failed one
# model.mlp_chunk_tokens=auto where the plan tiles the MLPs: one chunk's MLP intermediates (4 x I x 8,192 x 2 bytes,
# 0.75 GiB at 8B) beside a long row's other activations; GEMMs of 8,192 rows keep the GPU busy.
MLP_CHUNK_TOKENS = 8192

# Gradient checkpointing, activation offload, micro-batch tokens: fastest first (bench/LOG.md, 1.5B, T = 1,024:
# update 2.39 s without checkpointing at 32k tokens, 2.60 s at 16k, 3.25 s with it at 32k, 3.59 s at 16k). Where
# the model's MLPs can be tiled (model.mlp_chunk_tokens=auto) the same ladder follows with the tiled MLP, whose
# extra forward of every MLP the plan pays only when no untiled rung fits (a long row).
TRAIN_LADDER: tuple[tuple[bool, bool, int], ...] = (
    (False, False, 32768), (False, False, 16384), (True, False, 32768), (True, False, 16384),
    (True, True, 16384), (True, False, 8192), (True, True, 8192), (True, True, 4096), (True, True, 2048),
)
PHASES = ("generate", "logprobs", "train")


@dataclass(frozen=True)
class ModelMemory:
    """What the plan needs to know of a decoder-only causal LM (from its config; `auto.describe_model`)."""

    layers: int
    hidden: int
    intermediate: int  # MLP width a token goes through (MoE: experts per token x expert width)
    q_dim: int  # attention heads x head_dim
    kv_dim: int  # key/value heads x head_dim
    vocab: int
    dtype_bytes: int  # the compute dtype: 2 (bf16/fp16) or 4 (fp32)
    weight_bytes: int  # the weights as loaded (4-bit linear layers packed)
    params: int  # parameters (a tied embedding counted once)
    trainable: int  # trained parameters: the LoRA adapters, or all of them
    lora: bool
    merge_copy_bytes: int  # a merged decode copy of the LoRA-targeted layers, in the compute dtype
    mlp_tileable: bool = False  # every decoder layer has a dense gated MLP (models/tiled_mlp.py can tile it)
    # A mixture of experts: the bytes of its expert stacks (all experts, in weight_bytes: the weights, the replica
    # and the optimizer hold every expert; 4-bit under QLoRA, models/nf4_experts.py), and the
    # parameters a token goes through (k of E experts), whose MLP width `intermediate` is
    expert_bytes: int = 0
    active_params: int = 0  # 0: a dense model (all of `params` active)
    dequantized_expert_bytes: int = 0  # 4-bit experts: one MoE layer's stacks dequantized in the compute dtype
    # rollout.fp8 (rollout/fp8.py): the decoder layers' projections in FP8, 1 byte per weight and a 4-byte scale per
    # output row; what those projections take in weight_bytes; and the FP8 bytes of the LoRA-targeted ones among them
    fp8_bytes: int = 0
    fp8_source_bytes: int = 0
    fp8_merge_bytes: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position in every layer (the static engine keeps full-length caches in every layer)."""
        return self.layers * 2 * self.kv_dim * self.dtype_bytes

    @property
    def activation_elements(self) -> int:
        """Elements a decoder layer saves per token: norm outputs and residuals (4 H), q and the attention output
        (2 q_dim), k and v (2 kv_dim), gate, up, their activation and product (4 I)."""
        return 4 * self.hidden + 2 * self.q_dim + 2 * self.kv_dim + self.mlp_elements

    @property
    def mlp_elements(self) -> int:
        """Of those, the MLP's intermediates per token (gate, up, their activation and product), which a tiled MLP
        keeps for one chunk of tokens at a time and only while it back-propagates that chunk."""
        return 4 * self.intermediate


@dataclass(frozen=True)
class StepShape:
    """The sizes of one step on one process."""

    prompts: int  # distinct prompts (train.prompts_per_step / ranks)
    rows: int  # completions: prompts x num_generations
    prompt_len: int  # the longest prompt, tokens
    completion_len: int  # rollout.max_completion_length
    context: int | None = None  # the model's context window (caps the cache length)
    episodes: bool = False  # multi-turn episodes (agent.*): the static engine's cache holds P + 2 T + 1 slots

    @property
    def longest_row(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def cache_len(self) -> int:
        """Slots per row of the static engine's decode cache (`StaticEngine._cache_len`, `episode_cache_len`)."""
        if self.episodes:
            return -(-(self.longest_row + self.completion_len + 1) // CACHE_MULTIPLE) * CACHE_MULTIPLE
        length = -(-self.longest_row // CACHE_MULTIPLE) * CACHE_MULTIPLE
        return max(min(length, self.context), self.longest_row) if self.context else length


@dataclass(frozen=True)
class RunFacts:
    """Settings the plan reads but does not choose."""

    backend: str = "static"  # the resolved rollout backend
    decode_copy: bool = False  # the rollout keeps a merged copy (resident, or sleeping and mapped while it runs)
    kernels: str = "eager"  # "eager", "liger" or "compiled": how the decoder layers run in the update
    optimizer: str = "adamw"
    logprob_pass: bool = False  # the logprobs phase runs (num_iterations > 1, beta > 0, top-entropy mask)
    reference_copy: bool = False  # full fine-tuning with beta > 0 keeps a frozen copy of the weights
    async_rollout: bool = False  # the rollout runs beside the update
    rollout_elsewhere: bool = False  # rollout.device: the KV cache and decode weights are on another GPU
    fp8: bool = False  # rollout.fp8 on the static backend: one process decodes from an FP8 copy (`fp8_bytes`)


@dataclass(frozen=True)
class Knobs:
    """What the plan sets (one value each, or None while undecided)."""

    gradient_checkpointing: bool | None = None
    activation_offload: bool | None = None
    micro_batch_tokens: int | None = None  # None with `by_rows`: micro_batch_size rows per micro-batch
    by_rows: bool = False  # micro-batches of train.micro_batch_size rows (train.micro_batch_tokens=null)
    micro_batch_size: int = 16
    packed: bool = False
    max_kv_gib: float | None = None  # None: the static engine's own cap (or no waves at all)
    offload_during_rollout: bool | None = None
    tiled_mlp: bool | None = None  # model.mlp_chunk_tokens set (an int) or not (null)
    mlp_chunk_tokens: int = MLP_CHUNK_TOKENS  # the chunk of a tiled MLP

    def mlp_tokens(self, tokens: int) -> int:
        """Tokens whose MLP intermediates exist at once in a forward or a layer's backward of `tokens` tokens."""
        return min(self.mlp_chunk_tokens, tokens) if self.tiled_mlp else tokens


@dataclass
class Plan:
    """The plan's settings, its predicted peak of each phase (bytes, with their parts) and what it decided."""

    knobs: Knobs
    budget: float  # bytes
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> part -> bytes
    waves: int = 1
    rows_per_wave: int = 0
    fits: bool = True
    notes: list[str] = field(default_factory=list)  # why a setting is as it is, or why nothing fits

    def peak(self, phase: str) -> float:
        return sum(self.phases.get(phase, {}).values())

    @property
    def step_peak(self) -> float:
        return max((self.peak(p) for p in self.phases), default=0.0)

    def predicted_gb(self) -> dict[str, float]:
        """The metrics `memory/predicted_gb/<phase>` (GiB, as memory/peak_gb)."""
        return {f"memory/predicted_gb/{p}": self.peak(p) / GIB for p in self.phases}


# --- predictions ------------------------------------------------------------------------------------------------


def resident_bytes(m: ModelMemory, facts: RunFacts, *, parked: bool = False) -> dict[str, float]:
    """What every phase holds: weights, fp32 LoRA adapters, optimizer states (unless parked), a reference copy."""
    master = 4 * m.trainable if m.lora else 0  # LoRA adapters are fp32; full fine-tuning trains the weights
    per_state = 4 if m.lora else m.dtype_bytes  # AdamW keeps exp_avg and exp_avg_sq like the parameter
    states = {"adamw": 2 * per_state, "adamw_8bit": 2, "adamw_cpu_offload": 0}.get(facts.optimizer, 2 * per_state)
    parts = {"weights": float(m.weight_bytes), "adapters": float(master),
             "optimizer": 0.0 if parked else float(states * m.trainable)}
    if facts.reference_copy:
        parts["reference"] = float(m.weight_bytes)
    if m.dequantized_expert_bytes:  # every forward (decode, logprobs, update and its recompute), one layer at a time
        parts["dequantized experts"] = float(m.dequantized_expert_bytes)
    return parts


def rows_per_wave(m: ModelMemory, step: StepShape, max_kv_gib: float | None) -> tuple[int, int]:
    """(rows per wave, waves) as the static engine splits `step.rows` under a KV cap (`kv_cache.wave_rows`)."""
    row = step.cache_len * m.kv_bytes_per_token
    if max_kv_gib is None or step.rows * row <= max_kv_gib * GIB:
        return step.rows, 1
    fit = int(max_kv_gib * GIB // row)
    if fit < 1:
        return 0, math.inf  # type: ignore[return-value]
    waves = -(-step.rows // fit)
    return -(-step.rows // waves), waves


def generate_bytes(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs) -> dict[str, float]:
    """The rollout phase on the training device."""
    parts = resident_bytes(m, facts, parked=bool(knobs.offload_during_rollout))
    if knobs.activation_offload:
        parts["offload residue"] = float(OFFLOAD_RESIDUE)
    if facts.rollout_elsewhere:
        return parts
    if facts.fp8:  # the FP8 copy of the projections (the LoRA merge before it: in place, or freed before the decode)
        parts["decode copy"] = float(m.fp8_bytes)
    elif facts.decode_copy:
        parts["decode copy"] = float(m.merge_copy_bytes)
    if facts.backend == "static":
        rows, _ = rows_per_wave(m, step, knobs.max_kv_gib)
        parts["kv cache"] = float(rows * step.cache_len * m.kv_bytes_per_token)
    else:  # transformers generate: every row's growing cache, no waves
        rows = step.rows
        parts["kv cache"] = float(rows * step.longest_row * m.kv_bytes_per_token)
    parts["sampler"] = float(rows * SAMPLER_BYTES_PER_VOCAB * m.vocab)
    if facts.backend == "static" and step.episodes and m.q_dim > m.kv_dim:
        # an observation's prefill (several query tokens): a long one attends through transformers' sdpa, which
        # repeats one layer's K and V over the filled cache to every query head (1.97 GiB of the 4-turn 1.5B step's
        # 14.8 GiB at e27c681, over all slots); a short one (attention._fold_query) repeats only its mask. The
        # observations' length is the environment's, unknown here: the bound of the long case
        parts["observation prefill"] = float(2 * rows * step.cache_len * m.q_dim * m.dtype_bytes)
    # the prompts' own cache (copied into each wave's) and first logits; the prefill's forward ran before the
    # decode cache existed, so it counts where it is larger than the decode's share
    tokens = step.prompts * step.prompt_len
    parts["prefill"] = float(tokens * m.kv_bytes_per_token + step.prompts * 4 * m.vocab)
    forward = FORWARD * _layer_bytes(m, tokens, knobs.mlp_tokens(tokens))
    parts["prefill"] += max(0.0, forward - parts["kv cache"] - parts["sampler"])
    return parts


def _layer_bytes(m: ModelMemory, tokens: int, mlp_tokens: int | None = None) -> float:
    """One decoder layer's activations for `tokens` tokens, its MLP's intermediates for `mlp_tokens` of them
    (default: all; a tiled MLP's chunk, or none for what a layer keeps for its backward)."""
    mlp = tokens if mlp_tokens is None else mlp_tokens
    return ACT_SCALE * m.dtype_bytes * ((m.activation_elements - m.mlp_elements) * tokens + m.mlp_elements * mlp)


def mask_bytes(step: StepShape, knobs: Knobs, tokens: int) -> float:
    """The [S, S] attention masks of a padded micro-batch of `tokens` tokens whose rows are the longest (none when
    packed: the varlen path needs no mask; none for micro-batches of one row: it keeps only its own columns, and
    sdpa attends to an unpadded row with its causal kernel)."""
    if knobs.packed or step.rows == 1 or (knobs.by_rows and knobs.micro_batch_size == 1):
        return 0.0
    rows = max(tokens // step.longest_row, 1)
    return MASK_BYTES * rows * step.longest_row**2


def micro_tokens(step: StepShape, knobs: Knobs) -> int:
    """Tokens of the largest micro-batch (prompt + completion, padding included when not packed)."""
    if knobs.micro_batch_tokens is not None and not knobs.by_rows:
        return max(knobs.micro_batch_tokens, step.longest_row)
    return min(knobs.micro_batch_size, step.rows) * step.longest_row


def train_bytes(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs, tokens: int | None = None) -> dict[str, float]:
    """The update: resident state, gradients, one micro-batch's activations (`tokens`: its size, else the plan's
    largest) and the fused op's workspace."""
    n = micro_tokens(step, knobs) if tokens is None else tokens
    parts = resident_bytes(m, facts)
    parts["gradients"] = float(m.trainable * (4 if m.lora else m.dtype_bytes))
    # one layer back-propagated (its MLP's intermediates of one chunk where tiled), and what each layer keeps
    layer = _layer_bytes(m, n, knobs.mlp_tokens(n))
    if knobs.gradient_checkpointing:
        kept = min(OFFLOAD_KEPT_LAYERS, m.layers) if knobs.activation_offload else m.layers
        parts["layer inputs"] = float(kept * n * m.hidden * m.dtype_bytes)
        parts["recompute"] = RECOMPUTE.get(facts.kernels, RECOMPUTE["eager"]) * layer
    else:
        saved = _layer_bytes(m, n, 0 if knobs.tiled_mlp else n)
        if knobs.tiled_mlp and facts.kernels == "compiled" and n > knobs.mlp_chunk_tokens:  # graph breaks
            saved += TILED_COMPILED_SAVED * m.hidden * m.dtype_bytes * n
        parts["activations"] = m.layers * saved + BACKWARD * layer
    parts["lm head"] = float(HEAD_WORKSPACE if m.lora else HEAD_WORKSPACE_TRAINABLE) + n * m.hidden * 4
    parts["attention mask"] = mask_bytes(step, knobs, n)
    if facts.async_rollout and not facts.rollout_elsewhere:
        rollout = generate_bytes(m, step, facts, knobs)
        for k in ("decode copy", "kv cache", "sampler"):
            parts[f"rollout {k}"] = rollout.get(k, 0.0)
    return parts


def logprob_bytes(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs) -> dict[str, float]:
    """The no-grad old / reference logprobs of one micro-batch."""
    n = micro_tokens(step, knobs)
    parts = resident_bytes(m, facts)
    if knobs.activation_offload:
        parts["offload residue"] = float(OFFLOAD_RESIDUE)
    parts["forward"] = FORWARD * _layer_bytes(m, n, knobs.mlp_tokens(n)) + n * m.hidden * m.dtype_bytes
    parts["lm head"] = float(HEAD_WORKSPACE)
    parts["attention mask"] = mask_bytes(step, knobs, n)
    return parts


def predict(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs) -> dict[str, dict[str, float]]:
    """Predicted bytes of each phase, by part."""
    out = {"generate": generate_bytes(m, step, facts, knobs)}
    if facts.logprob_pass:
        out["logprobs"] = logprob_bytes(m, step, facts, knobs)
    out["train"] = train_bytes(m, step, facts, knobs)
    return out


# --- planning ---------------------------------------------------------------------------------------------------


def _train_candidates(m: ModelMemory, step: StepShape, fixed: Knobs) -> list[Knobs]:
    """The ladder's settings that agree with what is fixed (set in the config), fastest first: untiled, then (where
    model.mlp_chunk_tokens is auto and the model's MLPs can be tiled) the same with the tiled MLP."""
    out: list[Knobs] = []
    tiled = [fixed.tiled_mlp] if fixed.tiled_mlp is not None else [False, True] if m.mlp_tileable else [False]
    for tile, (gc, offload, tokens) in ((t, rung) for t in tiled for rung in TRAIN_LADDER):
        k = dataclasses.replace(
            fixed,
            gradient_checkpointing=gc if fixed.gradient_checkpointing is None else fixed.gradient_checkpointing,
            activation_offload=offload if fixed.activation_offload is None else fixed.activation_offload,
            tiled_mlp=tile,
        )
        if k.activation_offload and not k.gradient_checkpointing:
            continue
        if not fixed.by_rows:
            mbt = fixed.micro_batch_tokens if fixed.micro_batch_tokens is not None else max(tokens, step.longest_row)
            k = dataclasses.replace(k, micro_batch_tokens=mbt)
        if k not in out:
            out.append(k)
    return out


def plan(m: ModelMemory, step: StepShape, facts: RunFacts, fixed: Knobs, budget: float) -> Plan:
    """The fastest settings for what `fixed` leaves None whose predicted phases fit `HEADROOM x budget` bytes.

    Train and logprobs: the first fitting candidate of `TRAIN_LADDER` (the leanest, with fits=False, if none
    does). Rollout (static backend, rollout.max_kv_gib unset): as many rows per wave as fit beside the rest, the
    optimizer states parked during the rollout where that saves a wave (train.offload_during_rollout unset).
    """
    room = HEADROOM * budget
    candidates = _train_candidates(m, step, fixed)
    chosen = candidates[-1]
    for k in candidates:
        k_full = _with_rollout(m, step, facts, k, room)
        phases = predict(m, step, facts, k_full)
        if all(sum(phases[p].values()) <= room for p in phases if p != "generate"):
            chosen = k
            break
    knobs = _with_rollout(m, step, facts, chosen, room)
    result = Plan(knobs=knobs, budget=budget, phases=predict(m, step, facts, knobs))
    result.rows_per_wave, result.waves = rows_per_wave(m, step, knobs.max_kv_gib) if facts.backend == "static" \
        else (step.rows, 1)
    result.fits = result.step_peak <= room and result.waves != math.inf
    if not result.fits:
        result.notes.append(_no_fit_advice(m, step, result, budget))
    return result


def _with_rollout(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs, room: float) -> Knobs:
    """`knobs` with the rollout's KV cap and state parking decided (where they are still None)."""
    park = knobs.offload_during_rollout
    if facts.backend != "static" or facts.rollout_elsewhere or knobs.max_kv_gib is not None:
        return dataclasses.replace(knobs, offload_during_rollout=bool(park))
    options = [park] if park is not None else ([False] if facts.async_rollout else [False, True])
    best: tuple[int, Knobs] | None = None
    for parked in options:
        k = dataclasses.replace(knobs, offload_during_rollout=parked)
        cap = _kv_cap(m, step, facts, k, room)
        if cap is None:
            continue
        k = dataclasses.replace(k, max_kv_gib=cap)
        waves = rows_per_wave(m, step, cap)[1]
        if best is None or waves < best[0]:
            best = (waves, k)
    if best is None:  # not even one row: the smallest cap, refused by the engine with the setting to change
        return dataclasses.replace(knobs, offload_during_rollout=bool(park) if park is not None else True,
                                   max_kv_gib=_gib_up(step.cache_len * m.kv_bytes_per_token))
    return best[1]


def _kv_cap(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs, room: float) -> float | None:
    """The KV cap (GiB) of the most rows whose generate phase (or, with async_rollout, whose rollout beside the
    update) fits `room`; None if not one row fits."""
    row_kv = step.cache_len * m.kv_bytes_per_token
    per_row = row_kv + SAMPLER_BYTES_PER_VOCAB * m.vocab
    base = dict(generate_bytes(m, step, facts, dataclasses.replace(knobs, max_kv_gib=None)))
    used = sum(v for k, v in base.items() if k not in ("kv cache", "sampler"))
    if facts.async_rollout:  # the update runs at the same time: its own peak less the resident state counted above
        train = train_bytes(m, step, dataclasses.replace(facts, async_rollout=False), knobs)
        used += sum(train.values()) - sum(resident_bytes(m, facts).values())
    fit = min(step.rows, int((room - used) // per_row)) if room > used else 0
    if fit < 1:
        return None
    waves = -(-step.rows // fit)
    rows = -(-step.rows // waves)
    return _gib_up(rows * row_kv)


def _gib_up(nbytes: float) -> float:
    """GiB rounded up to 1/1000 (so the engine's floor division keeps the planned rows)."""
    return math.ceil(nbytes / GIB * 1000 + 1e-9) / 1000


def _no_fit_advice(m: ModelMemory, step: StepShape, p: Plan, budget: float) -> str:
    worst = max(p.phases, key=p.peak)
    leaner = ["lower rollout.max_completion_length or train.prompts_per_step"]
    if m.lora and m.weight_bytes > 0.3 * budget:
        leaner.insert(0, "model.load_in_4bit=true (QLoRA)")
    if not m.lora:
        leaner.insert(0, "train.fsdp_offload=true (or model.lora=true)")
    return (f"the leanest plan's {worst} phase is predicted at {p.peak(worst) / GIB:.2f} GiB, over "
            f"{HEADROOM:.0%} of train.memory_budget_gib={budget / GIB:.2f}; the run may run out of memory. "
            f"Leaner: {', or '.join(leaner)}")


def leaner(m: ModelMemory, step: StepShape, facts: RunFacts, knobs: Knobs, phase: str,
           cache_len: int = 0) -> Knobs | None:
    """The settings to retry a step with after it ran out of memory in `phase`, or None when there are none.

    generate (static backend): half the rows per wave (`cache_len`: the engine's cache length so far, when it has
    decoded; else the plan's). logprobs / train: down the ladder (checkpointing, then activation offload, then
    half the micro-batch, then the tiled MLP) until the predicted phase is at most RETRY_SHARE of the failed one.
    """
    if phase == "generate":
        if facts.backend != "static" or facts.rollout_elsewhere:
            return None
        if cache_len:
            step = dataclasses.replace(step, prompt_len=max(cache_len - step.completion_len, 0), context=None)
        rows, _ = rows_per_wave(m, step, knobs.max_kv_gib)
        if rows <= 1:
            return None
        return dataclasses.replace(knobs, max_kv_gib=_gib_up(-(-rows // 2) * step.cache_len * m.kv_bytes_per_token))
    target = "logprobs" if phase == "logprobs" else "train"

    def peak(k: Knobs) -> float:
        phases = predict(m, step, dataclasses.replace(facts, logprob_pass=True), k)
        return sum(phases[target].values())

    before, current = peak(knobs), knobs
    while True:
        down = _one_leaner(m, step, current)
        if down is None:
            return None if current is knobs else current
        current = down
        if peak(current) <= RETRY_SHARE * before:
            return current


def _one_leaner(m: ModelMemory, step: StepShape, k: Knobs) -> Knobs | None:
    """One step down: checkpointing on, then activation offload on, then half the micro-batch (never below one
    row: the longest row's tokens, or one row per micro-batch), then the tiled MLP (where the model's can be)."""
    if not k.gradient_checkpointing:
        return dataclasses.replace(k, gradient_checkpointing=True)
    if not k.activation_offload:
        return dataclasses.replace(k, activation_offload=True)
    if not k.by_rows and k.micro_batch_tokens is not None and k.micro_batch_tokens > step.longest_row:
        return dataclasses.replace(k, micro_batch_tokens=max(k.micro_batch_tokens // 2, step.longest_row))
    if k.by_rows and k.micro_batch_size > 1:
        return dataclasses.replace(k, micro_batch_size=k.micro_batch_size // 2)
    if not k.tiled_mlp and m.mlp_tileable:
        return dataclasses.replace(k, tiled_mlp=True)
    return None


def describe(p: Plan) -> list[tuple[str, str, str]]:
    """Rows (phase, predicted GiB, its largest parts) of a plan, for the table printed at the start of a run."""
    rows = []
    for phase in PHASES:
        if phase not in p.phases:
            continue
        parts = sorted(((v, k) for k, v in p.phases[phase].items() if v >= 0.005 * GIB), reverse=True)
        rows.append((phase, f"{p.peak(phase) / GIB:.2f}", ", ".join(f"{k} {v / GIB:.2f}" for v, k in parts)))
    return rows


def to_json(p: Plan) -> dict[str, Any]:
    """The plan as saved in the run folder's resolved.json."""
    return {"budget_gib": p.budget / GIB, "fits": p.fits, "waves": p.waves if p.waves != math.inf else None,
            "rows_per_wave": p.rows_per_wave, "notes": p.notes,
            "predicted_gib": {ph: p.peak(ph) / GIB for ph in p.phases},
            "parts_gib": {ph: {k: v / GIB for k, v in parts.items()} for ph, parts in p.phases.items()},
            "knobs": dataclasses.asdict(p.knobs)}


def knobs_of(cfg: Any) -> Knobs:
    """The plan's settings as a resolved config has them."""
    t, m = cfg.train, cfg.model
    return Knobs(gradient_checkpointing=m.gradient_checkpointing is True,
                    activation_offload=m.activation_offload is True, micro_batch_tokens=t.micro_batch_tokens,
                    by_rows=t.micro_batch_tokens is None, micro_batch_size=t.micro_batch_size, packed=t.packed is True,
                    max_kv_gib=cfg.rollout.max_kv_gib, offload_during_rollout=t.offload_during_rollout is True,
                    tiled_mlp=isinstance(m.mlp_chunk_tokens, int),
                    mlp_chunk_tokens=m.mlp_chunk_tokens if isinstance(m.mlp_chunk_tokens, int) else MLP_CHUNK_TOKENS)
