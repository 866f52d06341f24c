"""Mixtures of experts as transformers (5.x) lays them out: fused 3-D expert weights, a backend for their forward.

Every MoE family logitless names (qwen3_moe, olmoe, mixtral, qwen2_moe, gpt_oss) keeps a decoder layer's experts
in one module (`mlp.experts`) holding two stacked parameters, `gate_up_proj` [E, 2I, H] (gpt_oss: [E, H, 2I],
gate and up interleaved) and `down_proj` [E, H, I] (gpt_oss: [E, I, H]), and picks their forward by
`config._experts_implementation` (transformers' `@use_experts_implementation`, `integrations/moe.py`):

    eager       the model's own: a Python loop over the experts hit (`nonzero` and one GEMM each; a host sync,
                not capturable in a CUDA graph)
    grouped_mm  tokens sorted by expert, one `torch.nn.functional.grouped_mm` (or `torch._grouped_mm`) per
                projection over all experts; no host sync on CUDA SM90+ in bf16
    batched_mm  each (token, expert) pair gathers its own copy of the expert's weights and runs one `bmm`:
                static shapes, but memory of rows x k x one expert's weights (GiB per layer at a 30B shape)

transformers (5.17) keeps the choice in `config._experts_implementation`, read by every experts module at each
forward; `from_pretrained(..., experts_implementation=...)` sets it at load, `model.set_experts_implementation(...)`
at any time (sub-models included). Unset, it is grouped_mm for every class carrying the decorator, on any device:
on CPU torch's grouped GEMM has a kernel of its own (fp32 too; transformers falls back to a per-expert loop on torch
<= 2.8 or unaligned weights), on CUDA below SM80, in fp32 under torch.compile, or without torch's grouped GEMM, a
looping custom op with one `.tolist()` host sync. `generate()` swaps grouped_mm for batched_mm while it decodes on
a GPU (`_optimize_model_for_decode`); the static engine does not go through `generate` and decodes with the
model's own setting. logitless sets it once per loaded model (`trainer/policy/modeling.py load_model`); copies of the
model (the rollout's merged copy, the torchrun replica, the decode process's pickled replica) carry it in their
config.

`model.experts_implementation` picks one (`resolve_experts_implementation`): "auto" is grouped_mm on a CUDA
device of compute capability 9.0 or more (H100, H200) in bfloat16 with torch's grouped GEMM available, where
it runs as one grouped GEMM without a host sync, which the static engine's decode step can compile and capture
(tests/test_moe_experts.py checks the capture on a GPU; not yet run on one); the model's own
(eager) everywhere else: on CPU the reference loop (no host sync to avoid there), on older GPUs or in
float32/float16, where transformers' grouped path would fall back to a per-expert loop with a host sync
(`_grouped_mm_fallback`) or inductor refuses grouped_mm (bf16 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused 3-D expert weights (per-expert LoRA targets)
QUANTIZED = "_nf4_stacks"  # a 4-bit experts module's {stack name: StackMeta} (`nf4_experts.quantize_experts`)
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
GROUPED_MM_CAPABILITY = (9, 0)  # SM90: grouped GEMM as one kernel without a host sync (H100, H200)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of `model`: a module holding `gate_up_proj` or `down_proj` as a 3-D
    parameter of its own, or stored in 4-bit (`nf4_experts`), one per MoE layer, with peft's wrappers seen through
    (`base_layer`)."""
    out = []
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            continue  # (peft's: its innermost base layer is listed itself)
        params = dict(module.named_parameters(recurse=False))
        shapes = [p.shape for n, p in params.items() if n in EXPERT_PARAMS]
        parametrized = getattr(module, "parametrizations", {})  # (peft's LoRA during a forward: W + ΔW on read)
        shapes += [parametrized[n].original.shape for n in EXPERT_PARAMS if n in parametrized]
        shapes += [meta.shape for meta in getattr(module, QUANTIZED, {}).values()]
        if any(len(s) == 3 for s in shapes):
            out.append((name, module))
    return out


def is_moe(model: nn.Module) -> bool:
    return bool(expert_modules(model))


