"""The static engine's KV caches: the prefill cache, and the static decode cache filled from it.

Every attention layer gets a full-length cache in absolute sequence positions, whatever its type: slot j holds
the key/value of sequence index j (left padding included), as in a full forward. Sliding-window and chunked
layers then need nothing of their own: the model's mask functions apply the window or chunk from the query
offset (a tensor, so the compiled decode step is one graph for every step), exactly as `model(ids).logits` does.

transformers' own `StaticCache` gives sliding layers a rolling buffer of `sliding_window` slots
(`StaticSlidingWindowLayer`) whose length is a python int. Filling it from a prefill by hand leaves that int at
0, so the decode mask and query offset of every sliding layer were those of an empty cache (wrong logprobs, up
to 5.5 nats on a tiny random Mistral); prompts longer than the window did not even fit. The int also changes the
compiled graph at every step. A full-length buffer costs `L - sliding_window` more slots per sliding layer when
the cache is longer than the window. Layouts this cannot reproduce are refused when the engine is built
(`layouts.check_layout`).
"""

from __future__ import annotations

from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from .layouts import CHUNKED, FULL, SLIDING

# every layer type whose mask is a function of (query index, key index, padding) only, so a full-length cache in
# absolute positions reproduces it
STATIC_LAYER_TYPES = (FULL, SLIDING, CHUNKED)


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
