"""Rollout helpers on their own, on the cases that mutation testing (docs/testing.md) showed the engine tests
leave open: where a stop string cuts (a stop string in the first token, twice in the text, a special token),
what compaction keeps, which weight source is chosen and why a merge is refused, and that the merged copy
leaves the training model's frozen weights frozen."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from logitless.rollout import SamplingOptions
from logitless.rollout.engine import _cut_text, _stop_cut
from logitless.rollout.weights import LiveWeights, MergedLoraWeights, merge_refusal, rollout_weights
from tests.test_rollout_families import TOK, make_model
from tests.test_rollout_weights import lora_model


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]  # one token per byte


def test_stop_cut_is_the_shortest_prefix_that_holds_a_stop_string():
    assert _stop_cut(TOK, ids("x=1;y"), [";"]) == 4
    assert _stop_cut(TOK, ids(";abc"), [";"]) == 1  # the first token alone completes it
    assert _stop_cut(TOK, ids("ab;c;"), ["c;", "b;"]) == 3  # the earliest of several
    assert _stop_cut(TOK, ids("abc"), [";"]) is None and _stop_cut(TOK, [], [";"]) is None
    # special tokens are decoded too: a stop string may be one
    assert _stop_cut(TOK, ids("ab") + [TOK.eos_token_id] + ids("c"), ["<eos>"]) == 3


def test_cut_text_cuts_after_the_first_stop_string():
    assert _cut_text("a;b;c", [";"]) == "a;"
    assert _cut_text("xx END yy END", ["END", "yy"]) == "xx END"
    assert _cut_text("abc", [";"]) == "abc"  # decoded without special tokens, the stop string may be gone


def test_compaction_keeps_every_unfinished_row():
    from logitless.rollout.kv_cache import decode_cache, prefill_cache
    from logitless.rollout.static_rows import DecodeRows

    b, L = 20, 4
    pre = prefill_cache()
    pre.update(torch.randn(b, 1, 2, 2), torch.randn(b, 1, 2, 2), 0)
    done = torch.ones(b, dtype=torch.bool)
    unfinished = torch.tensor([0, 2, 3, 5, 8, 11, 13, 17, 19])  # 9 of 20: more than a power of two
    done[unfinished] = False
    rows = DecodeRows(torch.arange(b) + 100, decode_cache(pre, torch.arange(b), L), torch.ones(b, L, dtype=torch.long),
                 torch.arange(b)[:, None], done, torch.arange(b) * 7, torch.randn(b, 5), L)
    token = torch.arange(b) + 1000
    picked, tok = rows.compacted(token)
    assert len(picked.index) == 16  # the next power of two
    assert set(unfinished.tolist()) <= set((picked.index - 100).tolist())
    sel = picked.index - 100
    assert torch.equal(tok, token[sel]) and torch.equal(picked.keys, rows.keys[sel])
    assert torch.equal(picked.cache.layers[0].keys, rows.cache.layers[0].keys[sel])
    # at most half unfinished is needed, and never below 8 rows
    done[:] = False
    assert rows.compacted(token)[0] is rows
    small = DecodeRows(torch.arange(8), rows.cache, rows.mask[:8], rows.next_pos[:8], torch.ones(8, dtype=torch.bool),
                  rows.keys[:8], rows.logits[:8], L)
    assert small.compacted(token[:8])[0] is small


def test_weight_source_is_the_model_itself_when_not_merged():
    plain = make_model("llama")
    assert rollout_weights(plain, None).module is plain
    assert rollout_weights(plain, False).module is plain
    model = lora_model("llama")
    assert rollout_weights(model, False).module is model
    with pytest.raises(ValueError) as info:
        rollout_weights(plain, True)
    assert str(info.value) == ("rollout.merge_lora=true needs a LoRA model (model.lora_r > 0); unset it for full "
                               "fine-tuning")
    assert LiveWeights(plain).sync() is None and LiveWeights(plain).extra_bytes == 0


def test_merge_refusals_name_the_reason():
    assert merge_refusal(make_model("llama")) == "the model has no LoRA adapters"
    assert merge_refusal(lora_model("llama")) is None
    dora = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    assert merge_refusal(dora) == f"layer {name} uses DoRA, whose update is not an additive weight delta"
    merged = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    merged.base_model.model.model.layers[0].self_attn.q_proj.merge()
    assert merge_refusal(merged) == f"layer {name} already has adapters merged into its base weights"
    quant = get_peft_model(make_model("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    layer = quant.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer()
    layer.weight = torch.nn.Parameter(layer.weight.to(torch.int8), requires_grad=False)
    assert merge_refusal(quant) == (f"layer {name} wraps a Linear whose weight is neither a plain float tensor nor "
                                    "bitsandbytes 4-bit (quantized otherwise?)")
    with pytest.raises(ValueError) as info:
        MergedLoraWeights(make_model("llama"))
    assert str(info.value) == ("rollout.merge_lora=true cannot merge this model's adapters: the model has no LoRA "
                               "adapters; set rollout.merge_lora=false to decode with the unmerged PEFT model")


def test_merged_copy_leaves_the_training_model_trainable_as_it_was():
    model = lora_model("llama")
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    assert any(before.values()) and not all(before.values())  # adapters train, the base is frozen
    weights = MergedLoraWeights(model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert not any(p.requires_grad for p in weights.module.parameters())
    assert not weights.module.training


def test_host_check_marks_rows_whose_text_holds_a_stop_string():
    from types import SimpleNamespace

    from logitless.rollout.static import StaticEngine
    from logitless.rollout.types import SamplingOptions

    P = 2
    texts = ["ab;c", "abcd", "x;yz"]  # row 2 is already done
    history = torch.tensor([ids("pp" + t) for t in texts])
    live = SimpleNamespace(done=torch.tensor([False, False, True]), index=torch.tensor([0, 1, 2]))
    engine = SimpleNamespace(tokenizer=TOK)
    opts = SamplingOptions(stop=[";"])
    assert StaticEngine._all_done(engine, live, history, P, 4, opts) is False
    assert live.done.tolist() == [True, False, True]
    live.index = torch.tensor([0, 2, 0])  # live row 1 now writes row 2 of the wave, which holds a stop string
    assert StaticEngine._all_done(engine, live, history, P, 4, opts) is True
    live = SimpleNamespace(done=torch.tensor([False]), index=torch.tensor([0]))
    assert StaticEngine._all_done(engine, live, history, P, 4, SamplingOptions()) is False  # no stop strings
    # a stop string may be a special token's text
    history = torch.tensor([ids("ppa") + [TOK.eos_token_id]])
    assert StaticEngine._all_done(engine, live, history, P, 2, SamplingOptions(stop=["<eos>"])) is True


def test_static_engine_settings_and_their_checks():
    from logitless.rollout.static import StaticEngine
    from logitless.rollout.types import SamplingOptions

    model = make_model("llama")
    eng = StaticEngine(model, TOK)
    assert (eng.check_every, eng.cache_multiple, eng.length_buckets, eng.compact_finished) == (32, 128, 1, False)
    b = eng.generate(["ab"], SamplingOptions(num_generations=1, max_new_tokens=2, seed=0, ignore_eos=True))
    assert b.timing.parts == {}  # profile is off unless asked for
    opts = SamplingOptions(num_generations=1, max_new_tokens=2, seed=0, ignore_eos=True)
    parts = StaticEngine(model, TOK, profile=True).generate(["ab"], opts).timing.parts
    # the call's work outside the decode
    around = {"prepare", "weights_sync", "weights_release", "release_gc", "release_cache", "batch"}
    assert set(parts) == {"prefill", "sample", "forward", "host_checks"} | around
    assert all(v >= 0 for v in parts.values())
    StaticEngine(model, TOK, check_every=1, cache_multiple=1, length_buckets=1)  # the smallest valid values
    for kw in ({"check_every": 0}, {"cache_multiple": 0}):
        with pytest.raises(ValueError) as info:
            StaticEngine(model, TOK, **{"check_every": 4, "cache_multiple": 8, **kw})
        c, m = kw.get("check_every", 4), kw.get("cache_multiple", 8)
        assert str(info.value) == f"StaticEngine: check_every={c} and cache_multiple={m} must both be >= 1"
    for bad in (0, 1.0):
        with pytest.raises(ValueError) as info:
            StaticEngine(model, TOK, length_buckets=bad)
        assert str(info.value) == (f"rollout.length_buckets={bad!r} must be an int >= 1 (1 = attend over the "
                                   "whole cache)")
    with pytest.raises(ValueError) as info:
        StaticEngine(model, TOK, max_kv_gib=0.0)
    assert str(info.value) == "rollout.max_kv_gib=0.0 must be > 0 (GiB), or unset for the automatic budget"


def test_static_engine_compiles_on_cuda_unless_told_otherwise():
    from logitless.rollout.static import StaticEngine

    model = make_model("llama")
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device name only: no GPU needed
    auto = StaticEngine(model, TOK)
    assert auto._use_compile(cuda) is True and auto._use_compile(cpu) is False
    assert StaticEngine(model, TOK, compile=True)._use_compile(cpu) is True
    assert StaticEngine(model, TOK, compile=False)._use_compile(cuda) is False


def test_static_cache_length_rounds_up_never_shrinks_and_fits_the_context():
    from logitless.rollout.static import StaticEngine

    model = make_model("llama")
    eng = StaticEngine(model, TOK, cache_multiple=16)
    assert eng._cache_len(10, 7, None) == 32  # 17 rounded up to a multiple of 16
    assert eng._cache_len(3, 2, None) == 32  # never below an earlier call's
    assert StaticEngine(model, TOK, cache_multiple=16)._cache_len(10, 6, None) == 16
    assert StaticEngine(model, TOK, cache_multiple=128)._cache_len(10, 10, 64) == 64  # within the context window
    assert StaticEngine(model, TOK, cache_multiple=128)._cache_len(50, 30, 64) == 80  # but room for P + S


def test_static_wave_size_from_max_kv_gib():
    from logitless.rollout.engine import prepare_prompts
    from logitless.rollout.kv_cache import kv_bytes_per_token
    from logitless.rollout.static import StaticEngine
    from logitless.rollout.types import SamplingOptions

    model = make_model("llama")
    opts = SamplingOptions(num_generations=8, max_new_tokens=4, seed=0, ignore_eos=True)
    probe = StaticEngine(model, TOK, cache_multiple=8)
    prep = prepare_prompts(model, TOK, ["abc"], opts)
    with torch.no_grad():
        call, _ = probe._start_call(model, prep, opts, probe._cache_len(prep.ids.shape[1], 4, prep.context))
    row = call.cache_len * kv_bytes_per_token(call.prefill)  # bytes of one row's decode cache
    assert row == 8 * 2 * 2 * 2 * 8 * 4  # slots x layers x (k, v) x kv heads x head dim x fp32
    eng = StaticEngine(model, TOK, cache_multiple=8, max_kv_gib=3.5 * row / 2**30)
    assert eng._wave_size(call, 8) == 3  # 3 rows fit: waves of 3, 3 and 2
    assert StaticEngine(model, TOK, max_kv_gib=8 * row / 2**30)._wave_size(call, 8) == 8
    assert probe._wave_size(call, 8) == 8  # no budget on CPU


@pytest.mark.parametrize("field, value, error, text", [
    ("num_generations", True, TypeError, "SamplingOptions.num_generations must be an int, got True"),
    ("num_generations", 0, ValueError, "SamplingOptions.num_generations=0 is invalid: use G >= 1 samples per prompt"),
    ("temperature", True, ValueError, "SamplingOptions.temperature=True is invalid: use a finite temperature >= 0 (0 = greedy)"),
    ("temperature", "1.0", ValueError, "SamplingOptions.temperature='1.0' is invalid: use a finite temperature >= 0"),
    ("temperature", math.inf, ValueError, "SamplingOptions.temperature=inf is invalid"),
    ("temperature", -0.1, ValueError, "SamplingOptions.temperature=-0.1 is invalid"),
    ("top_p", 1.5, ValueError, "SamplingOptions.top_p=1.5 is invalid: use 0 < top_p <= 1 (1 disables nucleus filtering)"),
    ("top_p", 0.0, ValueError, "SamplingOptions.top_p=0.0 is invalid"),
    ("top_k", True, ValueError, "SamplingOptions.top_k=True is invalid: use an int >= 0 (0 disables top-k)"),
    ("top_k", 2.0, ValueError, "SamplingOptions.top_k=2.0 is invalid"),
    ("top_k", -1, ValueError, "SamplingOptions.top_k=-1 is invalid"),
    ("min_p", 1.0, ValueError, "SamplingOptions.min_p=1.0 is invalid: use 0 <= min_p < 1 (0 disables min-p)"),
    ("repetition_penalty", 0.0, ValueError,
     "SamplingOptions.repetition_penalty=0.0 is invalid: use a positive value (1.0 disables it)"),
    ("max_new_tokens", True, TypeError, "SamplingOptions.max_new_tokens must be an int, got True"),
    ("max_new_tokens", 0, ValueError, "SamplingOptions.max_new_tokens=0 is invalid: use max_new_tokens >= 1"),
    ("stop", [""], ValueError,
     "SamplingOptions.stop=[''] is invalid: pass a list of non-empty strings, e.g. stop=[\"</answer>\"]"),
    ("stop", [3], ValueError, "SamplingOptions.stop=[3] is invalid"),
])
def test_sampling_options_refuse_each_bad_field_by_its_text(field, value, error, text):
    opts = dataclasses.replace(SamplingOptions(), **{field: value})
    with pytest.raises(error) as e:
        opts.validate()
    assert type(e.value) is error and str(e.value).startswith(text)


@pytest.mark.parametrize("field, value", [
    ("num_generations", 1), ("temperature", 0), ("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
    ("max_new_tokens", 1), ("stop", ("</answer>",)), ("stop", []),
])
def test_sampling_options_accept_each_field_at_its_edge(field, value):
    dataclasses.replace(SamplingOptions(), **{field: value}).validate()


def test_a_rollout_runs_a_full_gc_only_when_a_kv_cache_outlives_it(monkeypatch):
    """The release after a static rollout calls gc.collect() (a good part of a second with compiled graphs) only
    when one of the call's KV caches is still alive once its locals are gone, i.e. held by a reference cycle."""
    import logitless.rollout.engine as engine_mod
    from logitless.rollout import kv_cache, static_rows
    from logitless.rollout.static import StaticEngine
    from logitless.rollout.types import SamplingOptions

    calls = []
    monkeypatch.setattr(engine_mod.gc, "collect", lambda *a: calls.append(a) or 0)
    model = make_model("llama")
    opts = SamplingOptions(num_generations=2, max_new_tokens=3, seed=0, ignore_eos=True)
    parts = StaticEngine(model, TOK, profile=True).generate(["ab", "b"], opts).timing.parts
    assert calls == [] and parts["release_gc"] >= 0  # no cycle holds the caches: nothing to collect
    cyclic = kv_cache.decode_cache

    def decode_cache_in_a_cycle(*args, **kwargs):
        cache = cyclic(*args, **kwargs)
        cache.myself = cache  # a reference cycle: only a collection frees it
        return cache

    monkeypatch.setattr(static_rows, "decode_cache", decode_cache_in_a_cycle)
    StaticEngine(model, TOK).generate(["ab", "b"], opts)
    assert len(calls) == 1
