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

import math

import torch
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


class BucketedLayer(StaticLayer):
    """A static layer whose attention sees only its first `visible` slots (a python int, so each value is its own
    compiled graph): decode attention reads the filled part of the cache, rounded up to a length bucket, instead
    of all `max_cache_len` slots. Slots past the last written position are masked anyway, so the result is the
    same up to the summation order."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.visible = max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.visible == self.max_cache_len:
            return keys, values
        return keys[:, :, : self.visible], values[:, :, : self.visible]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.visible, 0


def length_buckets(prompt_len: int, max_len: int, buckets: int, multiple: int) -> list[int]:
    """`buckets` visible lengths between the prompt and `max_len`, each a multiple of `multiple` (the last is
    max_len): the decode step at sequence index j attends over the smallest bucket > j."""
    span = max_len - prompt_len
    out = {max_len}
    for k in range(1, buckets):
        out.add(min(max_len, -(-(prompt_len + span * k // buckets) // multiple) * multiple))
    return sorted(out)


def set_visible(cache: Cache, visible: int) -> None:
    for layer in cache.layers:
        layer.visible = visible


def select_rows(cache: Cache, rows: torch.Tensor) -> Cache:
    """A new decode cache holding rows `rows` of `cache` (same length, filled positions and visible slots)."""
    layers = []
    for src in cache.layers:
        layer = BucketedLayer(max_cache_len=src.max_cache_len)
        layer.lazy_initialization(src.keys[rows], src.values[rows])
        layer.keys.copy_(src.keys[rows])
        layer.values.copy_(src.values[rows])
        layer.cumulative_length.copy_(src.cumulative_length)
        layer.visible = src.visible
        layers.append(layer)
    return Cache(layers=layers)


class RowSlotLayer(BucketedLayer):
    """A static layer whose rows each write their own slot: `update` writes row b's one new key/value at slot
    `slot[b]` ([b] long, set by the decode step before each forward and shared by every layer), so rows that began
    decoding at different steps each keep their tokens right after their own prompt. Its sequence length (the
    causal mask's query offset) stays at the last slot, so causality hides nothing and the attention mask alone
    says which slots a row sees (`static_refill.py`). Full-attention layers only: a sliding window or chunk would
    be measured from that shared offset."""

    def __init__(self, max_cache_len: int, slot: torch.Tensor, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.slot = slot  # [b] long

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        index = self.slot[:, None, None, None].expand(-1, key_states.shape[1], 1, key_states.shape[3])
        self.keys.scatter_(2, index, key_states)  # key_states [b, kv, 1, d]
        self.values.scatter_(2, index.expand(-1, -1, -1, value_states.shape[3]), value_states)
        return self.keys, self.values


def load_prompts(cache: Cache, prefill: DynamicCache, rows: torch.Tensor, src: torch.Tensor) -> None:
    """Rows `rows` [k] of the decode cache take the keys/values of prefill rows `src` [k] in their first P slots, as
    `decode_cache` fills a fresh cache; their later slots keep what they held (the caller's mask hides them)."""
    for dst, pre in zip(cache.layers, prefill.layers):
        P = pre.keys.shape[2]
        dst.keys[rows, :, :P] = pre.keys.index_select(0, src)
        dst.values[rows, :, :P] = pre.values.index_select(0, src)


def decode_cache(prefill: DynamicCache, rows: torch.Tensor, max_len: int, slot: torch.Tensor | None = None) -> Cache:
    """Static cache of `max_len` slots per layer whose row b holds the keys/values of prefill row `rows[b]` (for
    P positions), ready to decode position P. Slot j is sequence index j in every layer. slot: each row writes at
    its own slot (`RowSlotLayer`, [b] long) instead of one write position for all rows."""
    layers = []
    for src in prefill.layers:
        k = src.keys.index_select(0, rows)  # [B, kv, P, d]
        v = src.values.index_select(0, rows)
        P = k.shape[2]
        if P > max_len:
            raise ValueError(f"decode_cache: the prefill holds {P} positions, more than max_len={max_len}")
        layer = BucketedLayer(max_cache_len=max_len) if slot is None else RowSlotLayer(max_len, slot)
        layer.lazy_initialization(k, v)
        layer.keys[:, :, :P].copy_(k)
        layer.values[:, :, :P].copy_(v)
        layer.cumulative_length.fill_(P if slot is None else max_len - 1)
        layers.append(layer)
    return Cache(layers=layers)


def kv_bytes_per_token(prefill: DynamicCache) -> int:
    """Bytes of one row's keys and values for one position, summed over the layers of `prefill`."""
    total = 0
    for layer in prefill.layers:
        for t in (layer.keys, layer.values):
            total += t.element_size() * t.shape[1] * t.shape[3]  # [n, kv, P, d]
    return total


def auto_kv_budget(device: torch.device, fraction: float) -> float | None:
    """Bytes the decode cache may use when no budget is set: `fraction` of the device memory that is free now
    (driver-free plus what torch's allocator holds unused outside private pools, within
    torch.cuda.set_per_process_memory_fraction's cap). None (no cap) off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cached = _cached_unused(device)
    capped = torch.cuda.get_per_process_memory_fraction(device) * total - reserved  # room under the process cap
    return fraction * (min(free, max(capped, 0.0)) + cached)


def _cached_unused(device: torch.device) -> int:
    """Bytes torch's allocator holds unused in its default pool. Free blocks of private pools (the CUDA graphs' of
    compiled decode steps) cannot hold a new cache, so they do not count."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(s["total_size"] - s["allocated_size"] for s in torch.cuda.memory_snapshot()
               if s["device"] == index and tuple(s.get("segment_pool_id", (0, 0))) == (0, 0))


def wave_rows(num_rows: int, row_bytes: int, budget: float | None, what: str) -> int:
    """Rows decoded together so that rows x row_bytes fits `budget` bytes (None: all rows), spread evenly over
    the fewest waves. Raises naming `what` (the budget's setting) and the smallest value that works."""
    if budget is None or num_rows * row_bytes <= budget:
        return num_rows
    fit = int(budget // row_bytes)
    if fit < 1:
        gib = row_bytes / 2**30
        unit = 10.0 ** (math.floor(math.log10(gib)) - 2)  # 3 significant digits, rounded up
        need = float(f"{math.ceil(gib / unit * (1 - 1e-12)) * unit:.3g}")
        need = need if need * 2**30 >= row_bytes else float(f"{need + unit:.3g}")
        raise ValueError(
            f"{what}={budget / 2**30:.4g} GiB is too small for the KV cache of one row ({row_bytes / 2**30:.4g} "
            f"GiB: prompt + max_new_tokens positions); set {what} >= {need}, or lower max_new_tokens"
        )
    waves = -(-num_rows // fit)
    return -(-num_rows // waves)
