"""Prompt rows with images: a row's `images` field checked when the rows are read (before any model loads) and put
into its chat prompt as image content blocks, and the synthetic visual counting task (`count_shapes`)."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

from logitless.rollout.vision import load_image

URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://")


def image_ref(value: Any, where: str, base: Path | None = None) -> Any:
    """A row's image as the rollout opens it: a PIL image (given, or decoded from a `datasets` Image feature's
    {"bytes", "path"} dict) or the path of a readable local image file (relative paths against `base`, the data
    file's folder, when the file is there). Raises ValueError naming `where` (the row) for a URL (images are read
    offline), a missing file or one that is not an image."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature, undecoded
        if value.get("bytes"):
            try:
                return load_image(Image.open(io.BytesIO(value["bytes"])))
            except (OSError, ValueError) as e:
                raise ValueError(f"{where}: its image bytes are not an image ({e})") from None
        value = value.get("path")
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: an image must be a file path, a PIL image or a datasets Image, got "
                         f"{type(value).__name__} {value!r:.80}")
    if value.startswith(URL_SCHEMES):
        raise ValueError(f"{where}: image {value!r} is a URL; images are read offline: download it and give the "
                         "local file path")
    path = Path(value).expanduser()
    if not path.is_absolute() and base is not None and (base / path).is_file():
        path = base / path
    if not path.is_file():
        raise ValueError(f"{where}: image file {value!r} not found" + (f" (also looked in {base})" if base else ""))
    try:
        with Image.open(path) as img:
            img.verify()  # reads the file's structure without decoding the pixels
    except (OSError, ValueError, SyntaxError) as e:
        raise ValueError(f"{where}: image file {str(path)!r} cannot be read as an image ({e})") from None
    return str(path)


def with_images(prompt: Any, images: Any, where: str, base: Path | None = None) -> list[dict[str, Any]]:
    """Chat prompt `prompt` with the row's images (one value or a list) as image blocks at the start of its first
    user message (the processor's chat template renders each block as its placeholder), after `image_ref` checked
    each. A prompt given as raw text is refused: the chat template places the images."""
    refs = [image_ref(v, f"{where} image {k}", base) for k, v in enumerate(images if isinstance(images, list)
                                                                          else [images])]
    if not isinstance(prompt, list):
        raise ValueError(f"{where}: a row with images needs a chat prompt (the chat template places the images); "
                         "set chat: true in data.options")
    messages = [dict(m) for m in prompt]
    user = next((m for m in messages if m.get("role") == "user"), None)
    if user is None:
        raise ValueError(f"{where}: a row with images needs a user message to hold them")
    content = user["content"]
    blocks = content if isinstance(content, list) else [{"type": "text", "text": str(content)}]
    user["content"] = [{"type": "image", "image": r} for r in refs] + blocks
    return messages


def prompt_text(prompt: Any) -> str:
    """Display text of a prompt: the last message's text (its text blocks joined, one `<image>` per image)."""
    if isinstance(prompt, str):
        return prompt
    content = prompt[-1]["content"]
    if isinstance(content, list):
        return "".join("<image>" if b.get("type") == "image" else str(b.get("text", "")) for b in content)
    return str(content)


# ----------------------------------------------------------------------------------------------------------
# Synthetic visual task: count the red shapes

COUNT_SYSTEM = "You are a careful visual assistant."
COUNT_QUESTION = "How many red shapes are in the image? Answer with the number only."
COLORS = {"red": (220, 30, 30), "blue": (40, 70, 220), "green": (30, 160, 60), "yellow": (230, 200, 20)}


def shapes_image(rng: random.Random, n_red: int, n_other: int, size: int) -> Any:
    """A `size` x `size` white RGB image with `n_red` red and `n_other` shapes of other colours (squares, circles,
    triangles), each in its own cell of a 4 x 4 grid so none overlap."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    cell = size / 4
    cells = rng.sample(range(16), n_red + n_other)
    others = [c for c in COLORS if c != "red"]
    for k, c in enumerate(cells):
        color = COLORS["red"] if k < n_red else COLORS[rng.choice(others)]
        x0, y0 = (c % 4) * cell, (c // 4) * cell
        pad = max(1.0, cell * rng.uniform(0.1, 0.25))
        box = [x0 + pad, y0 + pad, x0 + cell - pad, y0 + cell - pad]
        kind = rng.choice(("square", "circle", "triangle"))
        if kind == "square":
            draw.rectangle(box, fill=color)
        elif kind == "circle":
            draw.ellipse(box, fill=color)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], fill=color)
    return img


def count_shapes_rows(split: str, n: int, seed: int, size: int, max_count: int, max_other: int,
                      question: str) -> list[tuple[Any, str, dict[str, Any]]]:
    """(image, question, fields) of `n` counting problems: the answer is the number of red shapes (0..max_count)
    among up to `max_other` shapes of other colours. Drawn by `random.Random` of (split, seed), so the splits
    differ and a split is the same every time."""
    if split not in ("train", "test"):
        raise ValueError(f"count_shapes split must be 'train' or 'test', got {split!r}")
    if not (isinstance(n, int) and n > 0):
        raise ValueError(f"count_shapes n must be a positive int, got {n!r}")
    if not (1 <= max_count and max_count + max_other <= 16 and max_other >= 0):
        raise ValueError(f"count_shapes needs 1 <= max_count and max_count + max_other <= 16 (a 4 x 4 grid), got "
                         f"max_count={max_count!r} max_other={max_other!r}")
    if not (isinstance(size, int) and size >= 28):
        raise ValueError(f"count_shapes size must be an int >= 28 pixels, got {size!r}")
    rng = random.Random(f"count_shapes:{split}:{seed}")
    out = []
    for _ in range(n):
        n_red, n_other = rng.randint(0, max_count), rng.randint(0, max_other)
        out.append((shapes_image(rng, n_red, n_other, size), question,
                    {"answer": str(n_red), "num_shapes": n_red + n_other}))
    return out