@dataclass(frozen=True)
class MoEShape:
    """A mixture of experts' sizes from its text config."""

    experts: int  # E, experts per MoE layer
    active: int  # k, experts each token goes through
    expert_intermediate: int  # I, one expert's MLP width
    shared_intermediate: int = 0  # a shared expert every token goes through (qwen2_moe), 0 when none

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token goes through: k experts and the shared one."""
        return self.active * self.expert_intermediate + self.shared_intermediate


def moe_shape(text_config: Any) -> MoEShape | None:
    """The MoE sizes of a (text) config, or None for a dense model. Expert width: moe_intermediate_size (qwen2_moe,
    qwen3_moe, deepseek), else intermediate_size (mixtral, olmoe, gpt_oss)."""
    k = getattr(text_config, "num_experts_per_tok", None)
    experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
    if not k or not experts:
        return None
    width = getattr(text_config, "moe_intermediate_size", None) or getattr(text_config, "intermediate_size", None)
    shared = getattr(text_config, "shared_expert_intermediate_size", None) or 0
    return MoEShape(experts=int(experts), active=int(k), expert_intermediate=int(width), shared_intermediate=int(shared))


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether transformers' grouped_mm experts run as one grouped GEMM without a host sync here, why)."""
    if device.type != "cuda":
        return False, f"{device.type}: the model's own loop (the reference; no host sync to avoid off CUDA)"
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False, f"torch {torch.__version__} has no grouped GEMM (torch.nn.functional.grouped_mm)"
    try:
        capability = torch.cuda.get_device_capability(device)
    except (AssertionError, RuntimeError) as e:  # (a plan for a CUDA device made where there is none: --dry-run)
        return False, f"the GPU's compute capability cannot be read here ({type(e).__name__})"
    if capability < GROUPED_MM_CAPABILITY:
        return False, (f"compute capability {capability[0]}.{capability[1]} < 9.0: torch's grouped GEMM is measured "
                       "only on SM90 (below it a fallback may sync with the host, breaking the decode's CUDA graph)")
    if dtype != torch.bfloat16:
        return False, (f"the model computes in {str(dtype).removeprefix('torch.')}: grouped_mm runs compiled only in "
                       "bfloat16 (transformers falls back to a per-expert loop otherwise)")
    return True, "CUDA SM90+, bfloat16: one grouped GEMM per projection over all experts, no host sync"


def resolve_experts_implementation(setting: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(backend, why) for model.experts_implementation=`setting` on `device` in `dtype`."""
    if setting not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"model.experts_implementation={setting!r}: use auto, {', '.join(IMPLEMENTATIONS)}")
    if setting != "auto":
        return setting, "set in the config"
    fast, why = grouped_mm_runs(device, dtype)
    return ("grouped_mm" if fast else "eager"), why


def set_experts_implementation(model: nn.Module, implementation: str) -> bool:
    """Make every experts module of `model` (a transformers model, or one wrapped by peft) run `implementation`
    (transformers' `set_experts_implementation`, sub-models included). Returns False, leaving the model as it is,
    for a model without experts or one whose class does not pick its experts' forward through transformers (remote
    code without `@use_experts_implementation`)."""
    if not is_moe(model):
        return False
    base = model
    while hasattr(base, "get_base_model"):  # peft's wrappers
        base = base.get_base_model()
    settable = getattr(base, "_can_set_experts_implementation", None)
    if settable is None or not settable():
        return False
    base.set_experts_implementation(implementation)
    return True


def graph_capturable(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """(whether `model`'s experts run on `device` without a host sync, so a CUDA graph can capture its forward; why
    not). True for a dense model and for batched_mm; grouped_mm where it runs as one grouped GEMM
    (`grouped_mm_runs` for the experts' dtype); never for eager, whose loop over the experts hit reads their ids on
    the host in every MoE layer."""
    modules = expert_modules(model)
    if not modules or device.type != "cuda":
        return True, ""
    impl = experts_implementation(model)
    if impl == "batched_mm":
        return True, ""
    if impl == "grouped_mm":
        module = modules[0][1]
        quantized = getattr(module, QUANTIZED, {})  # 4-bit stacks compute in their dequantized dtype
        dtype = next(iter(quantized.values())).dtype if quantized else next(
            p.dtype for p in module.parameters() if p.is_floating_point())
        fast, why = grouped_mm_runs(device, dtype)
        return fast, ("" if fast else f"grouped_mm experts fall back to a loop with a host sync here ({why})")
    return False, f"{impl} experts loop over the experts hit, reading their ids on the host in every MoE layer"


def experts_implementation(model: nn.Module) -> str | None:
    """The backend `model`'s experts run (None for a model without experts)."""
    modules = expert_modules(model)
    if not modules:
        return None
    config = getattr(modules[0][1], "config", None)
    return getattr(config, "_experts_implementation", None)
