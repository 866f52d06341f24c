"""Vision-language (image-text-to-text) models: Qwen2.5-VL, Qwen3-VL, Gemma 3.

Such a model is `visual(pixels) -> features`, scattered into the language model's input embeddings at the prompt's
image placeholder tokens, then a causal language model with an lm_head. Its final hidden states come from the
multimodal body (`decoder_body`) given the image tensors of the rows; the fused op reads them as for a text model.

What every forward of a batch of rows must pass (`image_forward_inputs`), so that the trainer's logprobs are the
sampler's:
- the processor's image tensors of those rows, concatenated in row order (`pixel_values`, `image_grid_thw`, ...),
  because the model scatters the image features into the placeholders in sequence order;
- the token-type ids (`mm_token_type_ids`: 1 at image placeholders, 2 at video ones; Gemma 3's `token_type_ids`),
  without which a Qwen-VL text model silently falls back to 1-D positions;
- for M-RoPE models (Qwen-VL), the 3-row positions of the model's own `get_rope_index` over the rows as padded.

Rows sampled from one prompt share its image tensors (the same objects), and `encode_once` runs the vision encoder
once per distinct row of a forward, the other rows' features copied from it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# Where the vision encoder sits in the multimodal body of each family (Qwen-VL: `visual`; Gemma 3, LLaVA: `vision_tower`)
VISION_TOWERS = ("visual", "vision_tower", "vision_model")
# The modules between the vision encoder and the language model in families that keep them outside the tower
PROJECTORS = ("multi_modal_projector",)


def config_of(model_or_config: Any) -> Any:
    """The config of a model, or the config itself."""
    return getattr(model_or_config, "config", model_or_config)


def is_vision_language(model_or_config: Any) -> bool:
    """Whether a model (or its config) is an image-text-to-text model: its config has a `vision_config`."""
    base = model_or_config
    while hasattr(base, "get_base_model"):
        base = base.get_base_model()
    return getattr(config_of(base), "vision_config", None) is not None


def model_class(config: Any):
    """The transformers auto class that builds the model of `config`: AutoModelForImageTextToText for a
    vision-language model, AutoModelForCausalLM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def vision_module_names(model: nn.Module) -> list[str]:
    """Qualified names (in `model.named_modules()`) of the vision tower and its projector, the part of a
    vision-language model that reads pixels; [] for a text model."""
    names = []
    for name, _ in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in VISION_TOWERS + PROJECTORS and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names if is_vision_language(model) else []


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """The vision tower (and projector) modules of `model` (`vision_module_names`)."""
    named = dict(model.named_modules())
    return [named[n] for n in vision_module_names(model)]


def placeholder_ids(config: Any) -> dict[int, int]:
    """{token id: token type} of the placeholders the processor expands: images 1, videos 2 (as transformers'
    `mm_token_type_ids`); Gemma 3's image token is `image_token_index`."""
    cfg = config_of(config)
    out = {}
    for name, kind in (("image_token_id", 1), ("image_token_index", 1), ("video_token_id", 2)):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            out.setdefault(value, kind)
    return out


def token_types(config: Any, input_ids: Tensor) -> Tensor:  # [B, L] -> [B, L] long
    """transformers' `mm_token_type_ids` of `input_ids`: 1 at image placeholders, 2 at video ones, 0 elsewhere
    (what the processor returns for the prompt, extended with zeros over a completion without placeholders)."""
    types = torch.zeros_like(input_ids, dtype=torch.long)
    for token, kind in placeholder_ids(config).items():
        types = types.masked_fill(input_ids == token, kind)
    return types


