"""Which parameters a run's LoRA adapters adapt: peft's LoraConfig of `model.lora_*`, the fused expert stacks of a
mixture of experts (`model.lora_target_experts`), and `add_lora`, which adds them as the config names them."""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from typing import Iterator

from logitless.models.experts import EXPERT_PARAMS, expert_modules, moe_shape
from logitless.models.vision import vision_module_names
from logitless.rollout.engine import unwrap_model
from logitless.rollout.layouts import text_config
from logitless.trainer.config.schema import ModelConfig


def lora_config(cfg: ModelConfig, model=None):
    """peft's LoraConfig of `cfg` (model.lora_r, lora_alpha, lora_dropout, lora_target_modules, and with
    model.lora_target_experts the fused expert weights of `model`: `expert_targets`). A vision-language model's
    vision tower is excluded unless model.train_vision."""
    from peft import LoraConfig

    target = cfg.lora_target_modules
    experts = expert_targets(model, cfg) if cfg.lora_target_experts else {}
    vision = [] if cfg.train_vision or model is None else vision_module_names(unwrap_model(model))
    return LoraConfig(
        exclude_modules=vision_exclusion(vision),
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=target if isinstance(target, str) else list(target),
        target_parameters=list(experts) or None,
        rank_pattern={name: r for name, (r, _) in experts.items()},
        alpha_pattern={name: alpha for name, (_, alpha) in experts.items()},
        task_type="CAUSAL_LM",
    )


def vision_exclusion(names: list[str]) -> str | None:
    """peft's exclude_modules regex that keeps adapters out of the modules `names` and everything inside them (a
    vision-language model's vision tower, unless model.train_vision); None for no names."""
    if not names:
        return None
    return "^(" + "|".join(re.escape(n) for n in names) + r")(\..*)?$"


def expert_targets(model, cfg: ModelConfig) -> dict[str, tuple[int, float]]:
    """{peft target_parameters entry: (rank per expert, alpha)} for model.lora_target_experts: the fused 3-D expert
    weights (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj` in qwen3_moe, olmoe, mixtral, qwen2_moe, gpt_oss).

    peft gives each expert an adapter of its own (`ParamWrapper`: lora_A [E·r, in], lora_B [out, E·r]). Its rank is
    model.lora_r // k (k = experts per token, at least 1): a token's update then passes through k experts' adapters
    of total rank lora_r, as a dense layer's does, at E/k times a dense adapter's parameters (Qwen3-30B-A3B, E 128,
    k 8, r 16: rank 2 per expert, 79M adapter parameters over the 48 layers, where rank 16 per expert would be
    630M). alpha is scaled with the rank so every adapter of the model has the same scale lora_alpha / lora_r."""
    modules = expert_modules(model) if model is not None else []
    if not modules:
        kind = type(model).__name__ if model is not None else "the model"
        raise ValueError(f"model.lora_target_experts=true, but {kind} has no fused expert weights "
                         f"({' / '.join(EXPERT_PARAMS)} 3-D parameters of a mixture of experts); set "
                         "model.lora_target_experts=false")
    shape = moe_shape(text_config(unwrap_model(model)))
    rank = max(1, cfg.lora_r // (shape.active if shape is not None else 1))
    leaf = {name.rpartition(".")[2] for name, _ in modules}  # "experts" in every family named above
    targets = sorted(f"{name}.{p}" for name in leaf for p in EXPERT_PARAMS
                     if any(hasattr(m, p) for n, m in modules if n.rpartition(".")[2] == name))
    return {t: (rank, cfg.lora_alpha * rank / cfg.lora_r) for t in targets}


def add_lora(model, cfg: ModelConfig):
    """`model` with the LoRA adapters of `cfg` added (peft's get_peft_model), targeting what `cfg` names on the
    model as it is.

    peft (0.21, under transformers 5) rewrites the config of some MoE types on the way in, so that adapters
    trained on the transformers 4 layout still load: for qwen2_moe-style models (qwen3_moe, olmoe, deepseek) and
    mixtral it turns "all-linear" (and any gate_proj/up_proj/down_proj/gate target) into LoRA on the fused expert
    weights and on the router's weight, and the shared experts' or dense layers' gate/up/down projections of the same
    names are moved onto the experts. logitless trains adapters of its own on the model as loaded, so that rewrite
    is turned off here: "all-linear" means the model's linear layers (attention, shared experts, dense MLPs; never a
    router, which is not a linear layer in transformers 5), and the experts are adapted exactly when
    model.lora_target_experts is set."""
    from peft import get_peft_model

    config = lora_config(cfg, model)
    with _as_targeted(), warnings.catch_warnings():
        # peft checks rank_pattern / alpha_pattern keys against target_modules only and warns that the expert
        # stacks' (target_parameters) match nothing, yet applies them (tests/test_moe_lora.py checks the ranks)
        warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
        return get_peft_model(model, config)


@contextmanager
def _as_targeted() -> Iterator[None]:
    """peft's transformers-4-to-5 rewrite of a LoraConfig's targets (see `add_lora`) off inside."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft without it does not rewrite
        yield
        return
    original = getattr(conversion, "convert_peft_config_for_transformers", None)
    if original is None:
        yield
        return
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original
