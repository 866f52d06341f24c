"""A tiny random Qwen2.5-VL model folder, built offline: the repository's Qwen2.5 tokenizer (which has the vision
special tokens `<|vision_start|>`, `<|image_pad|>`, ...), a Qwen2.5-VL processor of it with the PIL image backend
and tiny image sizes (56x56 to 112x112 pixels: 4 to 16 image tokens), the Qwen2-VL chat template
(`fixtures/qwen2_vl_chat_template.jinja`, the template Qwen ships with its VL instruct models), and a model whose
vision tower has one block of width 32."""

from __future__ import annotations

from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def tiny_vlm_config(vocab_size: int, *, layers: int = 2, depth: int = 1):
    """A Qwen2.5-VL config: text hidden 64 (4 heads of 16, M-RoPE sections 2/3/3), vision tower `depth` blocks of
    width 32, patch 14, spatial merge 2, its output projected to 64. Weights drawn with std 0.2 (not 0.02), so
    attention depends on positions and images enough that a wrong position or a missing image shows above 1e-5."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643, initializer_range=0.2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                           window_size=56, initializer_range=0.2),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=False,
    )


def tiny_processor(tokenizer_dir: Path):
    """The Qwen2.5-VL processor of the tokenizer in `tokenizer_dir` (image-only: no torchvision needed)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from logitless.trainer.policy.vision import image_only

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    template = (FIXTURES / "qwen2_vl_chat_template.jinja").read_text()
    return image_only(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tok, chat_template=template)


def build_tiny_vlm(tokenizer_dir: Path, dest: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """A folder holding a random tiny Qwen2.5-VL (fp32) and its processor, as `model.name_or_path` reads it."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = tiny_processor(tokenizer_dir)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(len(processor.tokenizer), layers=layers))
    model.generation_config.eos_token_id = 151645
    model.generation_config.pad_token_id = 151643
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    processor.save_pretrained(str(dest))
    return dest


def shape_image(n_red: int, n_blue: int = 0, size: int = 56):
    """A white `size`x`size` RGB image with `n_red` red and `n_blue` blue squares in a fixed layout."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    cell = size // 4
    for i, color in enumerate(["red"] * n_red + ["blue"] * n_blue):
        x, y = (i % 4) * cell, (i // 4) * cell
        draw.rectangle([x + 2, y + 2, x + cell - 3, y + cell - 3], fill=color)
    return img
