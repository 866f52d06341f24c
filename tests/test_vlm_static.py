"""The static engine decodes prompts with images (`rollout/static_rows.py`) on tiny random Qwen2.5-VL, Qwen3-VL
(interleaved M-RoPE, deepstack) and Gemma 3 (bidirectional image blocks, a sliding-window layer), fp32 on CPU, from
the merged-LoRA copy the trainer decodes with.

Ground truth: the trainer's `completion_logprobs` with the rows' images, which computes each completion token's
positions by the model's own `get_rope_index` over prompt + completion. The sampled rows' logprobs must equal it to
1e-5 for G > 1, prompts of odd and even lengths, images of several sizes in one call and a prompt without images,
whether the rows decode in one wave, in waves or through refilled slots (a KV budget of two rows), or through the
step the CUDA graph captures (run eagerly here). A decode position off by one fails by whole nats
(`test_a_wrong_position_fails_the_comparison`). The `hf` engine draws from torch's generator and the static engine
from its counter-based streams (`rollout/sampling.py`): they share no random stream, so their sampled tokens are
compared only greedily; sampled rows are compared with the trainer. The GPU test holds the compiled bf16 decode to
the `hf` engine's own gap from the trainer."""

from __future__ import annotations

import re

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.vision import placeholder_ids
from logitless.rollout import SamplingOptions, make_engine, static_refill, static_rows
from logitless.rollout import static as static_module
from logitless.rollout.sampling import step_sampler, vocab_codes
from logitless.rollout.weights import MergedLoraWeights
from vlm_fixtures import FAMILIES, favour_turn_ends, lora_vlm, shape_image


def chat(text, images=()):
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


# images of three sizes (Gemma 3 resizes every image to one), two in one prompt, one prompt without
PROMPTS = [chat("How many red shapes?", [shape_image(3, 1)]),
           chat("Compare the two, please.", [shape_image(1, 2, size=112), shape_image(2, size=84)]),
           [{"role": "user", "content": "No image here."}]]
EOS = list(range(7, 151_000, 5))  # a fifth of the vocabulary ends a row: lengths vary over the 8 tokens


def options(**kw) -> SamplingOptions:
    return SamplingOptions(**{**dict(num_generations=3, temperature=1.0, max_new_tokens=8, seed=3,
                                     eos_token_ids=EOS), **kw})


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, qwen_tokenizer_dir, tmp_path_factory, one_thread):
    """(family, LoRA model with drawn B matrices, processor), one per family for the module."""
    model, _, processor = lora_vlm(qwen_tokenizer_dir, tmp_path_factory.mktemp("vlm") / "model", request.param)
    return request.param, model, processor


def static(model, processor, **kw):
    """The static engine as the trainer builds it for a LoRA model: decoding from the merged-LoRA copy."""
    return make_engine("static", model, processor, weights=MergedLoraWeights(model), **kw)


def gap(model, b) -> float:
    """max |sampler logprob - trainer logprob| over the batch's completion tokens."""
    with torch.no_grad():
        logp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                      images=b.images)
    return float(((logp - b.sampler_logp) * b.completion_mask).abs().max())


def kv_budget(model, rows: int, slots: int = 128) -> float:
    """GiB of the fp32 keys and values of `rows` rows of `slots` cache slots (the cache's default rounding)."""
    cfg = model.get_base_model().config.get_text_config(decoder=True)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * slots * (rows + 0.5) / 2**30


@pytest.fixture(scope="module")
def rows(vlm):
    """The static engine's rows of PROMPTS (one wave)."""
    _, model, processor = vlm
    return static(model, processor).generate(PROMPTS, options())


def test_static_rows_have_the_trainers_logprobs(vlm, rows):
    family, model, processor = vlm
    b = rows
    lengths = b.prompt_mask.sum(1)[::3]
    assert len(set(lengths.tolist())) == 3 and (lengths % 2).any()  # padded prompts, an odd length among them
    assert [r is not None for r in b.images.rows] == [True] * 6 + [False] * 3
    assert b.images.rows[0] is b.images.rows[2] and b.images.rows[3]["pixel_values"].shape[0] > \
        b.images.rows[0]["pixel_values"].shape[0]  # a prompt's rows share its tensors; two images in one prompt
    lens = b.completion_mask.sum(1)
    assert lens.min() < lens.max() and not torch.equal(b.completion_ids[0], b.completion_ids[1])
    ids = torch.tensor(list(placeholder_ids(model.get_base_model().config)))
    assert not torch.isin(b.completion_ids, ids).any()
    worst = gap(model, b)
    print(f"{family}: max |static - trainer| logp {worst:.2e}")
    assert worst < 1e-5


