"""Every rollout backend samples from the distribution the trainer computes, on every attention layout of the
model families we name (full, sliding window, alternating sliding/full, chunked), with prompts + completions
longer than the window so the window really changes the logits; layouts a backend cannot decode exactly are
refused with an error naming the `hf` backend."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers as tf

from logitless.models import UnsupportedModelError, completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout.types import RolloutBatch
from tests.test_rollout import dense_logprobs  # log_softmax of one padded full forward, fp64

WINDOW = 6  # sliding window / attention chunk of the windowed families: prompts are 7-19 tokens, completions 10
TEMPERATURE = 0.8
PROMPTS = ["The quick brown fox", "Hi there, how are you?", "2+2 is"]


def byte_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A 258-token byte-level tokenizer (one token per byte, plus pad and EOS): any text, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<pad>": len(vocab), "<eos>": len(vocab) + 1}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


TOK = byte_tokenizer()
COMMON = dict(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
              pad_token_id=TOK.pad_token_id, bos_token_id=None, eos_token_id=TOK.eos_token_id)
ALTERNATING = ["sliding_attention", "full_attention"]
# name: (config factory, config field holding the window, or None for full attention only)
FAMILIES = {
    "llama": (lambda: tf.LlamaConfig(**COMMON), None),
    "qwen2": (lambda: tf.Qwen2Config(**COMMON), None),
    # layers >= max_window_layers slide: layer 0 full, layer 1 sliding
    "qwen2_sliding": (lambda: tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1), "sliding_window"),
    "qwen3": (lambda: tf.Qwen3Config(**COMMON, head_dim=8), None),
    "mistral": (lambda: tf.MistralConfig(**COMMON, sliding_window=None), None),
    "mistral_window": (lambda: tf.MistralConfig(**COMMON, sliding_window=WINDOW), "sliding_window"),
    "gemma": (lambda: tf.GemmaConfig(**COMMON, head_dim=8), None),
    "gemma2": (lambda: tf.Gemma2Config(**COMMON, head_dim=8, sliding_window=WINDOW, final_logit_softcapping=None,
                                       layer_types=ALTERNATING), "sliding_window"),
    "gemma3_text": (lambda: tf.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=WINDOW,
                                                layer_types=ALTERNATING), "sliding_window"),
    "cohere2": (lambda: tf.Cohere2Config(**COMMON, sliding_window=WINDOW, layer_types=ALTERNATING),
                "sliding_window"),
    # alternating sliding/full with attention sinks, mixture of experts
    "gpt_oss": (lambda: tf.GptOssConfig(**COMMON, head_dim=8, sliding_window=WINDOW, num_local_experts=2,
                                        num_experts_per_tok=1, layer_types=ALTERNATING), "sliding_window"),
    "phi3": (lambda: tf.Phi3Config(**COMMON), None),
    "phi3_window": (lambda: tf.Phi3Config(**COMMON, sliding_window=WINDOW), "sliding_window"),
    "olmo2": (lambda: tf.Olmo2Config(**COMMON), None),
    "granite": (lambda: tf.GraniteConfig(**COMMON, logits_scaling=2.0), None),
    "phi": (lambda: tf.PhiConfig(**COMMON), None),
    # chunked attention (layer 0) and full attention without RoPE (layer 1)
    "llama4_chunked": (lambda: tf.Llama4TextConfig(**COMMON, intermediate_size_mlp=64, head_dim=8,
                                                   attention_chunk_size=WINDOW, num_local_experts=2,
                                                   interleave_moe_layer_step=2, no_rope_layers=[1, 0]),
                       "attention_chunk_size"),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=len(TOK), n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                   initializer_range=0.2, bos_token_id=None, eos_token_id=TOK.eos_token_id), None),
}
BACKENDS = ("hf", "static", "continuous")
# cells a backend refuses (transformers' paged cache has no chunked-attention layers)
REFUSED = {("llama4_chunked", "continuous")}


def make_model(family: str, attn: str = "eager", window: bool = True) -> torch.nn.Module:
    make_cfg, field = FAMILIES[family]
    cfg = make_cfg()
    if not window:
        setattr(cfg, field, 10_000)  # wider than any sequence here: the same model without its window
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def models():
    """Models built once per module. Everything alive is then frozen out of the garbage collector's reach: each
    generate call runs gc.collect up to 3 times (ours and transformers'), which otherwise walks the whole heap
    of the test process (1.2 s of a 1.35 s continuous-batching call measured here)."""
    cache: dict = {}

    def get(family: str, attn: str = "eager") -> torch.nn.Module:
        if (family, attn) not in cache:
            cache[family, attn] = make_model(family, attn)
            gc.freeze()
        return cache[family, attn]

    yield get
    gc.unfreeze()


def make_eng(backend: str, model):
    kw = {}
    if backend == "static":
        kw = dict(check_every=4)
    elif backend == "continuous":
        kw = dict(num_blocks=32, block_size=16, max_batch_tokens=64, use_cuda_graph=False, use_async_batching=False)
    return make_engine(backend, model, TOK, **kw)


def row_forward_logprobs(model, b: RolloutBatch, temperature: float) -> torch.Tensor:  # [B, T] fp64
    """The same from one unpadded forward per row: the model's distribution free of any batching."""
    out = torch.zeros(b.completion_ids.shape, dtype=torch.float64)
    for r in range(b.completion_ids.shape[0]):
        p = b.prompt_ids[r][b.prompt_mask[r].bool()]
        c = b.completion_ids[r][b.completion_mask[r].bool()]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([p, c])[None]).logits[0].double()
        lp = torch.log_softmax(logits[len(p) - 1 : len(p) + len(c) - 1] / temperature, -1)
        out[r, : len(c)] = lp.gather(-1, c[:, None])[:, 0]
    return out


