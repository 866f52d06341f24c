"""The static engine's decode step as one graph (`rollout/step_graph.py`, rollout.step_graph).

CPU: the step over fixed buffers with a step counter on the device (what the CUDA graph captures; off CUDA it runs
eagerly) draws the same tokens and logprobs as the engine's step loop, bit for bit, across model families
(full, sliding-window, alternating and chunked layouts), with EOS ids that end most rows early, stop strings
checked on the host, early exit once every row is done, and rows split over several waves. Refusals: with
length buckets or compaction, with top-k/top-p/min-p or a repetition penalty, off the static backend.
GPU (`python -m pytest -m gpu tests/test_step_graph.py`): the captured graph (one capture per wave) against the
compiled loop of the same model, and against completion_logprobs.
"""

from __future__ import annotations

import pytest
import torch

from logitless.rollout import SamplingOptions, make_engine
from logitless.rollout import step_graph as step_graph_module
from tests.test_rollout_families import PROMPTS, TOK, make_model

FAMILIES = ["llama", "qwen2_sliding", "mistral_window", "gemma2", "gpt_oss", "llama4_chunked", "gpt2"]
EOS = list(range(3, 258, 9))  # about one byte in nine ends a row: most rows end within the 12 tokens


def options(**kw) -> SamplingOptions:
    base = dict(num_generations=3, temperature=0.9, max_new_tokens=12, seed=11, eos_token_ids=EOS)
    return SamplingOptions(**{**base, **kw})


def both(model, opts: SamplingOptions, **engine_kw):
    """(batch of the step loop, batch of the fixed-buffer step, the step's count of advance() calls)."""
    loop = make_engine("static", model, TOK, step_graph=False, check_every=3, **engine_kw).generate(PROMPTS, opts)
    calls = []
    real = step_graph_module.DecodeStep.advance

    def counted(self):
        calls.append(1)
        return real(self)

    step_graph_module.DecodeStep.advance = counted
    try:
        graph = make_engine("static", model, TOK, step_graph=True, check_every=3, **engine_kw).generate(PROMPTS, opts)
    finally:
        step_graph_module.DecodeStep.advance = real
    return loop, graph, len(calls)


def assert_same(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.sampler_logp, b.sampler_logp)


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = make_model(family)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_the_step_draws_the_loops_tokens_and_logprobs(family, models, one_thread):
    loop, graph, calls = both(models(family), options())
    assert_same(loop, graph)
    lens = loop.completion_mask.sum(1)
    assert lens.min() < 12 and calls > 0  # EOS ended rows early, and the step (not the loop) decoded


def test_early_exit_when_every_row_is_done_and_stop_strings(models, one_thread):
    model = models("llama")
    loop, graph, calls = both(model, options(max_new_tokens=40, eos_token_ids=list(range(3, 258, 3))))
    assert_same(loop, graph)
    assert loop.completion_mask.sum(1).max() < 40 and calls < 39  # every row ended: the step loop stopped early
    loop, graph, _ = both(model, options(stop=["a", "e"], eos_token_ids=[257]))
    assert_same(loop, graph)


def test_several_waves_and_greedy(models, one_thread):
    model = models("qwen2_sliding")
    row = 2 * 2 * 2 * 8 * 4 * 128  # layers x (k, v) x kv heads x head dim x fp32 x 128 slots
    loop, graph, calls = both(model, options(), max_kv_gib=4 * row / 2**30)  # 9 rows in 3 waves of 3
    assert_same(loop, graph)
    loop, graph, _ = both(model, options(temperature=0.0, num_generations=1))
    assert_same(loop, graph)


def test_profile_times_the_step_as_one_part(models, one_thread):
    batch = make_engine("static", models("llama"), TOK, step_graph=True, profile=True).generate(PROMPTS, options())
    parts = batch.timing.parts
    assert parts["step"] > 0 and parts["prefill"] > 0 and parts["sample"] > 0, parts
    assert "forward" not in parts  # the forward runs inside the step


