"""Tiny random vision-language model folders, built offline, one per family (`FAMILIES`):

- `qwen2_5_vl`: the repository's Qwen2.5 tokenizer (which has the vision special tokens `<|vision_start|>`,
  `<|image_pad|>`, ...), a Qwen2.5-VL processor of it with the PIL image backend and tiny image sizes (56x56 to
  112x112 pixels: 4 to 16 image tokens), the Qwen2-VL chat template (`fixtures/qwen2_vl_chat_template.jinja`, the
  template Qwen ships with its VL instruct models), and a model whose vision tower has one block of width 32.
- `qwen3_vl`: the same tokenizer and template, Qwen3-VL's processor (16-pixel patches: 64x64 to 128x128 pixels, 4
  to 16 image tokens), interleaved M-RoPE and one deepstack feature (the tower's block 0, added after decoder
  layer 0).
- `gemma3`: the same tokenizer with Gemma 3's three image tokens added (`<start_of_image>`, `<end_of_image>`,
  `<image_soft_token>`), Gemma 3's processor (56x56 pixels, 4 image tokens per image) and a Gemma-3-style chat
  template written here, a SigLIP tower of one block and a text model with a sliding-window and a full layer.

Weights are drawn with std 0.2 (not 0.02), so attention depends on positions and images enough that a wrong
position or a missing image shows above 1e-5."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3")
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112  # Qwen2.5-VL: 14-pixel patches merged 2x2
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 64 * 64, 128 * 128  # Qwen3-VL: 16-pixel patches merged 2x2
GEMMA_IMAGE, GEMMA_TOKENS = 56, 4  # Gemma 3: every image resized to 56x56, 16 patches pooled to 4 tokens
GEMMA_SPECIALS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}

# A Gemma-3-style chat template (Gemma's turn markers, `<start_of_image>` where an image block is); a system message
# opens the first user turn as in Gemma's own template
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = (message['content'] if message['content'] is string else message['content'][0]['text']) "
    "+ '\n\n' -%}"
    "{%- else -%}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{%- if loop.index0 <= 1 %}{{ ns.system }}{% endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}<start_of_image>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<end_of_turn>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)


def _qwen_text(vocab_size: int, layers: int, **rope) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, **rope})


def tiny_vlm_config(vocab_size: int, *, layers: int = 2, depth: int = 1, family: str = "qwen2_5_vl",
                    image_ids: dict[str, int] | None = None):
    """The config of a tiny `family` model: text hidden 64 (4 heads of 16; Qwen: M-RoPE sections 2/3/3), a vision
    tower of `depth` blocks of width 32 projected to 64. `image_ids` (Gemma 3): the ids of its three image tokens."""
    import transformers

    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    if family == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=_qwen_text(vocab_size, layers),
            vision_config=dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                               window_size=56, initializer_range=0.2),
            tie_word_embeddings=False, **ids)
    if family == "qwen3_vl":
        return transformers.Qwen3VLConfig(
            text_config=_qwen_text(vocab_size, layers, mrope_interleaved=True),
            vision_config=dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[0], initializer_range=0.2),
            tie_word_embeddings=False, **ids)
    if family == "gemma3":
        assert image_ids is not None, "Gemma 3 needs the ids of its image tokens"
        return transformers.Gemma3Config(
            text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                             sliding_window=8, layer_types=["sliding_attention", "full_attention"][:layers],
                             max_position_embeddings=1024, eos_token_id=151645, pad_token_id=151643, bos_token_id=None,
                             initializer_range=0.2),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=depth, num_attention_heads=2,
                               image_size=GEMMA_IMAGE, patch_size=14),
            mm_tokens_per_image=GEMMA_TOKENS, boi_token_index=image_ids["boi"], eoi_token_index=image_ids["eoi"],
            image_token_index=image_ids["image"], initializer_range=0.2)
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def tiny_processor(tokenizer_dir: Path, family: str = "qwen2_5_vl"):
    """The `family` processor of the tokenizer in `tokenizer_dir` (image-only: no torchvision needed)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from logitless.trainer.policy.vision import image_only

    if family == "gemma3":
        from transformers.models.gemma3 import Gemma3ImageProcessorPil

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens=GEMMA_SPECIALS)
        images = Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE})
        return transformers.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=GEMMA_TEMPLATE,
                                            image_seq_length=GEMMA_TOKENS)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    template = (FIXTURES / "qwen2_vl_chat_template.jinja").read_text()
    if family == "qwen3_vl":
        images = Qwen2VLImageProcessorPil(min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, patch_size=16,
                                          merge_size=2, temporal_patch_size=2)
        return image_only(transformers.Qwen3VLProcessor)(image_processor=images, tokenizer=tok,
                                                         chat_template=template)
    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    return image_only(transformers.Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tok, chat_template=template)


