"""The static engine's KV caches: which attention layouts it decodes exactly, the prefill cache, and the static
decode cache filled from it.

Every attention layer gets a full-length cache in absolute sequence positions, whatever its type: slot j holds
the key/value of sequence index j (left padding included), as in a full forward. Sliding-window and chunked
layers then need nothing of their own: the model's mask functions apply the window or chunk from the query
offset (a tensor, so the compiled decode step is one graph for every step), exactly as `model(ids).logits` does.

transformers' own `StaticCache` gives sliding layers a rolling buffer of `sliding_window` slots
(`StaticSlidingWindowLayer`) whose length is a python int. Filling it from a prefill by hand leaves that int at
0, so the decode mask and query offset of every sliding layer were those of an empty cache (wrong logprobs, up
to 5.5 nats on a tiny random Mistral); prompts longer than the window did not even fit. The int also changes the
compiled graph at every step. A full-length buffer costs `L - sliding_window` more slots per sliding layer when
the cache is longer than the window.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from logitless.models import UnsupportedModelError

# layer types (config.layer_types) whose masks are a function of (query index, key index, padding) only
EXACT_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def attention_layer_types(base: Any) -> list[str]:
    """The layer type of each decoder layer of the transformers model `base`, checked to be one the static engine
    decodes exactly (full, sliding-window, chunked attention); raises UnsupportedModelError naming the model type
    and the `hf` backend otherwise (recurrent / linear-attention layers, KV-shared layers, custom caches)."""
    cfg = text_config(base)
    model_type = getattr(cfg, "model_type", type(base).__name__)

    def refuse(why: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"rollout.backend=static cannot decode model_type {model_type!r} exactly: {why}. Use "
            "rollout.backend=hf (transformers generate), which supports it"
        )

    if getattr(cfg, "is_encoder_decoder", False):
        raise refuse("it is an encoder-decoder model")
    supports_cache = getattr(type(base), "_supports_default_dynamic_cache", None)
    if supports_cache is not None and not supports_cache():
        raise refuse("it keeps its own cache type instead of transformers' DynamicCache")
    if getattr(cfg, "num_kv_shared_layers", None):
        raise refuse(f"num_kv_shared_layers={cfg.num_kv_shared_layers} layers reuse another layer's KV cache")
    n = getattr(cfg, "num_hidden_layers", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "sliding_window", None) is not None:
            kind = "sliding_attention"
        elif getattr(cfg, "attention_chunk_size", None) is not None:
            kind = "chunked_attention"
        else:
            kind = "full_attention"
        types = [kind] * (n or 0)
    other = sorted(set(types) - set(EXACT_LAYER_TYPES))
    if other:
        raise refuse(f"its layer_types include {other}; it supports {list(EXACT_LAYER_TYPES)}")
    return list(types)


def prefill_cache() -> DynamicCache:
    """A dynamic cache whose layers all keep every position (no sliding-window trimming), so the whole prompt's
    keys/values can be copied into the decode cache."""
    return DynamicCache()  # without a config, every layer is a full DynamicLayer


def decode_cache(prefill: DynamicCache, repeats: int, max_len: int) -> Cache:
    """Static cache of `max_len` slots per layer holding `prefill`'s keys/values (for P positions) with each row
    repeated `repeats` times, ready to decode position P. Slot j is sequence index j in every layer."""
    layers = []
    for src in prefill.layers:
        k = src.keys.repeat_interleave(repeats, 0)  # [B, kv, P, d]
        v = src.values.repeat_interleave(repeats, 0)
        P = k.shape[2]
        if P > max_len:
            raise ValueError(f"decode_cache: the prefill holds {P} positions, more than max_len={max_len}")
        layer = StaticLayer(max_cache_len=max_len)
        layer.lazy_initialization(k, v)
        layer.keys[:, :, :P].copy_(k)
        layer.values[:, :, :P].copy_(v)
        layer.cumulative_length.fill_(P)
        layers.append(layer)
    return Cache(layers=layers)

