"""Checks of a config against the model's own config, before its weights load: what `config.json` (or a GGUF's
metadata) and a weightless skeleton of the model can tell.

    read_model_config(cfg.model)       the transformers config: local folder, hub cache, or the GGUF's metadata
    check_model(cfg, config, ...)      positions, attention implementation, LoRA targets, Liger's model types, a
                                       tileable MLP (model.mlp_chunk_tokens);
                                       returns one line per check, raises ValueError naming the config key and fix

The skeleton is built on the meta device (`with torch.device("meta"): model_class(config).from_config(...)`): the
model's modules and shapes without memory or weights, in well under a second for billions of parameters. It is
built with the run's attention implementation, so transformers' own checks of that name run on it, and LoRA is
added to it as the run adds it (`peft.get_peft_model`), so the targets match exactly as they will.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from pathlib import Path
from typing import Any

import torch

from logitless.models.lm_head import decoder_body
from logitless.models.routing import RULES, is_moe, routing_of
from logitless.models.tiled_mlp import check_tileable
from logitless.models.varlen import NAME as VARLEN_ATTENTION
from logitless.models.varlen import register as register_varlen_attention
from logitless.models.vision import is_vision_language, model_class, packing_refusal
from logitless.rollout.weights import merge_targets
from logitless.trainer.config.schema import ModelConfig, TrainerConfig
from logitless.trainer.policy.lora_targets import add_lora, lora_config
from logitless.trainer.policy.modeling import resolve_dtype, resolve_device, resolve_source


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].rstrip('.') if text else ''}"


def model_config(cfg: TrainerConfig) -> ModelConfig:
    """cfg.model as loaded for the run: with `train.packed` and no attention named, `logitless_varlen` (varlen
    flash attention on CUDA, one sdpa call per row on CPU), whose cost follows the rows' own lengths; transformers'
    sdpa would compute a dense [S, S] block-diagonal mask over the packed sequence."""
    if cfg.train.packed is True and cfg.model.attn_implementation is None:
        return dataclasses.replace(cfg.model, attn_implementation=VARLEN_ATTENTION)
    return cfg.model


_READ: dict[tuple, Any] = {}  # the configs read in this process, by what names them (a GGUF's metadata: ~1 s)


def read_model_config(cfg: ModelConfig, *, cached: bool = False) -> Any:
    """The transformers config of the model `cfg` names (config.json of a local folder or of the hub, or the
    metadata of a GGUF file), read without its weights, once per process (the preflight's and the memory plan's
    reads are one; each caller gets its own copy). `cached`: the hub files are in the local cache (read them from
    there, no request)."""
    source, gguf = resolve_source(cfg)
    key = (str(source), gguf, cfg.revision, cfg.trust_remote_code, _mtime(source, gguf))
    if key not in _READ:
        _READ[key] = _read_config(cfg, source, gguf, cached)
    return copy.deepcopy(_READ[key])


def _mtime(source: Any, gguf: str | None) -> float | None:
    """When a local model's config (or GGUF file) last changed: a folder saved anew is read anew."""
    path = Path(str(source)) / (gguf or "config.json")
    return path.stat().st_mtime if path.is_file() else None


def _read_config(cfg: ModelConfig, source: Any, gguf: str | None, cached: bool) -> Any:
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if gguf:
        kwargs["gguf_file"] = gguf
    if cached:
        kwargs["local_files_only"] = True
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = f"model.name_or_path={cfg.name_or_path!r}" + (f" model.gguf_file={cfg.gguf_file!r}" if cfg.gguf_file else "")
        raise ValueError(
            f"{where}: its model config cannot be read ({_first_line(e)}); give the folder of a saved model (with a "
            "config.json naming its model_type), a .gguf file, or a hub name"
        ) from None