def test_waves_refill_and_the_step_decode_the_same_rows(vlm, rows):
    """A KV budget of two rows: Qwen-VL (full attention) refills slots as rows end, Gemma 3 (a sliding layer)
    decodes waves; both, the waves of Qwen-VL and the step that the CUDA graph captures (eager on CPU) give the
    one-wave rows, whose logprobs are the trainer's."""
    family, model, processor = vlm
    one = rows
    budget = kv_budget(model, 2)
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # (counts the calls of the real refill decode)
        mp.setattr(static_module, "decode_refill", lambda *a: calls.append(1) or static_refill.decode_refill(*a))
        small = static(model, processor, max_kv_gib=budget).generate(PROMPTS, options())
    assert bool(calls) == (family != "gemma3")  # refill where every layer is full attention
    variants = [small, static(model, processor, step_graph=True).generate(PROMPTS, options())]
    if family != "gemma3":
        variants.append(static(model, processor, max_kv_gib=budget, refill=False).generate(PROMPTS, options()))
    for b in variants:
        assert torch.equal(b.completion_ids, one.completion_ids) and torch.equal(b.completion_mask,
                                                                                 one.completion_mask)
        torch.testing.assert_close(b.sampler_logp, one.sampler_logp, atol=1e-5, rtol=0)
        assert gap(model, b) < 1e-5


def test_greedy_rows_are_the_hf_engines(vlm):
    """Greedy: both engines take the argmax of the same policy (placeholders banned), so the same tokens, and the
    same logprobs to 1e-5."""
    _, model, processor = vlm
    opts = options(num_generations=1, temperature=0.0, ignore_eos=True)
    s = static(model, processor).generate(PROMPTS, opts)
    h = make_engine("hf", model, processor).generate(PROMPTS, opts)
    assert torch.equal(s.completion_ids, h.completion_ids)
    torch.testing.assert_close(s.sampler_logp, h.sampler_logp, atol=1e-5, rtol=0)


def test_a_wrong_position_fails_the_comparison(vlm, monkeypatch):
    """The comparison sees what it checks: decode positions one past the model's (Qwen-VL: its rope_deltas off by
    one; Gemma 3: its count of real tokens) are whole nats off."""
    family, model, processor = vlm
    if family == "gemma3":
        real = static_rows.prefill_inputs

        def shifted(module, prep):
            positions, extra, start = real(module, prep)
            return positions, extra, prep.mask.sum(1) + 1

        monkeypatch.setattr(static_module, "prefill_inputs", shifted)
    else:
        real = static_rows.decode_start
        monkeypatch.setattr(static_rows, "decode_start", lambda positions, mask: real(positions, mask) + 1)
    b = static(model, processor).generate(PROMPTS, options())
    assert gap(model, b) > 1e-2


def test_the_model_positions_continue_after_its_rope_deltas(vlm):
    """`decode_start` is the model's own `rope_deltas` plus each prompt's real tokens (Qwen-VL)."""
    family, model, processor = vlm
    body = model.get_base_model().model
    if family == "gemma3":
        assert not hasattr(body, "get_rope_index")
        return
    from logitless.rollout.engine import prepare_prompts

    prep = prepare_prompts(model, processor, PROMPTS, options())
    positions, extra, start = static_rows.prefill_inputs(model, prep)
    grids = {k: v for k, v in extra.items() if k == "image_grid_thw"}
    own, deltas = body.get_rope_index(prep.ids, mm_token_type_ids=extra["mm_token_type_ids"],
                                      attention_mask=prep.mask, **grids)
    assert torch.equal(positions, own) and torch.equal(start, deltas[:, 0] + prep.mask.sum(1))
    assert (deltas[:2] < 0).all() and deltas[2] == 0  # image prompts' positions compress; the text prompt's do not


