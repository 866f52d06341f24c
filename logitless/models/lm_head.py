"""The pieces of a Hugging Face causal LM that the fused logprob op needs: final hidden states and lm_head.

A causal LM computes `logits = f(lm_head(decoder(input_ids)))`. We run only the decoder body (its
`last_hidden_state` already has the final norm applied: Llama/Qwen `norm`, GPT-2 `ln_f`, ...) and hand
the lm_head weight/bias to the fused op, so the [B, L, V] logits are never computed. `f` must be
something the op can reproduce exactly: the identity, or a constant scale (folded into the temperature
through `LMHead.logit_multiplier`). Anything else (final-logit softcapping, a LoRA adapter on lm_head,
an unknown head module) is refused with `UnsupportedModelError`, which says what to do instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from logitless.models.vision import vision_modules


class UnsupportedModelError(ValueError):
    """The model is not a causal LM whose logits the fused op can reproduce exactly."""


@dataclass
class LMHead:
    weight: Tensor  # [V, H]
    bias: Tensor | None  # [V]
    logit_multiplier: float  # logits = (h·Wᵀ + b) * logit_multiplier; folded into the temperature


# Constant logit scales applied by the causal-LM class after (or just before) lm_head, by model_type.
# Each maps the text config to the multiplier m in `logits = lm_head(h) * m`.
_LOGIT_MULTIPLIERS = {
    # logits * config.logit_scale
    "cohere": lambda c: c.logit_scale,
    "cohere2": lambda c: c.logit_scale,
    "cohere2_moe": lambda c: c.logit_scale,
    # logits / config.logits_scaling
    "granite": lambda c: 1.0 / c.logits_scaling,
    "granite_swa": lambda c: 1.0 / c.logits_scaling,
    "granitemoe": lambda c: 1.0 / c.logits_scaling,
    "granitemoe_swa": lambda c: 1.0 / c.logits_scaling,
    "granitemoeshared": lambda c: 1.0 / c.logits_scaling,
    "granitemoehybrid": lambda c: 1.0 / c.logits_scaling,
    # logits * config.logits_scaling (MuP; note the opposite convention to Granite)
    "hyperclovax": lambda c: c.logits_scaling,
    # logits * config.lm_head_multiplier
    "falcon_h1": lambda c: c.lm_head_multiplier,
}
# Scales applied to the hidden state *before* lm_head: equal to a logit scale only without an lm_head bias.
_HIDDEN_MULTIPLIERS = {
    "minicpm3": lambda c: 1.0 / c.logits_scaling,  # lm_head(h / logits_scaling)
    "minicpm": lambda c: c.dim_model_base / c.hidden_size,  # remote code: lm_head(h / (hidden_size / dim_model_base))
}
# Config fields that signal some logit scaling; a model_type not in the tables above with one of these
# set to a non-trivial value is refused rather than silently computed wrong.
_SCALE_FIELDS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "scale_width", "dim_model_base")


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers `*ForCausalLM` module inside `model` (itself, or the base model of a PEFT wrapper).

    For a PEFT model the returned module is the one PEFT injected its adapter layers into, so calling
    its submodules runs the adapters (and `with peft_model.disable_adapter():` turns them off).
    """
    from transformers import PreTrainedModel

    lm = model
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but keep plain-transformers use working without it
        PeftModel = ()
    if PeftModel and isinstance(model, PeftModel):
        cfg = model.active_peft_config
        if getattr(cfg, "is_prompt_learning", False):
            raise UnsupportedModelError(
                f"PEFT method {cfg.peft_type} adds virtual prompt tokens, which the hidden-state path does not "
                "support; use an adapter method such as LoRA, or merge the adapter first"
            )
        lm = model.get_base_model()
    if not isinstance(lm, PreTrainedModel):
        raise UnsupportedModelError(
            f"model must be a transformers causal LM (e.g. from AutoModelForCausalLM), optionally PEFT-wrapped; "
            f"got {type(model).__name__}"
        )
    if getattr(lm.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"model {type(lm).__name__} is an encoder-decoder model; only decoder-only causal LMs are supported"
        )
    if lm.get_output_embeddings() is None:
        raise UnsupportedModelError(
            f"model {type(lm).__name__} has no lm_head (get_output_embeddings() is None); load it with "
            "AutoModelForCausalLM instead of AutoModel"
        )
    return lm


def _text_config(lm: nn.Module):
    cfg = lm.config
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if get is not None else cfg


def _logit_multiplier(lm: nn.Module, has_bias: bool) -> float:
    cfg = _text_config(lm)
    model_type = getattr(cfg, "model_type", "")
    for c in {id(cfg): cfg, id(lm.config): lm.config}.values():
        cap = getattr(c, "final_logit_softcapping", None)
        if cap is not None:
            raise UnsupportedModelError(
                f"model_type={model_type!r} applies final-logit softcapping (final_logit_softcapping={cap}): "
                "logits = cap * tanh(logits / cap) cannot be fused into the log-softmax. Set "
                "model.config.final_logit_softcapping = None to train without it (this changes the model's "
                "distribution), or use a dense logprob path"
            )
    if model_type in _LOGIT_MULTIPLIERS:
        m = float(_LOGIT_MULTIPLIERS[model_type](cfg))
    elif model_type in _HIDDEN_MULTIPLIERS:
        if has_bias:
            raise UnsupportedModelError(
                f"model_type={model_type!r} scales the hidden state before an lm_head that has a bias; this is "
                "not a constant logit scale and cannot be folded into the temperature"
            )
        m = float(_HIDDEN_MULTIPLIERS[model_type](cfg))
    else:
        for field in _SCALE_FIELDS:
            value = getattr(cfg, field, None)
            if value is not None and value != 1:
                raise UnsupportedModelError(
                    f"model_type={model_type!r} has config.{field}={value}, a logit scaling this library does not "
                    "know the convention of (multiply or divide); add the model_type to "
                    "logitless.models.lm_head._LOGIT_MULTIPLIERS to support it"
                )
        m = 1.0
    if not (math.isfinite(m) and m > 0):
        raise UnsupportedModelError(f"model_type={model_type!r} has a non-positive logit multiplier {m}")
    return m