def context_window(config: Any) -> int | None:
    """The model's positions (max_position_embeddings of its text config), as the rollout reads them."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def check_positions(prompt: int | None, completion: int, window: int | None, *, prompt_key: str, completion_key: str,
                    model: str) -> str:
    """Refuse a completion length that leaves no room for a prompt in the model's positions, naming the key and
    the values that fit. A prompt limit that does not fit beside the completion is not an error: the rollout limits
    prompts to the positions the completion leaves, and every prompt is checked against that before training (the
    line returned says so)."""
    if window is None:
        return f"{completion_key}: the model's config has no max_position_embeddings, so its length is not checked"
    if completion >= window:
        fits = window - (prompt if prompt is not None and prompt < window else window // 2)
        raise ValueError(
            f"{completion_key}={completion} leaves no room for a prompt in the {window} positions of {model} "
            f"(max_position_embeddings): a prompt and its completion must fit them together. Set {completion_key} "
            f"below {window}, e.g. {completion_key}={fits}"
        )
    if prompt is None or prompt + completion > window:
        given = f", below {prompt_key}={prompt}" if prompt is not None else f" ({prompt_key}=null)"
        return (f"{completion_key}={completion} fits the model's {window} positions; prompts may have up to "
                f"{window - completion} tokens (the positions it leaves){given}: every prompt is checked against that "
                "before training")
    return (f"{prompt_key} + {completion_key} = {prompt} + {completion} = {prompt + completion} <= the model's "
            f"{window} positions")


def attention_names() -> list[str]:
    """The attention implementations transformers accepts by name, and logitless' own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys(), VARLEN_ATTENTION]


def check_attention_name(name: str | None) -> None:
    """Refuse an attention implementation transformers does not know, with the nearest valid name (a hub kernel,
    'org/repo', is left to transformers)."""
    if name is None or "/" in name:
        return
    names = attention_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    plain = [n for n in names if "|" not in n]
    raise ValueError(
        f"model.attn_implementation={name!r} is not an attention implementation{hint} Use one of {', '.join(plain)} "
        "(or unset it for transformers' default)"
    )


def skeleton(config: Any, cfg: ModelConfig, attn: str | None) -> torch.nn.Module:
    """The model's modules on the meta device (no memory, no weights), built with attention `attn`; transformers'
    refusal of the attention (not installed, not supported by this model) is re-raised naming the config key."""
    if attn == VARLEN_ATTENTION:
        register_varlen_attention()
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if cfg.dtype != "auto" or resolve_device(cfg.device).type == "cuda":
        kwargs["dtype"] = resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    if attn is not None:
        kwargs["attn_implementation"] = attn
    try:
        with torch.device("meta"):
            return model_class(config).from_config(config, **kwargs)
    except (ValueError, ImportError, RuntimeError) as e:
        if attn is None:
            raise ValueError(f"model.name_or_path={cfg.name_or_path!r}: transformers cannot build a causal LM from "
                             f"its config ({_first_line(e)})") from None
        raise ValueError(
            f"model.attn_implementation={attn!r} cannot be used with this model ({config.model_type}): "
            f"{_first_line(e)}. Set model.attn_implementation=sdpa (or unset it)"
        ) from None


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers, outside its output head ('q_proj', 'down_proj', ...)."""
    names = {name.rpartition(".")[2] for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] != "lm_head"}
    return sorted(names)


def check_lora_targets(model: torch.nn.Module, cfg: ModelConfig) -> str:
    """Add the run's LoRA adapters to the meta skeleton `model` (in place) and refuse targets that match no module
    (peft's own matching: names, regular expressions, 'all-linear'), naming the model's linear layers; a list
    entry that matches nothing beside others that do is refused too, with the nearest name."""
    from peft.tuners.tuners_utils import check_target_module_exists

    target = cfg.lora_target_modules
    available = linear_names(model)
    shown = f"model.lora_target_modules={target!r}"
    if isinstance(target, list):
        names = [name for name, _ in model.named_modules()]
        probe = lora_config(cfg, model)
        for entry in target:
            probe.target_modules = {entry}
            if not any(check_target_module_exists(probe, name) for name in names):
                close = difflib.get_close_matches(entry, available, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ValueError(
                    f"{shown}: '{entry}' matches no module of this model ({type(model).__name__}); {hint}Its linear "
                    f"layers are {', '.join(available)}; list some of those, or use all-linear"
                )
    if cfg.lora_target_experts:
        lora_config(cfg, model)  # refuses a model without fused expert weights, naming the setting
    try:
        with torch.device("meta"):
            peft_model = add_lora(model, cfg)
    except ValueError as e:
        raise ValueError(
            f"{shown} matches no module of this model ({type(model).__name__}): {_first_line(e)}. Its linear layers "
            f"are {', '.join(available)}; name some of those (a list, or a regular expression over the full module "
            "names), or use all-linear"
        ) from None
    targets = merge_targets(peft_model)
    layers = [path for path, param, _ in targets if param == "weight"]
    stacks = sorted({f"{path.rpartition('.')[2]}.{param}" for path, param, _ in targets if param != "weight"})
    line = f"{shown} adds LoRA adapters to {len(layers)} layers ({', '.join(sorted({n.rpartition('.')[2] for n in layers}))})"
    if stacks:
        line += (f"; model.lora_target_experts=true to {len(targets) - len(layers)} expert stacks "
                 f"({', '.join(stacks)}), an adapter per expert")
    return line


def check_router_aux(model: torch.nn.Module, coef: float) -> str:
    """Refuse model.router_aux_loss_coef > 0 for a model without routers the load-balancing loss can read."""
    if routing_of(model) is None:
        kind = "a mixture of experts whose routers logitless has no hook for" if is_moe(model) else \
            "not a mixture of experts"
        raise ValueError(f"model.router_aux_loss_coef={coef!r} adds a mixture-of-experts load-balancing loss, but "
                         f"{type(model).__name__} is {kind} (supported routers: {', '.join(sorted(RULES))}); set "
                         "model.router_aux_loss_coef=0")
    return (f"model.router_aux_loss_coef={coef!r}: the load-balancing loss of its {routing_of(model).layers} MoE "
            "layers is added to the policy loss")


def check_liger(config: Any) -> str:
    """Refuse model.liger_kernels for a model type Liger-Kernel has no kernels for (when it is installed; a missing
    package is refused by the device checks)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return "model.liger_kernels=true: liger_kernel is not installed here, so the model type is not checked"
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"model.liger_kernels=true: Liger-Kernel has no kernels for model type {model_type!r}; it "
                         f"supports {sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}. Set model.liger_kernels=false for this model")
    return f"model.liger_kernels=true: Liger-Kernel has kernels for model type {model_type!r}"


