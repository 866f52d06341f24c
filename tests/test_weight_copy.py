"""rollout.weight_copy: where the rollout's merged-LoRA weights live. "in_place" merges into the frozen base
weights for the rollout and writes the exact base back after it (no copy at all); "sleep" keeps a copy in memory
that is freed during the update and mapped back at the same addresses (rollout/sleep.py, CUDA virtual memory).

CPU: the sleep layout, every refusal, in_place's exactness (merge, restore, never twice) and a run with in_place
that trains exactly like one with a resident copy. GPU (`python -m pytest -m gpu tests/test_weight_copy.py`):
freed memory returns to the driver, addresses survive, a CUDA graph over sleeping weights reads the rewritten
values, the process memory cap counts the mapped bytes, every mode samples exactly what a resident copy samples,
and the rollout's peak shrinks by the copy (in_place) and counts the mapped bytes (sleep)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from logitless.rollout import sleep
from logitless.rollout.sleep import ALIGN, layout
from logitless.rollout.weights import MergedLoraWeights, is_4bit, lora_layers
from tests.test_rollout_weights import lora_model, perturb
from tests.test_trainer import _cfg, _lora, _train, _untimed, rewards_module, tok  # noqa: F401 (fixtures)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_layout_aligns_every_tensor_and_rounds_to_the_granularity():
    offsets, size = layout([3, 1000, 0, 513], granularity=4096)
    assert offsets == [0, ALIGN, 3 * ALIGN, 3 * ALIGN]  # 1000 bytes take two ALIGN blocks; 0 bytes take none
    assert size == 4096
    offsets, size = layout([4096, 1], granularity=4096)
    assert offsets == [0, 4096] and size == 2 * 4096  # 4097 bytes round up to two mapping units
    assert layout([], granularity=2048) == ([], 2048)


def test_sleep_is_unavailable_off_cuda():
    assert "needs a CUDA device (got cpu)" in sleep.unavailable(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        sleep.SleepableMemory([torch.zeros(4)])


def test_in_place_merges_once_and_writes_the_exact_base_back():
    model = lora_model("llama")
    base = {n: layer.get_base_layer().weight.detach().clone() for n, layer in lora_layers(model)}
    resident, in_place = MergedLoraWeights(model, "resident"), MergedLoraWeights(model, "in_place")
    for name, layer in lora_layers(model):
        assert torch.equal(layer.get_base_layer().weight, base[name])  # construction leaves the base as it was
    for _ in range(2):  # a second sync without a release must not merge twice
        in_place.sync()
        for (name, layer), (_, w) in zip(lora_layers(model), resident._pairs):
            assert torch.equal(layer.get_base_layer().weight, w), name  # the same W + ΔW as the resident copy
            assert not torch.equal(w, base[name])  # the check can fail: the adapters move the weights
    in_place.release()
    for name, layer in lora_layers(model):
        assert torch.equal(layer.get_base_layer().weight, base[name])
    perturb(model, 7)  # an update: the next sync merges the new adapters into the exact base
    resident.sync()
    in_place.sync()
    for (_, layer), (_, w) in zip(lora_layers(model), resident._pairs):
        assert torch.equal(layer.get_base_layer().weight, w)
    in_place.release()


def test_in_place_sync_failing_part_way_leaves_nothing_merged_twice(monkeypatch):
    """A sync that runs out of memory after merging some layers (a step the trainer then retries): the next release
    or sync starts from the exact base weights."""
    model = lora_model("llama")
    base = {n: layer.get_base_layer().weight.detach().clone() for n, layer in lora_layers(model)}
    resident, in_place = MergedLoraWeights(model, "resident"), MergedLoraWeights(model, "in_place")
    layers = lora_layers(model)
    victim = layers[len(layers) // 2][1]
    real = type(victim).get_delta_weight
    monkeypatch.setattr(victim, "get_delta_weight", lambda adapter: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(torch.OutOfMemoryError):
        in_place.sync()
    assert not torch.equal(layers[0][1].get_base_layer().weight, base[layers[0][0]])  # the first were merged
    monkeypatch.setattr(victim, "get_delta_weight", lambda adapter: real(victim, adapter))
    in_place.sync()  # the retried rollout
    for (_, layer), (_, w) in zip(layers, resident._pairs):
        assert torch.equal(layer.get_base_layer().weight, w)
    in_place.release()
    for name, layer in layers:
        assert torch.equal(layer.get_base_layer().weight, base[name])


def test_in_place_refuses_a_trained_base_weight_and_shared_parameters_keep_training():
    model = get_peft_model(lora_model("llama").base_model.model,
                           LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]),
                           adapter_name="second")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("modules_to_save" in n for n in trainable)
    MergedLoraWeights(model, "resident")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the copy froze nothing
    layer = lora_layers(model)[0][1]
    layer.get_base_layer().weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"rollout\.weight_copy=in_place .* base weight trains"):
        MergedLoraWeights(model, "in_place")


def test_merged_weights_refuse_a_bad_mode_and_sleep_off_cuda_by_their_text():
    model = lora_model("llama")
    with pytest.raises(ValueError) as info:
        MergedLoraWeights(model, "everywhere")
    assert str(info.value) == "rollout.weight_copy='everywhere': use one of resident, sleep, in_place"
    with pytest.raises(RuntimeError, match=r"^sleepable memory is unavailable: it needs a CUDA device \(got cpu\)$"):
        MergedLoraWeights(model, "sleep")
    with pytest.raises(ValueError) as info:
        sleep.SleepableMemory([])
    assert str(info.value) == "SleepableMemory needs at least one tensor"


def test_a_trained_base_weight_is_refused_for_in_place_only_and_by_its_text():
    model = lora_model("llama")
    name, layer = lora_layers(model.base_model.model)[0]  # named within the model PEFT wraps
    layer.get_base_layer().weight.requires_grad_(True)
    MergedLoraWeights(model, "resident")  # a copy does not touch the base: accepted
    with pytest.raises(ValueError) as info:
        MergedLoraWeights(model, "in_place")
    assert str(info.value) == (f"rollout.weight_copy=in_place merges into frozen full-precision base weights, but "
                               f"layer {name}'s base weight trains; use rollout.weight_copy=sleep or resident")


def test_in_place_with_a_single_lora_layer():
    from tests.test_rollout_families import make_model

    model = get_peft_model(make_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], layers_to_transform=[0]))
    perturb(model, 3)
    (_, layer), = lora_layers(model)
    base = layer.get_base_layer().weight.detach().clone()
    weights = MergedLoraWeights(model, "in_place")
    weights.sync()
    assert not torch.equal(layer.get_base_layer().weight, base)
    weights.release()
    assert torch.equal(layer.get_base_layer().weight, base)


def test_is_4bit_names_bitsandbytes_params_with_a_quant_state():
    class Params4bit(torch.nn.Parameter):  # the name bitsandbytes gives its 4-bit weights; no bitsandbytes here
        pass

    w = Params4bit(torch.zeros(2, 2), requires_grad=False)
    assert not is_4bit(w)  # no quantization state: not quantized yet
    w.quant_state = object()
    assert is_4bit(w)
    plain = torch.nn.Parameter(torch.zeros(2, 2))
    plain.quant_state = object()
    assert not is_4bit(plain) and not is_4bit(None)


@pytest.mark.parametrize("extra, match", [
    (["rollout.backend=static", "rollout.weight_copy=sleep"], r"rollout\.weight_copy=sleep cannot apply: it needs a CUDA "
     r"device \(got cpu\)"),
    (["rollout.backend=hf", "rollout.weight_copy=in_place"],  # (with backend auto it means static)
     r"rollout\.weight_copy='in_place' needs rollout\.backend=static"),
    (["rollout.backend=static", "rollout.weight_copy=in_place", "rollout.merge_lora=false"],
     r"rollout\.weight_copy=in_place cannot apply: the engine decodes with the training model itself"),
    (["rollout.backend=static", "rollout.weight_copy=in_place", "train.async_rollout=true"],
     r"rollout\.weight_copy=in_place .*train\.async_rollout=true"),
    (["rollout.backend=static", "rollout.weight_copy=everywhere"], r"rollout\.weight_copy"),
])
def test_weight_copy_refusals_name_the_setting(tmp_path, tok, rewards_module, extra, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        _train(_cfg(tmp_path / "run", *extra), tok)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


def test_in_place_trains_exactly_like_a_resident_copy(tmp_path, tok, rewards_module):  # noqa: F811
    runs = {mode: _train(_cfg(tmp_path / mode, "rollout.backend=static", "train.max_steps=2",
                              f"rollout.weight_copy={mode}"), tok)
            for mode in ("resident", "in_place")}
    copy = "rollout/weights_copy_gib"
    resident = runs["resident"].records[0][copy]
    # in place, the only copy is the fused q/k/v groups' biases (qwen2 has them): under 1 % of the resident copy
    assert resident > 0 and all(0 <= r[copy] < resident / 100 for r in runs["in_place"].records)
    strip = [[{k: v for k, v in r.items() if k != copy} for r in _untimed(runs[m].records)] for m in runs]
    assert strip[0] == strip[1]
    a, b = _lora(tmp_path / "resident"), _lora(tmp_path / "in_place")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert runs["resident"].records[-1]["loss"] != 0.0


# ---------------------------------------------------------------------------------------------------- GPU


def _free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@gpu
@needs_cuda
def test_sleep_returns_the_memory_and_wake_keeps_the_addresses():
    a = torch.nn.Parameter(torch.randn(64, 2**20, device="cuda"), requires_grad=False)  # 256 MiB
    b = torch.randn(3, 5, device="cuda", dtype=torch.bfloat16)
    values = (a.detach().clone(), b.clone())
    mem = sleep.SleepableMemory([a, b])
    assert torch.equal(a, values[0]) and torch.equal(b, values[1])  # adopted with their values
    assert a.data_ptr() == mem.ptr and b.data_ptr() % ALIGN == 0 and isinstance(a, torch.nn.Parameter)
    ptrs = (a.data_ptr(), b.data_ptr())
    free_awake = _free()
    mem.sleep()
    free_asleep = _free()
    assert free_asleep - free_awake >= mem.size, (free_awake, free_asleep, mem.size)  # the driver has it back
    mem.wake()
    assert free_asleep - _free() >= mem.size
    assert (a.data_ptr(), b.data_ptr()) == ptrs
    with torch.no_grad():
        a.copy_(values[0] * 2)
        b.copy_(values[1] + 1)
    assert torch.equal(a, values[0] * 2) and torch.equal(b, values[1] + 1)


@gpu
@needs_cuda
def test_a_cuda_graph_over_sleeping_weights_reads_their_new_values():
    w = torch.randn(256, 256, device="cuda")
    mem = sleep.SleepableMemory([w])
    x = torch.randn(8, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up cuBLAS outside the capture
        x @ w.T
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x @ w.T
    for k in range(3):
        mem.sleep()
        junk = torch.full((mem.size // 4,), float("nan"), device="cuda")  # reuse the freed memory
        del junk
        mem.wake()
        new = torch.randn(256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(k))
        w.copy_(new)
        graph.replay()
        torch.testing.assert_close(y, x @ new.T)


@gpu
@needs_cuda
def test_a_wake_lowers_the_process_memory_cap_and_a_sleep_restores_it():
    total = torch.cuda.get_device_properties(0).total_memory
    w = torch.zeros(64 * 2**20 // 4, device="cuda")  # 64 MiB
    mem = sleep.SleepableMemory([w])
    mem.sleep()
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        mem.wake()
        assert abs(torch.cuda.get_per_process_memory_fraction(0) - (0.5 - mem.size / total)) < 1e-9
        mem.sleep()
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@gpu
@needs_cuda
def test_mapped_peak_counts_each_wake():
    w = torch.zeros(2**20, device="cuda")
    mem = sleep.SleepableMemory([w])
    mem.sleep()
    sleep.reset_mapped_peak()
    base = sleep.mapped_peak()  # other live memories only
    mem.wake()
    mem.sleep()
    assert sleep.mapped_peak() == base + mem.size
    sleep.reset_mapped_peak()
    assert sleep.mapped_peak() == base


@gpu
@needs_cuda
def test_every_mode_samples_what_a_resident_copy_samples_and_in_place_saves_the_copy():
    from logitless.rollout import SamplingOptions, make_engine
    from tests.test_rollout_budget_gpu import PROMPTS, TOK, model

    m = get_peft_model(model(), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    opts = SamplingOptions(num_generations=4, temperature=1.0, max_new_tokens=64, seed=3, ignore_eos=True)
    lora_b = [p for n, p in m.named_parameters() if "lora_B" in n]
    out, peaks = {}, {}
    for mode in ("resident", "sleep", "in_place"):
        with torch.no_grad():
            for k, p in enumerate(lora_b):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).mul_(2e-2).to(p))
        weights = MergedLoraWeights(m, mode)
        eng = make_engine("static", m, TOK, compile=True, weights=weights)
        batches = [eng.generate(PROMPTS, opts)]  # compiles
        if mode == "sleep":
            assert not weights.memory.awake  # freed when the rollout returned
        with torch.no_grad():  # an "update" between the rollouts
            for p in lora_b:
                p.mul_(-1.5)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sleep.reset_mapped_peak()
        batches.append(eng.generate(PROMPTS, opts))
        peaks[mode] = (torch.cuda.max_memory_allocated() - base + sleep.mapped_peak()) / 2**30
        out[mode] = batches
        copy_gib = sum(w.numel() * w.element_size() for _, w in weights._pairs) / 2**30
        del eng, weights
    for mode in ("sleep", "in_place"):
        for resident, other in zip(out["resident"], out[mode]):
            assert torch.equal(resident.completion_ids, other.completion_ids), mode
            assert torch.equal(resident.sampler_logp, other.sampler_logp), mode
    assert not torch.equal(out["resident"][0].completion_ids, out["resident"][1].completion_ids)  # update seen
    # the resident copy's memory is allocated before the measured call; sleep maps it during the call
    assert peaks["sleep"] >= peaks["resident"] + 0.95 * copy_gib, (peaks, copy_gib)
    assert peaks["in_place"] <= peaks["resident"] + 0.01, (peaks, copy_gib)


@gpu
@needs_cuda
def test_the_phase_clock_counts_mapped_memory_in_the_phase_that_mapped_it():
    from logitless.trainer.report.accounting import PhaseTimer

    timer = PhaseTimer(torch.device("cuda"))
    mem = sleep.SleepableMemory([torch.zeros(2**24, device="cuda")])  # 64 MiB
    mem.sleep()
    with timer("generate"):
        mem.wake()
        mem.sleep()
    with timer("train"):
        pass
    assert timer.peak_gb["generate"] - timer.peak_gb["train"] == pytest.approx(mem.size / 2**30, abs=1e-3)


@gpu
@needs_cuda
def test_a_sleeping_copy_trains_like_a_resident_one(tmp_path, tok, rewards_module):  # noqa: F811
    from logitless.trainer import train
    from tests.test_trainer import VOCAB, tiny_qwen2

    runs = {}
    for mode in ("resident", "sleep", "in_place"):
        cfg = _cfg(tmp_path / mode, "rollout.backend=static", "train.max_steps=2", f"rollout.weight_copy={mode}")
        runs[mode] = train(cfg, model=tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1).cuda(), tokenizer=tok).records
    for mode in ("sleep", "in_place"):
        for a, b in zip(runs["resident"], runs[mode]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), mode
            assert b["reward/mean"] == a["reward/mean"], mode


@gpu
@needs_cuda
def test_qlora_decodes_from_a_dequantized_merged_copy(tmp_path):
    pytest.importorskip("bitsandbytes")
    from logitless.rollout import SamplingOptions, make_engine
    from logitless.rollout.weights import in_place_refusal
    from logitless.trainer.placement.engines import weight_copy
    from logitless.trainer.config.schema import ModelConfig, RolloutConfig
    from logitless.trainer.policy.modeling import load_model, prepare_for_training
    from tests.test_rollout_budget_gpu import MAX_TOL, MEAN_TOL, PROMPTS, TOK, logp_diff, model

    model().save_pretrained(tmp_path / "m")
    cfg = ModelConfig(name_or_path=str(tmp_path / "m"), load_in_4bit=True, dtype="bfloat16", lora_r=16)
    m = prepare_for_training(load_model(cfg, torch.device("cuda")), cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 2e-2)
    why = in_place_refusal(m)
    assert "4-bit" in why
    assert weight_copy(RolloutConfig(backend="static"), torch.device("cuda"), has_copy=True, distributed=False,
                       in_place_why=why) == "sleep"  # the default for QLoRA on one GPU
    with pytest.raises(ValueError, match=r"weight_copy=in_place .*4-bit"):
        MergedLoraWeights(m, "in_place")
    weights = MergedLoraWeights(m, "sleep")
    assert weights.extra_bytes == sum(layer.get_base_layer().out_features * layer.get_base_layer().in_features * 2
                                      for _, layer in lora_layers(m))  # bf16 merged weights
    eng = make_engine("static", m, TOK, compile=True, weights=weights)
    b = eng.generate(PROMPTS, SamplingOptions(num_generations=4, temperature=1.0, max_new_tokens=64, seed=0,
                                              ignore_eos=True))
    d = logp_diff(m, b)  # the PEFT QLoRA model's own logprobs (4-bit matmuls, adapters unmerged)
    assert d.mean() < MEAN_TOL and d.max() < MAX_TOL, (float(d.mean()), float(d.max()))
    with m.disable_adapter():  # the check can fail: without the adapters the logprobs are far off
        assert logp_diff(m, b).mean() > 3 * MEAN_TOL