def test_placeholders_are_never_drawn_and_the_logprobs_stay_raw(vlm):
    """With the image placeholder the policy's likeliest token (its lm_head row along the mean hidden state), the
    engine draws everything else, and records the logprob under the raw distribution (the trainer's), not the
    renormalized one."""
    _, model, processor = vlm
    base = model.get_base_model()
    token = base.config.image_token_id if hasattr(base.config, "image_token_id") else base.config.image_token_index
    saved = base.lm_head.weight.detach().clone()
    try:
        favour_turn_ends(model, token, 0.9)
        # the fused draw, and top-k's eager one (transformers' processors, the ban last among them)
        batches = [static(model, processor).generate(PROMPTS, o) for o in (options(), options(top_k=50))]
        with torch.no_grad():
            logps = [completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                         images=b.images)[0] for b in batches]
    finally:
        with torch.no_grad():
            base.lm_head.weight.copy_(saved)
    for b, logp in zip(batches, logps):
        assert not torch.isin(b.completion_ids, torch.tensor(list(placeholder_ids(base.config)))).any()
        mask = b.completion_mask.bool()
        # where the placeholder holds nearly all the mass, the drawn token is unlikely under the raw distribution
        assert (logp[mask] < -20).sum() >= 5, logp[mask]
        torch.testing.assert_close(b.sampler_logp[mask], logp[mask], rtol=1e-5, atol=1e-5)  # big logits: relative


@pytest.mark.parametrize("temperature, greedy", [(1.0, False), (0.7, False), (1.0, True)])
def test_the_banned_draw_is_the_race_over_the_other_tokens(temperature, greedy):
    """`ban_placeholders` draws what the draw over the logits with the banned columns at -inf draws, and its
    logprob is log_softmax(logits / T) of the raw logits, also where the banned tokens hold most of the mass."""
    V, ban = 1000, torch.tensor([3, 500, 999])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, V, generator=gen) * 3
    logits[:, ban] += torch.linspace(0, 12, 64)[:, None]  # from a little to nearly all of the mass
    keys, codes = torch.arange(64) * 7919, vocab_codes(V, torch.device("cpu"))
    draw = step_sampler(torch.device("cpu"), "torch", compile=False)
    token, logp = static_rows.ban_placeholders(draw, ban)(logits, keys, 5, codes, temperature, greedy)
    masked = logits.index_fill(1, ban, float("-inf"))
    assert torch.equal(token, draw(masked, keys, 5, codes, temperature, greedy)[0])
    assert not torch.isin(token, ban).any()
    raw = torch.log_softmax(logits / temperature, -1).gather(1, token[:, None]).squeeze(1)
    torch.testing.assert_close(logp, raw, atol=2e-6, rtol=0)


def test_episodes_of_a_vision_language_model_are_refused(vlm):
    from tests.episode_driver import ScriptedDriver

    _, model, processor = vlm
    driver = ScriptedDriver(lambda b: 2, lambda b, k: [100, 101])
    with pytest.raises(ValueError, match="multi-turn episodes .* rollout.backend=hf"):
        static(model, processor).generate(PROMPTS, options(), episodes=driver)
    assert driver.calls == []  # refused before anything decoded


@pytest.mark.parametrize("settings, world_size, message", [
    ({}, 1, None),
    ({"rollout.device": "cuda:1"}, 1, None),  # one process: a replica on another device decodes the images
    ({"rollout.backend": "continuous"}, 1, "rollout.backend=continuous: rows with images are decoded by "
                                           "rollout.backend=hf or static"),
    ({"rollout.tensor_parallel": 2}, 2, "rollout.tensor_parallel=2: the split rollout does not decode rows with "
                                        "images yet; set rollout.tensor_parallel=1"),
    ({"rollout.device": "cuda:2"}, 2, "rollout.device=cuda:2 under torchrun: rank 0's decode"),
    ({"agent.environment": "vlm_fixtures:CounterScreen"}, 1, "rollout.backend=static does not run multi-turn episodes"),
    ({"rollout.backend": "auto", "rollout.max_kv_gib": 1.0, "agent.environment": "vlm_fixtures:CounterScreen"}, 1,
     "rollout.backend=static does not run multi-turn episodes"),  # auto with a static-only option: static
    ({"train.async_rollout": True}, 1, "train.async_rollout=true checkpoints the rollout it keeps in flight"),
])
def test_the_settings_static_cannot_decode_images_with_are_refused(settings, world_size, message):
    """Before any model loads (`check_image_rows`): rows with images on rollout.backend=static, and what cannot
    take them yet, each refused naming the setting and the fix."""
    from logitless.agents.options import AgentOptions
    from logitless.data import PromptRow
    from logitless.trainer.config.schema import TrainerConfig
    from logitless.trainer.policy.vision import check_image_rows

    cfg = TrainerConfig()
    cfg.rollout.backend = "static"
    for key, value in settings.items():
        section, name = key.split(".")
        if section == "agent":
            cfg.agent = AgentOptions(**{name: value})
        else:
            setattr(getattr(cfg, section), name, value)
    rows = [PromptRow(chat("How many?", [shape_image(1)]))]
    if message is None:
        assert check_image_rows(cfg, rows, world_size) is True
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_image_rows(cfg, rows, world_size)


