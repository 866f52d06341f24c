"""Fast CPU checks of what the family matrix (test_rollout_families.py) does not reach: `layer_types` of a config
without that field, the layouts `check_layout` refuses besides linear attention (encoder-decoders, models with
their own cache class) and its exact message, `gqa_decode_attention` called on its own (position bias, dropout,
prefill scaling, value heads narrower than key heads) and `RolloutBatch.to`."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from logitless.models import UnsupportedModelError
from logitless.rollout.attention import gqa_decode_attention
from logitless.rollout.layouts import CHUNKED, FULL, SLIDING, check_layout, layer_types
from logitless.rollout.types import RolloutBatch, RolloutTiming

SUPPORTED = (FULL, SLIDING)  # the static backend's layouts


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(num_hidden_layers=3), [FULL] * 3),
        (dict(num_hidden_layers=3, sliding_window=None, attention_chunk_size=None), [FULL] * 3),
        (dict(num_hidden_layers=3, sliding_window=4), [SLIDING] * 3),
        (dict(num_hidden_layers=3, attention_chunk_size=4), [CHUNKED] * 3),
        (dict(), []),  # no num_hidden_layers either
        (dict(num_hidden_layers=2, sliding_window=4, layer_types=[FULL, SLIDING]), [FULL, SLIDING]),
    ],
)
def test_layer_types_inferred_when_the_config_has_no_layer_types(fields, expected):
    assert layer_types(PretrainedConfig(**fields)) == expected


def on_meta(model_cls, cfg):
    with torch.device("meta"):  # shapes only: check_layout reads the config and the model class
        return model_cls(cfg)


def refusal(backend: str, model_type: str, why: str) -> str:
    return (f"^rollout\\.backend={backend} cannot sample model_type '{model_type}' exactly: {why}\\. Use "
            r"rollout\.backend=hf \(transformers generate\), which runs every attention layout$")


def test_encoder_decoder_refused():
    bart = on_meta(tf.BartForConditionalGeneration, tf.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16))
    with pytest.raises(UnsupportedModelError, match=refusal("static", "bart", "it is an encoder-decoder model")):
        check_layout(bart, "static", SUPPORTED)


def test_own_cache_class_refused():
    """transformers' generate gives RWKV its own state instead of a DynamicCache: nothing for our caches to copy."""
    rwkv = on_meta(tf.RwkvForCausalLM, tf.RwkvConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                      attention_hidden_size=16, intermediate_size=32))
    why = "it keeps its own cache class instead of transformers' DynamicCache"
    with pytest.raises(UnsupportedModelError, match=refusal("continuous", "rwkv", why)):
        check_layout(rwkv, "continuous", SUPPORTED)


def test_decoder_accepted_with_its_layer_types():
    cfg = tf.MistralConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    mistral = on_meta(tf.MistralForCausalLM, cfg)
    assert check_layout(mistral, "static", SUPPORTED) == [SLIDING, SLIDING]
    # a model class without generate (no _supports_default_dynamic_cache) is read the same way
    assert check_layout(mistral.model, "static", SUPPORTED) == [SLIDING, SLIDING]


class Untyped:
    """A model whose config names no model_type (PretrainedConfig's is ""): the error names its class instead."""

    config = PretrainedConfig(num_hidden_layers=2, attention_chunk_size=4)


def test_refusal_names_the_model_class_without_a_model_type():
    why = (r"its layer_types include \['chunked_attention'\]; "
           r"this backend supports \['full_attention', 'sliding_attention'\]")
    with pytest.raises(UnsupportedModelError, match=refusal("static", "Untyped", why)):
        check_layout(Untyped(), "static", SUPPORTED)


class Attn(torch.nn.Module):
    """What transformers' sdpa attention reads from an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def qkv(q: int = 1, H: int = 4, kv: int = 2, d: int = 8, dv: int = 8, L: int = 7, B: int = 2):
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(B, H, q, d, generator=g), torch.randn(B, kv, L, d, generator=g)
    value = torch.randn(B, kv, L, dv, generator=g)
    mask = torch.ones(B, 1, q, L, dtype=torch.bool).tril(L - q)  # causal over the last q positions
    mask[0, ..., :2] = False  # row 0 left-padded by 2
    return Attn(H // kv), query, key, value, mask


def test_grouped_decode_equals_sdpa():
    module, *t = qkv()
    out, _ = gqa_decode_attention(module, *t, scaling=0.3)
    torch.testing.assert_close(out, sdpa_attention_forward(module, *t, scaling=0.3)[0], atol=1e-6, rtol=0)


def test_position_bias_goes_through_sdpa():
    module, *t = qkv()
    bias = torch.randn(2, 4, 1, 7, generator=torch.Generator().manual_seed(1))
    out, _ = gqa_decode_attention(module, *t, position_bias=bias)
    ref = sdpa_attention_forward(module, *t, position_bias=bias)[0]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert (ref - sdpa_attention_forward(module, *t)[0]).abs().max() > 1e-2  # the bias matters here


def test_dropout_goes_through_sdpa():
    module, *t = qkv()
    torch.manual_seed(3)
    out, _ = gqa_decode_attention(module, *t, dropout=0.5)
    torch.manual_seed(3)
    ref = sdpa_attention_forward(module, *t, dropout=0.5)[0]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert (ref - sdpa_attention_forward(module, *t)[0]).abs().max() > 1e-2  # dropout changed the output


def test_prefill_keeps_the_model_scaling():
    module, *t = qkv(q=3)
    out, _ = gqa_decode_attention(module, *t, scaling=0.3)
    ref = sdpa_attention_forward(module, *t, scaling=0.3)[0]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    assert (ref - sdpa_attention_forward(module, *t)[0]).abs().max() > 1e-2  # not sdpa's default 1/sqrt(d)


def test_value_heads_narrower_than_key_heads():
    module, *t = qkv(dv=4)
    out, _ = gqa_decode_attention(module, *t)
    assert out.shape == (2, 1, 4, 4)
    torch.testing.assert_close(out, sdpa_attention_forward(module, *t)[0], atol=1e-6, rtol=0)


def test_rollout_batch_to_moves_the_tensors_only():
    b = RolloutBatch(
        prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.long),
        completion_ids=torch.ones(2, 4, dtype=torch.long), completion_mask=torch.ones(2, 4, dtype=torch.long),
        sampler_logp=torch.zeros(2, 4), finished=torch.ones(2, dtype=torch.bool),
        truncated=torch.zeros(2, dtype=torch.bool), prompt_index=torch.zeros(2, dtype=torch.long),
        completions=["a", "b"], timing=RolloutTiming(seconds=1.0, num_tokens=8, tokens_per_s=8.0),
    )
    m = b.to("meta")
    for name, v in b.__dict__.items():
        if isinstance(v, torch.Tensor):
            moved = getattr(m, name)
            assert moved.device.type == "meta" and moved.shape == v.shape and moved.dtype == v.dtype, name
            assert v.device.type == "cpu", name  # the original batch stays where it was
        else:
            assert getattr(m, name) is v, name
