"""`SamplingOptions.eos_token_ids` and `max_prompt_length` refused by their text and accepted at their edges, and
`layouts.text_config` of a multimodal config (the text settings sit in a sub-config). Cases that mutation
testing (docs/testing.md) showed the engine tests leave open."""

from __future__ import annotations

import types

import pytest
import transformers as tf

from logitless.rollout import SamplingOptions
from logitless.rollout.layouts import text_config
from tests.test_rollout_families import make_model


@pytest.mark.parametrize("field, value, fix", [
    ("eos_token_ids", [-1], "pass a list of non-negative token ids, or None for the model's"),
    ("eos_token_ids", [True], "pass a list of non-negative token ids, or None for the model's"),
    ("eos_token_ids", [2.0], "pass a list of non-negative token ids, or None for the model's"),
    ("eos_token_ids", 3, "pass a list of non-negative token ids, or None for the model's"),
    ("max_prompt_length", 0, "use a positive int or None"),
    ("max_prompt_length", 4.0, "use a positive int or None"),
])
def test_bad_ids_and_prompt_lengths_are_refused_by_their_text(field, value, fix):
    with pytest.raises(ValueError) as info:
        SamplingOptions(**{field: value}).validate()
    assert str(info.value) == f"SamplingOptions.{field}={value!r} is invalid: {fix}"


@pytest.mark.parametrize("field, value", [
    ("eos_token_ids", [0]), ("eos_token_ids", [0, 7]), ("eos_token_ids", []), ("eos_token_ids", None),
    ("max_prompt_length", 1), ("max_prompt_length", 5), ("max_prompt_length", None),
])
def test_ids_and_prompt_lengths_accepted_at_their_edges(field, value):
    SamplingOptions(**{field: value}).validate()


def test_text_config_of_a_multimodal_config_is_its_text_sub_config():
    cfg = tf.Gemma3Config(text_config={"max_position_embeddings": 77})
    text = text_config(types.SimpleNamespace(config=cfg))
    assert isinstance(text, tf.Gemma3TextConfig) and text.max_position_embeddings == 77
    model = make_model("llama")
    assert text_config(model) is model.config