@dataclass
class ImageInputs:
    """The processor's image tensors of B rows: `rows[b]` maps each name (`pixel_values`, `image_grid_thw`, ...) to
    row b's tensor, its first dimension over that row's images (Qwen-VL: patches of all its images, and one grid per
    image); None for a row without images. Rows sampled from one prompt share its tensors (no copies)."""

    rows: list[dict[str, Tensor] | None]

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, index: Tensor | list[int]) -> ImageInputs:
        """The rows `index` (a [b] long tensor or list), in that order."""
        picked = index.tolist() if isinstance(index, Tensor) else list(index)
        return ImageInputs([self.rows[i] for i in picked])

    def repeat_interleave(self, n: int) -> ImageInputs:
        """Each row `n` times in a row (the G samples of a prompt), sharing its tensors."""
        return ImageInputs([r for r in self.rows for _ in range(n)])

    def to(self, device: torch.device | str) -> ImageInputs:
        """On `device`, each distinct tensor moved once (rows of one prompt keep sharing it)."""
        moved: dict[int, Tensor] = {}

        def move(t: Tensor) -> Tensor:
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
            return moved[id(t)]

        return ImageInputs([None if r is None else {k: move(v) for k, v in r.items()} for r in self.rows])

    @property
    def any(self) -> bool:
        return any(r for r in self.rows)

    def batched(self) -> dict[str, Tensor]:
        """The model's keyword tensors of all rows: each name's tensors concatenated in row order ({} without
        images)."""
        names: list[str] = []
        for r in self.rows:
            for k in r or {}:
                if k not in names:
                    names.append(k)
        return {k: torch.cat([r[k] for r in self.rows if r and k in r], 0) for k in names}


def concat_images(parts: list[dict[str, Tensor] | None]) -> dict[str, Tensor] | None:
    """One row's image tensors made of `parts` (the prompt's, then each observation's, in sequence order): each
    name's tensors concatenated along the first dimension, as the processor returns several images of one text;
    None where no part has images. A single part is returned as is (rows of one prompt keep sharing it)."""
    given = [p for p in parts if p]
    if len(given) <= 1:
        return given[0] if given else None
    names = list(dict.fromkeys(k for p in given for k in p))
    return {k: torch.cat([p[k] for p in given if k in p], 0) for k in names}


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def image_forward_inputs(body: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                         images: ImageInputs | None) -> dict[str, Tensor]:
    """The keyword arguments of a vision-language body's forward over `input_ids` [B, L] (rows as padded by
    `attention_mask`) beyond ids and mask: the rows' image tensors (`ImageInputs.batched`), the token types
    (`mm_token_type_ids`, or `token_type_ids` for Gemma 3) and, for an M-RoPE model (one with `get_rope_index`),
    `position_ids` [3, B, L] from the model's own `get_rope_index`. {} for a text model without images.

    Raises ValueError when a row's placeholder tokens do not match its images (count of rows, or no images given
    for rows that have placeholders), naming the row."""
    config = body.config
    if not is_vision_language(config):
        if images is not None and images.any:
            raise ValueError(f"rows carry images but the model ({type(body).__name__}) is a text model; load a "
                             "vision-language model (model.name_or_path) or drop the rows' images")
        return {}
    if images is not None and len(images) != input_ids.shape[0]:
        raise ValueError(f"images has {len(images)} rows but input_ids has {input_ids.shape[0]}")
    types = token_types(config, input_ids)
    if attention_mask is not None:
        types = types * attention_mask.long()
    has_placeholder = (types > 0).any(1)
    given = torch.tensor([bool(images is not None and images.rows[b]) for b in range(input_ids.shape[0])],
                         device=input_ids.device)
    bad = (has_placeholder != given).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        what = "image placeholder tokens but no images" if bool(has_placeholder[b]) else "images but no placeholders"
        raise ValueError(f"row {b} has {what}: pass the processor's image tensors of every row with its ids")
    out = images.batched() if images is not None else {}
    if _accepts(body.forward, "mm_token_type_ids"):
        out["mm_token_type_ids"] = types
    elif _accepts(body.forward, "token_type_ids"):
        out["token_type_ids"] = types
    rope_index = getattr(body, "get_rope_index", None)
    if rope_index is not None:
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        grids = {k: out[k] for k in ("image_grid_thw", "video_grid_thw") if k in out}
        positions, _ = rope_index(input_ids, mm_token_type_ids=types, attention_mask=mask, **grids)
        out["position_ids"] = positions
    return out


