"""Which attention layouts (config.layer_types) a rollout backend decodes exactly, checked when the engine is built.

transformers' causal LMs mix full attention, sliding-window attention (Mistral, Qwen2 with use_sliding_window,
Phi-3; alternating with full layers in Gemma 2/3 and Cohere 2), chunked attention (Llama 4) and, in hybrid
families, recurrent or linear-attention layers. A backend that cannot reproduce a layout exactly refuses the
model here, naming backend "hf" (transformers `generate`, which runs every layout with the model's own cache).
"""

from __future__ import annotations

from typing import Any, Sequence

from logitless.models import UnsupportedModelError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


def text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def layer_types(cfg: Any) -> list[str]:
    """The attention type of each decoder layer: config.layer_types, else inferred as transformers' caches do."""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return list(types)
    if getattr(cfg, "sliding_window", None) is not None:
        kind = SLIDING
    elif getattr(cfg, "attention_chunk_size", None) is not None:
        kind = CHUNKED
    else:
        kind = FULL
    return [kind] * int(getattr(cfg, "num_hidden_layers", 0) or 0)


def check_layout(base: Any, backend: str, supported: Sequence[str]) -> list[str]:
    """The layer types of the transformers model `base`, if backend `backend` decodes each of them exactly
    (`supported`); raises UnsupportedModelError naming the model type and backend "hf" otherwise (also for
    encoder-decoders, KV-shared layers and models with their own cache class)."""
    cfg = text_config(base)
    model_type = getattr(cfg, "model_type", None) or type(base).__name__

    def refuse(why: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"rollout.backend={backend} cannot sample model_type {model_type!r} exactly: {why}. Use "
            "rollout.backend=hf (transformers generate), which runs every attention layout"
        )

    if getattr(cfg, "is_encoder_decoder", False):
        raise refuse("it is an encoder-decoder model")
    supports_cache = getattr(type(base), "_supports_default_dynamic_cache", None)
    if supports_cache is not None and not supports_cache():
        raise refuse("it keeps its own cache class instead of transformers' DynamicCache")
    if getattr(cfg, "num_kv_shared_layers", None):
        raise refuse(f"num_kv_shared_layers={cfg.num_kv_shared_layers}: some layers reuse another layer's KV cache")
    types = layer_types(cfg)
    other = sorted(set(types) - set(supported))
    if other:
        raise refuse(f"its layer_types include {other}; this backend supports {list(supported)}")
    return types