def test_episodes_on_static_are_refused_against_the_models_config():
    """Before the weights load (`checks.model`, the preflight): agent episodes on rollout.backend=static with a
    vision-language model, whose environment may show images though no prompt row has one; hf runs them."""
    from logitless.agents.options import AgentOptions
    from logitless.trainer.checks.model import check_model
    from logitless.trainer.config.schema import TrainerConfig
    from vlm_fixtures import tiny_vlm_config

    cfg = TrainerConfig()
    cfg.rollout.backend, cfg.agent = "static", AgentOptions(environment="vlm_fixtures:CounterScreen")
    config = tiny_vlm_config(151_665, family="qwen3_vl")
    with pytest.raises(ValueError, match="rollout.backend=static does not run multi-turn episodes .* of a "
                                         "vision-language model yet"):
        check_model(cfg, config)
    cfg.rollout.backend = "hf"
    check_model(cfg, config)


# GPU: the compiled bf16 decode against hf's own rounding on the same weights


@pytest.mark.gpu
@pytest.mark.parametrize("decode_attention", ["auto", "sdpa"])  # the engine's default; a padded run's choice
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_bf16_decode_is_within_hf_rounding(family, decode_attention, qwen_tokenizer_dir, tmp_path):
    """bf16 on CUDA, the decode compiled (its step one CUDA graph): the mean |sampler - trainer| logprob gap of the
    static engine within 1.5x the `hf` engine's on the same weights and prompts (or one fp32 spacing of the
    logprobs, where that is larger) and its largest within 2x; the second call compiles nothing new."""
    from transformers import AutoModelForImageTextToText

    from vlm_fixtures import build_tiny_vlm, tiny_processor

    folder = build_tiny_vlm(qwen_tokenizer_dir, tmp_path / "model", family=family)
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    processor = tiny_processor(qwen_tokenizer_dir, family)
    opts = options(num_generations=8, max_new_tokens=32, ignore_eos=True)  # 768 tokens a call

    def measure(engine, calls: int = 1) -> tuple[float, float, float]:
        for _ in range(calls):
            b = engine.generate(PROMPTS, opts)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, b.prompt_ids.cuda(), b.prompt_mask.cuda(), b.completion_ids.cuda(),
                                          b.completion_mask.cuda(), images=b.images.to("cuda"))
        mask = b.completion_mask.bool()
        d = (logp.cpu()[mask] - b.sampler_logp[mask]).abs()
        spacing = (torch.nextafter(logp.cpu()[mask].abs(), torch.tensor(float("inf"))) - logp.cpu()[mask].abs())
        return float(d.mean()), float(d.max()), float(spacing.mean())

    hf_mean, hf_max, _ = measure(make_engine("hf", model, processor))
    engine = make_engine("static", model, processor, decode_attention=decode_attention)
    engine.generate(PROMPTS, opts)  # compiles
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    mean, worst, spacing = measure(engine)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # same shapes: nothing recompiled
    print(f"{family} {decode_attention}: static mean {mean:.4f} max {worst:.3f}, hf mean {hf_mean:.4f} max {hf_max:.3f}")
    assert mean <= max(1.5 * hf_mean, spacing) and worst <= 2.0 * hf_max