def sample(backend: str, model, seed: int = 5) -> RolloutBatch:
    opts = SamplingOptions(num_generations=2, temperature=TEMPERATURE, max_new_tokens=10, seed=seed, ignore_eos=True)
    return make_eng(backend, model).generate(PROMPTS, opts)


def windowed(family: str) -> bool:
    return FAMILIES[family][1] is not None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampler_logprobs_equal_completion_logprobs(family, backend, models, one_thread):
    model = models(family)
    if (family, backend) in REFUSED:
        with pytest.raises(UnsupportedModelError, match=rf"backend={backend} .*'{model.config.model_type}'.*backend=hf"):
            make_eng(backend, model)
        return
    a = sample(backend, model)
    b = sample(backend, model)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert (a.completion_mask.sum(1) == 10).all()
    lengths = a.prompt_mask.sum(1) + a.completion_mask.sum(1)
    assert int(lengths.min()) > 2 * WINDOW  # the window bites in every row
    with torch.no_grad():
        lp, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
                                    temperature=TEMPERATURE)
    torch.testing.assert_close(a.sampler_logp, lp.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_completion_logprobs_equal_forward_across_the_window(family, models, one_thread):
    """completion_logprobs == log_softmax(model(...).logits / T) of the padded batch and of each unpadded row (the
    trainer trims padding columns, so the result must not depend on them); with the window removed it differs."""
    model = models(family)
    a = sample("hf", model)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
                                    temperature=TEMPERATURE)
        # one more column of left padding changes nothing
        lp_pad, _ = completion_logprobs(model, torch.nn.functional.pad(a.prompt_ids, (1, 0), value=TOK.pad_token_id),
                                        torch.nn.functional.pad(a.prompt_mask, (1, 0)), a.completion_ids,
                                        a.completion_mask, temperature=TEMPERATURE)
    torch.testing.assert_close(lp.double(), dense_logprobs(model, a, TEMPERATURE), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp.double(), row_forward_logprobs(model, a, TEMPERATURE), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_pad, lp, atol=1e-5, rtol=0)
    if windowed(family):
        full = make_model(family, window=False)
        assert (dense_logprobs(full, a, TEMPERATURE) - lp.double()).abs().max() > 1e-2