def test_the_steps_bookkeeping_syncs_nothing_with_many_stop_ids():
    """A captured step may hold no op that waits for the device. `torch.isin` sorts once the ids to test outnumber
    int(10 * b**0.145) (15 at 24 rows), and its sort takes the unique elements, a device sync: an episode driver's 31
    turn-end ids made the episode step's capture fail on CUDA. The step's draw-and-write (`first`, what every step
    runs after its forward) with EOS's 29 ids at 24 rows runs no such op here, and flags the rows `isin` does."""
    from torch.profiler import profile

    b, W = 24, 8
    eos = torch.tensor(EOS)
    drawn = torch.arange(b) * 5  # rows 0..23 draw 0, 5, ..., 115: some are in EOS (3, 12, 21, ...)

    def draw(logits, keys, t, codes, T, greedy):
        return drawn, torch.zeros(b)

    step = step_graph_module.DecodeStep(
        None, draw, None, mask=torch.ones(b, 4), next_pos=torch.zeros(b, 1, dtype=torch.long),
        done=torch.zeros(b, dtype=torch.bool), keys=torch.zeros(b, dtype=torch.long),
        history=torch.zeros(b, W, dtype=torch.long), out_logp=torch.zeros(b, W), prompt_len=0, pad_id=0, eos=eos,
        codes=torch.zeros(1), temperature=1.0, greedy=False, limit=torch.full((b,), W))
    with profile() as prof:
        step.first(torch.zeros(b, 3))
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::sort", "aten::item",
                      "aten::_local_scalar_dense", "aten::nonzero"}, sorted(ops)
    assert torch.equal(step.done, torch.isin(drawn, eos)) and step.done.any() and not step.done.all()
    with profile() as prof:
        torch.isin(drawn, eos)
    assert "aten::_unique" in {e.name for e in prof.events()}  # what the test guards against is real


def test_refused_where_one_graph_cannot_serve_every_step(models):
    from logitless.trainer.config.schema import load_train_config

    model = models("llama")
    with pytest.raises(ValueError,
                       match=r"rollout\.step_graph=true captures one decode step .* set rollout\.length_buckets=1, or"):
        make_engine("static", model, TOK, step_graph=True, length_buckets=2)
    with pytest.raises(ValueError, match=r"compaction change its shapes between steps: set rollout\.compact_finished=false, or"):
        make_engine("static", model, TOK, step_graph=True, compact_finished=True)
    eng = make_engine("static", model, TOK, step_graph=True)
    with pytest.raises(ValueError, match=r"rollout\.step_graph=true draws with the fused sampler.*top-k"):
        eng.generate(PROMPTS, options(top_k=5))
    with pytest.raises(ValueError, match=r"rollout\.top_p, rollout\.repetition_penalty rule\(s\) out"):
        load_train_config(None, ["rollout.backend=static", "rollout.step_graph=true", "rollout.top_p=0.9",
                                 "rollout.repetition_penalty=1.1"])
    with pytest.raises(ValueError, match=r"rollout\.step_graph=True needs rollout\.backend=static"):
        load_train_config(None, ["rollout.backend=hf", "rollout.step_graph=true"])
    assert load_train_config(None, []).rollout.step_graph is None


def test_auto_keeps_the_loop_off_cuda_and_with_filters(models):
    eng = make_engine("static", models("llama"), TOK)
    assert not eng._graph_step(torch.device("cpu"), [])
    assert not make_engine("static", models("llama"), TOK, compile=True)._graph_step(torch.device("cpu"), [])


def test_auto_captures_an_uncompiled_step_on_cuda_only_where_asked(models):
    """step_graph unset on CUDA: the compiled decode's step is captured; an uncompiled one only with capture_eager
    (a tensor-parallel group's: trainer/placement/tensor_parallel.py), and never with filters or step_graph=false. (The
    decision only: no GPU is touched.)"""
    cuda = torch.device("cuda")
    eng = make_engine("static", models("llama"), TOK, compile=False)
    assert not eng._graph_step(cuda, [])
    eng.capture_eager = True
    assert eng._graph_step(cuda, []) and not eng._graph_step(cuda, [object()])
    assert not eng._graph_step(torch.device("cpu"), [])
    off = make_engine("static", models("llama"), TOK, compile=False, step_graph=False)
    off.capture_eager = True
    assert not off._graph_step(cuda, [])
    assert make_engine("static", models("llama"), TOK, compile=True)._graph_step(cuda, [])