def check_model(cfg: TrainerConfig, config: Any, *, training: bool = True, attn: str | None = None) -> list[str]:
    """Every check of `cfg` against the model config `config`; `attn` is the attention implementation the run
    loads (model.attn_implementation, or logitless_varlen for train.packed). Returns what was checked."""
    name = cfg.model.name_or_path or "the demo model"
    window = context_window(config)
    check_attention_name(attn)
    model = skeleton(config, cfg.model, attn)
    layers = getattr(config.get_text_config(decoder=True), "num_hidden_layers", "?")
    lines = [f"model config of {name}: {type(model).__name__}, {layers} layers, {window} positions (its skeleton built "
             "on the meta device, no weights)"]
    r = cfg.rollout
    if training:
        lines.append(check_positions(r.max_prompt_length, r.max_completion_length, window, model=name,
                                     prompt_key="rollout.max_prompt_length", completion_key="rollout.max_completion_length"))
    else:
        key = "eval.max_completion_length" if cfg.eval.max_completion_length is not None else "rollout.max_completion_length"
        completion = cfg.eval.max_completion_length or r.max_completion_length
        lines.append(check_positions(r.max_prompt_length, completion, window, model=name,
                                     prompt_key="rollout.max_prompt_length", completion_key=key))
    lines.append(f"model.attn_implementation={attn!r}: transformers builds {type(model).__name__} with it"
                 if attn is not None else f"attention: transformers' default ({model.config._attn_implementation})")
    chunk = cfg.model.mlp_chunk_tokens
    if isinstance(chunk, int):
        check_tileable(model, chunk)
        lines.append(f"model.mlp_chunk_tokens={chunk}: every decoder layer has a dense gated MLP, tiled in chunks of "
                     f"{chunk} tokens")
    if training and cfg.train.packed is True and is_vision_language(config):
        why = packing_refusal(decoder_body(model))
        if why is not None:
            raise ValueError(f"train.packed=true: {why}")
        lines.append("train.packed=true: each packed row carries its own M-RoPE positions and images")
    if training and cfg.agent.enabled and is_vision_language(config):
        from logitless.rollout.static_rows import VISION_EPISODES_REFUSAL
        from logitless.trainer.policy.vision import decodes_static

        if decodes_static(cfg):
            raise ValueError(VISION_EPISODES_REFUSAL)
    if cfg.model.lora:
        lines.append(check_lora_targets(model, cfg.model))
    if cfg.model.liger_kernels is True:  # ("auto" turns them on only where they apply: trainer/memory/auto.py)
        lines.append(check_liger(config))
    if training and cfg.model.router_aux_loss_coef:
        lines.append(check_router_aux(model, cfg.model.router_aux_loss_coef))
    n = cfg.rollout.tensor_parallel
    if training and n > 1:
        from logitless.trainer.placement.tensor_parallel import KEY, family_refusal

        why = family_refusal(config, n)
        if why is not None:
            raise ValueError(f"{KEY}={n}: {why}")
        lines.append(f"{KEY}={n}: its heads and MLP width split over {n} ranks")
    return lines
