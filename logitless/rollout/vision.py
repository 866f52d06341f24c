"""Prompts with images: where a chat prompt's images are, how one is opened, and a prompt's token ids and image
tensors through a vision-language model's processor (the one source of both, for the sampler and the trainer)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from logitless.models.lm_head import UnsupportedModelError
from logitless.models.vision import is_vision_language, placeholder_ids

# The processor outputs that are per-position text (rebuilt for prompt + completion), not per-image tensors
TEXT_OUTPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def is_processor(obj: Any) -> bool:
    """Whether `obj` is a multimodal processor (an image processor beside a tokenizer), not a tokenizer."""
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")


def text_tokenizer(obj: Any) -> Any:
    """The tokenizer of a processor, or `obj` itself."""
    return obj.tokenizer if is_processor(obj) else obj


def has_blocks(prompt: Any) -> bool:
    """Whether `prompt` is chat messages with content blocks (a list of {"type": ...} dicts) in some message."""
    return isinstance(prompt, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                            for m in prompt)


def prompt_images(prompt: Any) -> list[Any]:
    """The images of a chat prompt in the order they appear: each content block {"type": "image", "image": ref}
    gives its ref (a PIL image or a local file path); [] for text."""
    out = []
    if isinstance(prompt, list):
        for m in prompt:
            content = m.get("content") if isinstance(m, dict) else None
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict) and block.get("type") == "image":
                    out.append(block.get("image", block.get("path")))
    return out


def load_image(ref: Any) -> Any:
    """`ref` (a PIL image or a local file path) as an RGB PIL image, read fully; OSError/ValueError where the file
    is missing or is not an image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref if ref.mode == "RGB" else ref.convert("RGB")
    if not isinstance(ref, str):
        raise ValueError(f"an image must be a PIL image or a file path, got {type(ref).__name__}")
    with Image.open(ref) as img:
        img.load()
        return img.convert("RGB")


def encode_with_images(processor: Any, prompt: list, chat_template_kwargs: dict[str, Any] | None
                       ) -> tuple[list[int], dict[str, torch.Tensor] | None]:
    """(token ids, image tensors or None) of a chat prompt: rendered by the processor's chat template (one
    placeholder per image), then the processor expands each placeholder to its image's tokens and computes the
    pixel tensors (`pixel_values`, `image_grid_thw`, ...)."""
    text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))
    return encode_text_with_images(processor, text, prompt_images(prompt))


def image_marker(processor: Any) -> str:
    """The text a chat template writes for one image, which the processor expands (Gemma 3: `<start_of_image>`,
    Qwen-VL: `<|image_pad|>`)."""
    return getattr(processor, "boi_token", None) or processor.image_token


def encode_text_with_images(processor: Any, text: str, refs: list[Any], add_special_tokens: bool = True
                            ) -> tuple[list[int], dict[str, torch.Tensor] | None]:
    """(token ids, image tensors or None) of rendered chat text holding one image marker per image of `refs` (PIL
    images or file paths, in order): the processor expands each marker to its image's tokens and computes the pixel
    tensors. ValueError where the text holds another number of markers than there are images."""
    images = [load_image(ref) for ref in refs]
    marker = image_marker(processor)
    if text.count(marker) != len(images):
        raise ValueError(f"the chat template wrote {text.count(marker)} image markers ({marker}) for {len(images)} "
                         "images: use a chat template that renders image content blocks (the model's own)")
    kwargs = {} if add_special_tokens else {"add_special_tokens": False}
    out = processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
    tensors = {k: v for k, v in out.items() if k not in TEXT_OUTPUTS and isinstance(v, torch.Tensor)}
    return out["input_ids"][0].tolist(), (tensors if images else None)


class BanPlaceholders(LogitsProcessor):
    """Sampling never draws a vision-language model's image/video placeholder tokens: a completion holding one would
    need an image the trainer's forward does not have. Runs after the logprob recorder, like the other filters
    (the recorded logprobs are of the raw distribution; `types.py`)."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.token_ids] = float("-inf")
        return scores


def placeholder_tokens(model: Any) -> list[int]:
    """The placeholder token ids of a vision-language model inside its vocabulary ([] for a text model)."""
    if not is_vision_language(model):
        return []
    vocab = model.get_output_embeddings().weight.shape[0]
    return [t for t in placeholder_ids(model.config) if 0 <= t < vocab]


def refuse_vision(model: Any, backend: str) -> None:
    """Refuse a vision-language model on a backend without image inputs."""
    if is_vision_language(model):
        raise UnsupportedModelError(
            f"rollout.backend={backend} cannot decode a vision-language model ({type(model).__name__}) yet: its decode "
            "loop has no image inputs or M-RoPE positions. Set rollout.backend=hf or static")