def build_tiny_vlm(tokenizer_dir: Path, dest: Path, *, seed: int = 0, layers: int = 2,
                   family: str = "qwen2_5_vl") -> Path:
    """A folder holding a random tiny `family` model (fp32) and its processor, as `model.name_or_path` reads it.
    Built once per process and arguments, then linked into `dest` (a run writes only to its own output folder)."""
    key = (str(tokenizer_dir), seed, layers, family)
    if key not in _BUILT:
        if not _BUILT:
            _BUILT["root"] = Path(tempfile.mkdtemp(prefix="tiny_vlms_"))
            atexit.register(shutil.rmtree, _BUILT["root"], ignore_errors=True)
        _BUILT[key] = _build_tiny_vlm(tokenizer_dir, _BUILT["root"] / str(len(_BUILT)), seed=seed, layers=layers,
                                      family=family)
    shutil.copytree(_BUILT[key], dest, copy_function=os.link, dirs_exist_ok=True)
    return dest


_BUILT: dict = {}  # build_tiny_vlm's: "root" -> the process's folder of them, (arguments) -> the built folder


def _build_tiny_vlm(tokenizer_dir: Path, dest: Path, *, seed: int, layers: int, family: str) -> Path:
    from transformers import AutoModelForImageTextToText

    processor = tiny_processor(tokenizer_dir, family)
    tok = processor.tokenizer
    image_ids = None
    if family == "gemma3":
        image_ids = {"boi": tok.boi_token_id, "eoi": tok.eoi_token_id, "image": tok.image_token_id}
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(len(tok), layers=layers, family=family,
                                                                    image_ids=image_ids))
    model.generation_config.eos_token_id = 151645
    model.generation_config.pad_token_id = 151643
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    processor.save_pretrained(str(dest))
    return dest


def favour_turn_ends(model, token: int, target: float = 0.5) -> None:
    """Point the lm_head row of `token` (<|im_end|>) of a Qwen-VL model (or its PEFT wrapper) along the mean final
    hidden state, scaled so that its mean probability over random contexts is about `target`: a random model then
    ends its turns within a few tokens and episodes have several turns."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    ids = torch.randint(0, 151_000, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = lm.model.language_model(input_ids=ids).last_hidden_state.reshape(-1, lm.config.text_config.hidden_size)
        u = h.mean(0) / h.mean(0).norm() ** 2
        others = lm.lm_head(h)
        others[:, token] = float("-inf")
        rest, along = torch.logsumexp(others, -1), h @ u
        scales = torch.linspace(0.5, 40.0, 80)
        mean_p = torch.stack([torch.sigmoid(s * along - rest).mean() for s in scales])
        lm.lm_head.weight[token] = scales[(mean_p - target).abs().argmin()] * u


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


class CounterScreen:
    """A screenshot-style environment (`agent.environment: vlm_fixtures:CounterScreen`): each step shows the counter
    (how many model turns so far) as red squares in a small image, beside a line of text; the episode ends after
    `turns` model turns, rewarded 1.0. reset() asks the first question in text."""

    def __init__(self, turns: int = 3, size: int = 56):
        self.turns, self.size, self.count = turns, size, 0

    def reset(self, row: dict) -> str | None:
        self.count = 0
        return "Count the squares on each screen."

    def step(self, text: str):
        self.count += 1
        if self.count >= self.turns:
            return None, 1.0, True
        screen = shape_image(self.count, size=self.size + 28 * (self.count % 2))  # screens of two sizes
        return [{"type": "text", "text": f"Screen {self.count}:"}, {"type": "image", "image": screen}], 0.0, False


def backward_through(model, b, weights=None):
    """completion_logprobs of rollout batch `b` through the vision-language `model`, back-propagated (times
    `weights` [B, T] if given); returns (the rotary positions its language model saw, its final hidden states with
    their gradient). The positions are [3, B, L] for M-RoPE, else [B, L]."""
    from logitless.models import completion_logprobs

    lm = model.get_base_model().model.language_model
    seen, hidden = [], []

    def keep(mod, args, out):
        out.retain_grad()
        hidden.append(out)

    hooks = [lm.rotary_emb.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())),
             lm.norm.register_forward_hook(keep)]
    with contextlib.ExitStack() as stack:
        for h in hooks:
            stack.callback(h.remove)
        model.zero_grad()
        logp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                      images=b.images)
        (logp if weights is None else logp * weights[:, : logp.shape[1]]).sum().backward()
    return seen[0], hidden[0]


def lora_vlm(tokenizer_dir, folder, family: str):
    """(LoRA model, tokenizer, processor) of a tiny `family` folder built in `folder`, fp32 on CPU, LoRA r 4 with
    its B matrices drawn (not zero), so the adapters change the logprobs."""
    from logitless.trainer.config.schema import ModelConfig
    from logitless.trainer.policy.modeling import load_model_and_tokenizer
    from logitless.trainer.policy.vision import load_processor

    path = build_tiny_vlm(tokenizer_dir, folder, family=family)
    cfg = ModelConfig(name_or_path=str(path), device="cpu", dtype="float32", lora=True, lora_r=4)
    model, tok, _ = load_model_and_tokenizer(cfg)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(n)))
    return model, tok, load_processor(cfg, tok)