def lm_head_of(model: nn.Module) -> LMHead:
    """The output projection of a causal LM: weight [V, H], bias [V] or None, constant logit multiplier.

    Handles tied and untied embeddings (a tied lm_head shares the embedding's Parameter, so gradients reach
    it either way), PEFT-wrapped models and PEFT `modules_to_save=["lm_head"]`. Raises
    `UnsupportedModelError` where the model's logits are not `(h·Wᵀ + b) * logit_multiplier`.
    """
    lm = causal_lm_of(model)
    head = lm.get_output_embeddings()
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        BaseTunerLayer = AuxiliaryTrainingWrapper = ()
    if BaseTunerLayer and isinstance(head, BaseTunerLayer):
        raise UnsupportedModelError(
            f"the lm_head carries a PEFT adapter ({type(head).__module__}.{type(head).__name__}), whose low-rank "
            "update the fused op cannot apply; leave 'lm_head' out of target_modules (use "
            "modules_to_save=['lm_head'] to train it fully), or merge the adapter (merge_and_unload) first"
        )
    if AuxiliaryTrainingWrapper and isinstance(head, AuxiliaryTrainingWrapper):
        # modules_to_save / trainable_token_indices: `.weight` resolves to the active copy (or merged weight).
        weight = head.weight
        try:
            bias = head.bias
        except AttributeError:
            bias = None
    elif isinstance(head, nn.Linear):
        weight, bias = head.weight, head.bias
    else:
        raise UnsupportedModelError(
            f"lm_head is a {type(head).__name__}, not an nn.Linear; the fused op needs a plain [V, H] weight"
        )
    hidden_size = getattr(_text_config(lm), "hidden_size", weight.shape[-1])
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] != hidden_size:
        raise UnsupportedModelError(
            f"lm_head weight must be a floating-point [V, H={hidden_size}] matrix, got dtype={weight.dtype} "
            f"shape={tuple(weight.shape)} (quantized heads are not supported; keep lm_head unquantized)"
        )
    return LMHead(weight=weight, bias=bias, logit_multiplier=_logit_multiplier(lm, bias is not None))


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder submodule of a causal LM whose `last_hidden_state` is the input of lm_head."""
    lm = causal_lm_of(model)
    body = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
    if not isinstance(body, nn.Module) or body is lm:
        body = lm.get_decoder()
    if body is lm and isinstance(getattr(lm, "model", None), nn.Module):
        body = lm.model  # e.g. Llama4ForCausalLM, whose base_model_prefix names its multimodal wrapper's attribute
    if body is lm:
        raise UnsupportedModelError(f"cannot find the decoder body of {type(lm).__name__}")
    return body


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM (`_no_split_modules` classes, else the body's `layers`); for a
    vision-language model those of its language model only."""
    lm = causal_lm_of(model)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    vision = {id(m) for v in vision_modules(lm) for m in v.modules()}  # a VLM's vision blocks are not decoder layers
    layers = [m for m in lm.modules() if type(m).__name__ in names and id(m) not in vision]
    if not layers:
        layers = list(getattr(decoder_body(model), "layers", []) or [])
    if not layers:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(lm).__name__}")
    return layers


def final_hidden_states(
    model: nn.Module,
    input_ids: Tensor,  # [B, L]
    attention_mask: Tensor | None,  # [B, L]
    position_ids: Tensor | None = None,  # [B, L] or [k, B, L] (M-RoPE); default: position_ids_from_mask(attention_mask)
    **attention_kwargs,  # passed to the body (a packed forward's cu_seq_lens_q; a VLM's pixel_values, ...)
) -> Tensor:  # [B, L, H]
    """Final (normed) hidden states of a causal LM, without computing logits.

    Equivalent to `model(input_ids, attention_mask, position_ids, output_hidden_states=True).hidden_states[-1]`
    (the input of lm_head), run with `use_cache=False` under the caller's grad mode. For a packed,
    padding-free batch pass `attention_mask=None` and `position_ids` restarting at 0 for each sequence. A
    vision-language model takes its image inputs and 3-row M-RoPE positions here (`vision.image_forward_inputs`).
    """
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, L] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    if position_ids is not None and tuple(position_ids.shape[-2:]) != tuple(input_ids.shape):
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must end with input_ids shape "
                         f"{tuple(input_ids.shape)}")
    if position_ids is None and attention_mask is not None:
        position_ids = position_ids_from_mask(attention_mask)
    body = decoder_body(model)
    out = body(
        input_ids=input_ids,
        attention_mask=None if attention_mask is None else attention_mask.long(),
        position_ids=position_ids,
        use_cache=False,
        **attention_kwargs,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


def position_ids_from_mask(mask: Tensor) -> Tensor:  # [B, L] -> [B, L] long
    """Position of each token among the real tokens of its row: `cumsum(mask) - 1`, clamped at 0.

    Left padding therefore does not shift positions, matching generation.
    """
    return (mask.long().cumsum(-1) - 1).clamp_(min=0)