def packing_refusal(body: nn.Module) -> str | None:
    """Why the rows of a vision-language model whose multimodal body is `body` cannot be packed into one sequence
    (`train.packed`), or None where they can: a text model, or an M-RoPE model (one with `get_rope_index`), whose
    packed rows each carry their own positions. A model whose image tokens attend to each other both ways (Gemma 3's
    `token_type_ids`) needs a per-image bidirectional block the packed attention does not express."""
    if not is_vision_language(body) or hasattr(body, "get_rope_index"):
        return None
    return (f"{type(body).__name__}'s image tokens attend to each other both ways (token_type_ids), which the packed "
            "attention does not express; set train.packed=false")


def image_units(row: dict[str, Tensor]) -> int:
    """How many entries a row's images have along the first dimension of the encoder's per-image output: one per
    image (`image_grid_thw`'s rows, Qwen-VL) or one per `pixel_values` entry (Gemma 3: an image, or a crop)."""
    grid = row.get("image_grid_thw")
    return int(grid.shape[0]) if grid is not None else int(row["pixel_values"].shape[0])


def _expand_features(out: Any, index: Tensor) -> Any:
    """The encoder output `out` of the distinct rows' images, expanded to all rows: `index` [u] picks, for each
    image of each row in order, its image among the distinct ones. The per-image features (`pooler_output`: a
    tuple of [tokens_i, H] or an [images, tokens, H] tensor) and Qwen3-VL's deepstack features ([sum tokens_i, H]
    each) are expanded; the tower's own hidden states are dropped (the model's forward reads none of them)."""
    pooled = out.pooler_output
    picked = index.tolist()
    if isinstance(pooled, (tuple, list)):
        sizes = [p.shape[0] for p in pooled]
        out.pooler_output = tuple(pooled[i] for i in picked)
    else:
        sizes = None
        out.pooler_output = pooled.index_select(0, index.to(pooled.device))
    deep = getattr(out, "deepstack_features", None)
    if deep is not None:
        if sizes is None:
            raise NotImplementedError("deepstack features of an encoder without per-image outputs")
        out.deepstack_features = [torch.cat([f.split(sizes)[i] for i in picked]) for f in deep]
    for name in ("last_hidden_state", "hidden_states", "attentions"):
        if getattr(out, name, None) is not None:
            out[name] = None
    return out


@contextlib.contextmanager
def encode_once(body: nn.Module, images: ImageInputs | None, pixel_values: Tensor | None) -> Iterator[None]:
    """While open, a call of the vision-language body's image encoder (`body.get_image_features`) with
    `pixel_values` (the object `ImageInputs.batched()` made of `images`' rows, as the body's forward and
    `generate`'s prefill pass it on) encodes each distinct row of `images` once (rows sharing their tensors, the G
    samples of a prompt) and gives the other rows copies of its features: the same features, so the same forward,
    with the tower run on 1/G of the pixels. Other calls run the encoder as is. A no-op where no rows share."""
    rows = [r for r in images.rows if r] if images is not None else []
    distinct: dict[int, int] = {}
    for r in rows:
        distinct.setdefault(id(r), len(distinct))
    if pixel_values is None or len(distinct) == len(rows) or not hasattr(body, "get_image_features"):
        yield
        return
    unique_rows = list({id(r): r for r in rows}.values())
    starts, total = [], 0
    for r in unique_rows:
        starts.append(total)
        total += image_units(r)
    index = torch.tensor([starts[distinct[id(r)]] + k for r in rows for k in range(image_units(r))])
    unique = ImageInputs(unique_rows).batched()
    own = type(body).get_image_features.__get__(body)

    def shared(pixels: Tensor, *args: Any, **kwargs: Any) -> Any:  # args: Qwen2.5-VL passes its grid positionally
        with_grid = len(args) == 1 or "image_grid_thw" in kwargs
        if pixels is not pixel_values or len(args) > 1 or with_grid != ("image_grid_thw" in unique):
            return own(pixels, *args, **kwargs)
        if with_grid:
            kwargs["image_grid_thw"] = unique["image_grid_thw"]
        return _expand_features(own(unique["pixel_values"], **kwargs), index)

    body.get_image_features = shared
    try:
        yield
    finally:
        if body.__dict__.get("get_image_features") is shared:
            del body.get_image_features