gpu = pytest.mark.gpu


@gpu
def test_captured_step_equals_the_compiled_loop_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from logitless.models import completion_logprobs
    from tests.conftest import tiny_qwen2

    model = tiny_qwen2(vocab_size=len(TOK), hidden=128, layers=2).to("cuda", torch.bfloat16).eval()
    opts = options(max_new_tokens=70, eos_token_ids=[257])
    captures = []
    real = step_graph_module.capture

    def counted(fn, side):
        captures.append(1)
        return real(fn, side)

    step_graph_module.capture = counted
    try:
        eng = make_engine("static", model, TOK, max_kv_gib=None)
        assert eng._graph_step(torch.device("cuda"), [])
        graph = eng.generate(PROMPTS, opts)
        graph2 = eng.generate(PROMPTS, opts)
        many = options(max_new_tokens=70, eos_token_ids=EOS)  # 29 ids: torch.isin would sort (a sync) here
        graph_many = eng.generate(PROMPTS, many)
    finally:
        step_graph_module.capture = real
    loop = make_engine("static", model, TOK, step_graph=False).generate(PROMPTS, opts)
    loop_many = make_engine("static", model, TOK, step_graph=False).generate(PROMPTS, many)
    assert captures == [1, 1, 1]  # one capture per wave and call, with many stop ids too
    assert torch.equal(graph_many.completion_ids, loop_many.completion_ids)
    assert graph_many.completion_mask.sum(1).min() < 70  # the stop ids ended rows inside the graph
    assert torch.equal(graph.completion_ids, graph2.completion_ids)
    assert torch.equal(graph.completion_ids, loop.completion_ids)
    torch.testing.assert_close(graph.sampler_logp, loop.sampler_logp, rtol=0, atol=1e-5)
    lp = completion_logprobs(model, graph.prompt_ids.cuda(), graph.prompt_mask.cuda(), graph.completion_ids.cuda(),
                             graph.completion_mask.cuda(), temperature=opts.temperature)[0]
    m = graph.completion_mask.bool()
    assert (lp.float().cpu()[m] - graph.sampler_logp[m]).abs().max() < 0.1  # bf16 forward, padded vs decode


@pytest.mark.gpu
def test_a_forward_that_cannot_be_captured_decodes_on_without_the_graph(tiny_qwen2_model, gpt2_tokenizer):
    """A model whose forward copies a pageable host tensor to the GPU (what failed the capture on OLMo-2, Granite
    and GPT-OSS in some setups) decodes the same tokens as the loop, with one warning, instead of crashing; and the
    failed capture leaves the process's random generator as it was and usable (a failed capture used to keep the
    generator's state registered with the dead graph: every later CUDA random op raised)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from logitless.rollout.static import StaticEngine

    model = tiny_qwen2_model.to("cuda", torch.bfloat16)
    inner = model.model.forward

    def host_copy_forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        hidden = out.last_hidden_state
        out.last_hidden_state = hidden + torch.zeros(1, dtype=hidden.dtype).to(hidden.device)  # pageable: no capture
        return out

    model.model.forward = host_copy_forward
    try:
        opts = SamplingOptions(num_generations=2, max_new_tokens=24, seed=5, ignore_eos=True)
        rng = torch.cuda.get_rng_state()
        # the warning names the first error inside the capture, not capture_end's "previous error during capture"
        with pytest.warns(UserWarning, match=r"could not be captured as one CUDA graph \(.*CPU tensor is pinned"):
            graph = StaticEngine(model, gpt2_tokenizer, compile=False, step_graph=True).generate(["hi there"], opts)
        assert torch.equal(torch.cuda.get_rng_state(), rng)  # the decode draws no torch random numbers
        assert torch.isfinite(torch.randn(8, device="cuda")).all()  # the generator works after the failed capture
        loop = StaticEngine(model, gpt2_tokenizer, compile=False, step_graph=False).generate(["hi there"], opts)
    finally:
        model.model.forward = inner
    assert torch.equal(graph.completion_ids, loop.completion_ids)
