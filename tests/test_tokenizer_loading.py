"""A run reads its tokenizer once per process and source (`load_tokenizer`): each call gets its own copy, a folder
whose files changed is read again; a vision-language model's processor takes the run's tokenizer instead of
reading the folder's again (`load_processor`)."""

from __future__ import annotations

import shutil

import pytest

from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy import sources
from logitless.trainer.policy.sources import load_tokenizer


def count_reads(monkeypatch) -> list[str]:
    """The sources AutoTokenizer.from_pretrained reads from here on."""
    from transformers import AutoTokenizer

    reads, real = [], AutoTokenizer.from_pretrained.__func__

    def counted(cls, source, *args, **kwargs):
        reads.append(str(source))
        return real(cls, source, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    return reads


def test_a_folder_is_read_once_and_each_call_gets_its_own_copy(tmp_path, gpt2_tokenizer_dir, monkeypatch):
    folder = shutil.copytree(gpt2_tokenizer_dir, tmp_path / "tok")
    monkeypatch.setattr(sources, "_TOKENIZERS", {})
    reads = count_reads(monkeypatch)
    cfg = ModelConfig(name_or_path=str(folder))
    a = load_tokenizer(cfg)
    a.pad_token = a.eos_token
    a.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    b = load_tokenizer(cfg)
    assert reads == [str(folder)]
    assert b is not a and b.pad_token is None and len(b) == len(a) - 1 and b.padding_side == "left"
    assert b("x <tool>")["input_ids"] != a("x <tool>")["input_ids"]  # the first caller's edit stayed its own


def test_a_folder_whose_files_changed_is_read_again(tmp_path, gpt2_tokenizer_dir, monkeypatch):
    folder = shutil.copytree(gpt2_tokenizer_dir, tmp_path / "tok")
    monkeypatch.setattr(sources, "_TOKENIZERS", {})
    reads = count_reads(monkeypatch)
    cfg = ModelConfig(name_or_path=str(folder))
    assert not getattr(load_tokenizer(cfg), "chat_template", None)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_tokenizer(cfg).chat_template.startswith("{% for m in messages")
    assert reads == [str(folder)] * 2


@pytest.mark.parametrize("family", ["qwen2_5_vl"])  # (the same code for every family)
def test_the_processor_takes_the_runs_tokenizer_without_reading_it_again(tmp_path, qwen_tokenizer_dir, family,
                                                                         monkeypatch):
    """The processor loaded with the run's tokenizer holds that very object and renders an image prompt as the
    processor transformers loads by itself does (same ids, same pixel values)."""
    import importlib.util

    import torch

    from logitless.trainer.policy.vision import image_only, load_processor, processor_class
    from vlm_fixtures import shape_image, tiny_processor, tiny_vlm_config

    own = tiny_processor(qwen_tokenizer_dir, family)  # the folder: the processor's files and the model's config
    own.save_pretrained(str(tmp_path))
    tok = own.tokenizer
    ids = {"boi": tok.boi_token_id, "eoi": tok.eoi_token_id, "image": tok.image_token_id} if family == "gemma3" else None
    tiny_vlm_config(len(tok), family=family, image_ids=ids).save_pretrained(str(tmp_path))
    cfg = ModelConfig(name_or_path=str(tmp_path))
    tok = load_tokenizer(cfg)
    reads = count_reads(monkeypatch)
    processor = load_processor(cfg, tok)
    assert reads == [] and processor.tokenizer is tok
    monkeypatch.undo()
    cls = processor_class(tiny_vlm_config(len(tok), family=family, image_ids=ids))
    if importlib.util.find_spec("torchvision") is None and "video_processor" in cls.__init__.__code__.co_varnames:
        cls = image_only(cls)
    reference = cls.from_pretrained(str(tmp_path))  # transformers reading every part itself
    reference.tokenizer.padding_side = "left"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ours, theirs = (p(text=[text], images=[shape_image(2)], return_tensors="pt") for p in (processor, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