def spy_grouped_sdpa(monkeypatch) -> list[bool]:
    """Record, for each sdpa call, whether its query heads were laid out as rows of their KV group."""
    sdpa, grouped = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, *args, **kw):
        grouped.append(query.shape[1] == COMMON["num_key_value_heads"])
        return sdpa(query, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return grouped


GQA_ENGINES = {
    "static": ("static", dict(check_every=4)),
    "hf_fast_gqa": ("hf", dict(fast_gqa=True)),
    "hf_static_cache": ("hf", dict(fast_gqa=True, static_cache=True, compile=False)),  # transformers' rolling cache
}


@pytest.mark.parametrize("engine", list(GQA_ENGINES))
@pytest.mark.parametrize("family", ["mistral_window", "gemma3_text", "qwen2_sliding", "llama4_chunked"])
def test_sdpa_gqa_decode_with_window(family, engine, models, one_thread, monkeypatch):
    """With "sdpa", decode attention skips repeat_kv (query heads as rows of their KV group: 2 "heads" of 2 query
    rows here); the window or chunk lives in the mask."""
    model = models(family, "sdpa")
    backend, kwargs = GQA_ENGINES[engine]
    if family == "llama4_chunked" and engine == "hf_static_cache":  # transformers' static generate fails on it
        with pytest.raises(UnsupportedModelError, match="static_cache=True.*'llama4_text'.*static_cache=False"):
            make_engine(backend, model, TOK, **kwargs)
        return
    grouped = spy_grouped_sdpa(monkeypatch)
    opts = SamplingOptions(num_generations=2, temperature=TEMPERATURE, max_new_tokens=10, seed=5, ignore_eos=True)
    a = make_engine(backend, model, TOK, **kwargs).generate(PROMPTS, opts)
    monkeypatch.undo()
    assert len(grouped) == sum(grouped) == 2 * 10, grouped  # both layers at the prompt's prefill and each of 9 steps
    with torch.no_grad():
        lp, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
                                    temperature=TEMPERATURE)
    torch.testing.assert_close(a.sampler_logp, lp.float(), atol=1e-4, rtol=0)


UNSUPPORTED = {
    # model_type: (config factory, reason named in the error)
    "qwen3_next": (lambda: tf.Qwen3NextConfig(**COMMON, head_dim=8), "linear_attention"),
    "mamba": (lambda: tf.MambaConfig(vocab_size=len(TOK), hidden_size=32, num_hidden_layers=2), "linear_attention"),
    "gemma3n_text": (lambda: tf.Gemma3nTextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=8,
                                                  num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=2,
                                                  hidden_size_per_layer_input=8,
                                                  vocab_size_per_layer_input=len(TOK)), "num_kv_shared_layers"),
}


@pytest.mark.parametrize("model_type", list(UNSUPPORTED))
def test_unsupported_layouts_refused_naming_backend_hf(model_type):
    """Recurrent / linear-attention layers have no KV cache to copy, KV-shared layers none of their own: static
    and continuous refuse the model when the engine is built, before any sampling."""
    make_cfg, reason = UNSUPPORTED[model_type]
    with torch.device("meta"):  # shapes only: the check reads the config and the model class
        model = tf.AutoModelForCausalLM.from_config(make_cfg())
    for backend in ("static", "continuous"):
        with pytest.raises(UnsupportedModelError, match=rf"backend={backend} .*'{model_type}'.*{reason}.*backend=hf"):
            make_eng(backend, model)
    assert make_eng("hf", model) is not None


def test_varlen_attention_models_decode_through_grouped_sdpa(models, one_thread, monkeypatch):
    """A model trained with attn_implementation="logitless_varlen" (packed micro-batches) samples through the same
    grouped-query sdpa decode as an "sdpa" model: its unpacked batches are sdpa, so the fast path applies."""
    from logitless.models.varlen import NAME, register

    register()
    model = models("mistral_window", "sdpa")
    monkeypatch.setattr(model.config, "_attn_implementation", NAME)
    grouped = spy_grouped_sdpa(monkeypatch)
    opts = SamplingOptions(num_generations=2, temperature=TEMPERATURE, max_new_tokens=10, seed=5, ignore_eos=True)
    a = make_engine("static", model, TOK, check_every=4).generate(PROMPTS, opts)
    assert model.config._attn_implementation == NAME  # the engine restored the model's own implementation
    monkeypatch.undo()
    assert len(grouped) == sum(grouped) == 2 * 10, grouped  # the prompt's prefill and the 9 decode steps
    with torch.no_grad():
        lp, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
                                    temperature=TEMPERATURE)
    torch.testing.assert_close(a.sampler_logp, lp.float(), atol=1e-4, rtol=0)
