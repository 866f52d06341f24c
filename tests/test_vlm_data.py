"""Prompt rows with images: JSONL rows with image paths (relative to the file), a datasets Image feature, several
images a row; URLs, missing and corrupt files refused naming the row; the synthetic count_shapes task."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from logitless.data import load_jsonl_prompts, load_task, records_to_rows
from logitless.rollout.vision import load_image, prompt_images
from vlm_fixtures import shape_image


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_rows_with_image_paths(tmp_path):
    shape_image(2).save(tmp_path / "a.png")
    shape_image(1, 1).save(tmp_path / "b.png")
    rows = load_jsonl_prompts(write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "Count the red shapes.", "answer": "2", "images": ["a.png"]},
        {"prompt": "Which has more?", "answer": "1", "images": ["a.png", str(tmp_path / "b.png")]},
        {"prompt": "No image.", "answer": "0"},
    ]), system_prompt="Be brief.")
    assert [len(prompt_images(r.prompt)) for r in rows] == [1, 2, 0]
    user = rows[1].prompt[1]
    assert user["role"] == "user" and [b["type"] for b in user["content"]] == ["image", "image", "text"]
    assert user["content"][0]["image"] == str(tmp_path / "a.png")  # relative to the file's folder
    assert user["content"][2]["text"] == "Which has more?"
    assert load_image(user["content"][0]["image"]).size == (56, 56)
    assert rows[0].fields["answer"] == "2"


def test_a_datasets_image_feature_and_pil_images():
    buf = io.BytesIO()
    shape_image(3).save(buf, format="PNG")
    rows = records_to_rows([{"prompt": "Count.", "images": {"bytes": buf.getvalue(), "path": None}},
                            {"prompt": "Count.", "images": [shape_image(1)]}])
    for r in rows:
        (img,) = prompt_images(r.prompt)
        assert isinstance(img, Image.Image) and img.size == (56, 56)


@pytest.mark.parametrize("value, message", [
    ("https://example.com/cat.png", "row 1 image 0: image .* is a URL"),
    ("missing.png", "row 1 image 0: image file 'missing.png' not found"),
    ("corrupt.png", "row 1 image 0: image file .*corrupt.png' cannot be read as an image"),
])
def test_bad_images_are_refused_naming_the_row(tmp_path, value, message):
    shape_image(1).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "images": ["ok.png"]}, {"prompt": "b", "images": [value]}])
    with pytest.raises(ValueError, match=message):
        load_jsonl_prompts(path)


def test_rows_with_images_need_chat_prompts(tmp_path):
    with pytest.raises(ValueError, match="needs a chat prompt"):
        records_to_rows([{"prompt": "a", "images": [shape_image(1)]}], chat=False)


def test_count_shapes_task_counts_the_red_shapes():
    rows = load_task("count_shapes", "train", n=40, size=56, max_count=4, max_other=3)
    again = load_task("count_shapes", "train", n=40, size=56, max_count=4, max_other=3)
    test = load_task("count_shapes", "test", n=40, size=56, max_count=4, max_other=3)
    assert len(rows) == 40 and {r.fields["answer"] for r in rows} <= {"0", "1", "2", "3", "4"}
    assert len({r.fields["answer"] for r in rows}) > 2
    for r in rows:
        (img,) = prompt_images(r.prompt)
        assert img.size == (56, 56)
        pixels = img.getdata()
        red = sum(1 for p in pixels if p == (220, 30, 30))
        assert (red > 0) == (r.fields["answer"] != "0")  # the image holds red shapes exactly when the answer says so
    same = [a.prompt[-1]["content"][0]["image"].tobytes() == b.prompt[-1]["content"][0]["image"].tobytes()
            for a, b in zip(rows, again)]
    assert all(same)  # a split is the same every time
    assert [r.fields["answer"] for r in rows] != [r.fields["answer"] for r in test]
    with pytest.raises(ValueError, match="max_count"):
        load_task("count_shapes", "train", n=2, max_count=10, max_other=10)
