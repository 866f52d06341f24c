"""The per-GPU memory model on N ranks (trainer/memory/ranks.py): its predictions against the recorded 1- and 2-GPU
runs, what shrinks with the rank count and what does not, and the unit sizes it reads off a model; the scaling
summary of bench/bench_fsdp.py (its runs themselves need torchrun: see its docstring)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import bench_fsdp
from logitless.trainer.memory import plan as mp
from logitless.trainer.memory import ranks as mr
from logitless.trainer.memory.auto import model_memory
from logitless.trainer.config.schema import load_train_config
from tests.conftest import tiny_qwen2

# The recorded runs allow this much: every checked phase of every 1- and 2-GPU run is within it (the largest miss,
# -2.9 %, is the 2-GPU update with parked states). A change of the model or of the plan it builds on that moves
# a prediction further fails here.
BOUND = 0.03
# The H100 runs (bench_fsdp.RECORDED_H100): the updates miss by -3.7 to -3.9 % (1.5B on 1 and 2 GPUs, 7B on 2:
# 0.4-1 GiB the model does not place); the 32B rollout's peak was the replica's sync with the shards beside it
# (-2.5 %), which park-sync removed: that phase is to re-measure (bench_fsdp.STALE).
BOUND_OTHER_SHAPES = 0.04


def test_predictions_match_the_recorded_one_and_two_gpu_runs():
    """Rollout and update peaks of every recorded 1- and 2-GPU run of today's layout (full fine-tuning with and
    without parked states, LoRA with 16-row and 32k-token micro-batches; 1.5B shape, H200) within BOUND, and the
    step's per-GPU peak ratio 2 GPUs / 1 GPU within 0.03 of the measured one (the records
    allow 0.024: 0.634 predicted against 0.657 measured with parked states)."""
    rows = bench_fsdp.check_recorded()
    h100 = {x[0] for x in bench_fsdp.RECORDED_H100}
    other = [r for r in rows if r["file"] in h100 and r["checked"]]
    checked = [r for r in rows if r["checked"] and r["file"] not in h100]
    assert len(checked) == 16 and {r["gpus"] for r in checked} == {1, 2} and len(other) == 9
    stale = [r for r in rows if r["file"] in h100 and not r["checked"]]  # reported, from before park-sync
    assert [(r["file"], r["phase"]) for r in stale] == list(bench_fsdp.STALE)
    bad = [(r["file"], r["variant"], r["gpus"], r["phase"], round(r["error"], 3)) for r in checked
           if abs(r["error"]) > BOUND]
    bad += [(r["file"], r["variant"], r["phase"], round(r["error"], 3)) for r in other
            if abs(r["error"]) > BOUND_OTHER_SHAPES]
    assert not bad, bad
    runs: dict[tuple[str, str], dict[int, list[dict]]] = {}
    for r in checked:
        runs.setdefault((r["file"], r["variant"]), {}).setdefault(r["gpus"], []).append(r)
    for key, by_gpus in runs.items():
        measured = [max(x["measured_gib"] for x in by_gpus[n]) for n in (1, 2)]
        predicted = [max(x["predicted_gib"] for x in by_gpus[n]) for n in (1, 2)]
        assert abs(predicted[1] / predicted[0] - measured[1] / measured[0]) <= 0.03, key


def _model(lora: bool, tie: bool, *over: str):
    """A small untied (or tied) Qwen2 of odd sizes: 3 layers, vocab 1,000, hidden 48."""
    model = tiny_qwen2(vocab_size=1000, hidden=48, layers=3, tie=tie).to(torch.bfloat16)
    cfg = load_train_config(None, [f"model.lora={str(lora).lower()}", "model.lora_r=4", *over])
    return model, model_memory(model, cfg.model, torch.bfloat16), cfg


@pytest.mark.parametrize("tie", [True, False])
def test_units_are_the_root_and_one_layer(tie):
    model, _, _ = _model(False, tie)
    u = mr.units_of(model)
    V, H = 1000, 48
    assert u.root_params == V * H * (1 if tie else 2) + H  # embeddings (and lm_head), final norm
    total = sum(p.numel() for p in model.parameters())
    assert u.root_params + 3 * u.layer_params == total


def test_one_rank_is_the_single_process_plan():
    _, m, _ = _model(True, False)
    step = mp.StepShape(prompts=6, rows=24, prompt_len=37, completion_len=50)
    facts, knobs = mp.RunFacts(backend="static"), mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True)
    assert mr.predict(m, step, facts, knobs, mr.Ranks(1)) == mp.predict(m, step, facts, knobs)


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("backend", ["static", "hf"])
def test_shards_shrink_with_the_ranks_and_the_working_set_does_not(lora, backend):
    """At N = 2, 3, 4, 8: the shards are 1/N of one process's (to the byte), the rank's KV cache is that of its
    largest share (6 prompts on 4 ranks: 2), the root unit and the whole decode weights stay; the peak falls."""
    model, m, _ = _model(lora, False)
    units = mr.units_of(model)
    step = mp.StepShape(prompts=6, rows=24, prompt_len=37, completion_len=50)
    facts = mp.RunFacts(backend=backend, logprob_pass=True, reference_copy=not lora)
    knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True)
    one = mp.predict(m, step, facts, knobs)
    peaks = []
    for n in (2, 3, 4, 8):
        ph = mr.predict(m, step, facts, knobs, mr.Ranks(n, units))
        gen, train = ph["generate"], ph["train"]
        assert gen[f"weights (1/{n})"] == one["generate"]["weights"] / n
        assert train[f"optimizer (1/{n})"] == one["train"]["optimizer"] / n
        assert train[f"gradients (1/{n})"] == one["train"]["gradients"] / n
        assert train.get("reference", 0.0) == (m.weight_bytes if not lora else 0.0)  # made before sharding: whole
        assert train["root unit (whole)"] == units.root_params * 2 == ph["logprobs"]["root unit (whole)"]
        share = -(-6 // n)
        assert gen["kv cache"] == mp.generate_bytes(m, dataclasses.replace(step, prompts=share, rows=4 * share),
                                                    facts, knobs)["kv cache"]
        whole = gen["replica (whole)"] if backend == "static" else gen["gathered weights (whole)"]
        assert whole >= m.weight_bytes
        peaks.append(mr.peak(ph))
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]  # (at this tiny size not below one
    # process's: the whole decode weights and the root unit outweigh what sharding saves)


def test_async_rollouts_keep_the_replica_and_the_rank_s_kv_cache_beside_the_update():
    """train.async_rollout on N ranks: the update's peak gains the rank's KV cache and sampler buffers (its share of
    the rows) and the whole replica stays mapped; the rollout's own phase is unchanged."""
    model, m, _ = _model(True, False)
    units = mr.units_of(model)
    step = mp.StepShape(prompts=6, rows=24, prompt_len=37, completion_len=50)
    knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True, max_kv_gib=0.001)
    sync_facts, async_facts = mp.RunFacts(backend="static"), mp.RunFacts(backend="static", async_rollout=True)
    for n in (2, 4):
        plain = mr.predict(m, step, sync_facts, knobs, mr.Ranks(n, units, weight_copy="resident"))
        both = mr.predict(m, step, async_facts, knobs, mr.Ranks(n, units, weight_copy="resident"))
        assert both["generate"] == plain["generate"]
        extra = {k: v for k, v in both["train"].items() if k not in plain["train"]}
        assert extra == {"rollout kv cache": plain["generate"]["kv cache"], "rollout sampler": plain["generate"]["sampler"]}
        assert both["train"]["replica (mapped)"] == m.weight_bytes and extra["rollout kv cache"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_the_rollout_s_sync_holds_the_replica_and_one_gathered_unit_beside_the_shards_unless_parked(tp):
    """The replica's sync at the rollout's start holds the whole (split) replica, one gathered FSDP unit (a decoder
    layer; a split replica's first fill gathers the root too, the largest) and a merged LoRA weight in fp32, beside
    the shards; train.offload_during_rollout parks the shards before it and lends back the gathered unit's alone.
    With a short rollout the sync is the rollout's peak; with a long one the parked decode's KV cache is."""
    model, m, _ = _model(True, False)
    units = mr.units_of(model)
    facts = mp.RunFacts(backend="static")
    ranks = mr.Ranks(4, units, tensor_parallel=tp)
    one = mp.resident_bytes(m, facts)
    layer = max(m.intermediate, m.q_dim) * m.hidden
    gathered = 2 * (max(units.root_params, units.layer_params) if tp > 1 else units.layer_params)
    peaks = {}
    for parked in (False, True):
        knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True, offload_during_rollout=parked)
        short = mr.predict(m, mp.StepShape(prompts=4, rows=4, prompt_len=5, completion_len=2), facts, knobs, ranks)
        gen = short["generate"]
        assert "kv cache" not in gen  # the sync, not the decode
        assert gen["weights (1/4)"] == (0.0 if parked else one["weights"] / 4) and one["weights"] > 0
        assert gen["replica (whole)" if tp == 1 else "replica (1/2)"] == m.weight_bytes / tp
        assert gen["sync: gathered"] == gathered
        assert gen.get("sync: lent shard", 0.0) == (gathered / 4 if parked else 0.0)
        assert gen["sync: fp32 merge"] == 3 * 4 * layer // tp
        peaks[parked] = sum(gen.values())
    assert peaks[True] < peaks[False]
    long = mr.predict(m, mp.StepShape(prompts=8, rows=64, prompt_len=5, completion_len=4096), facts, knobs, ranks)
    assert long["generate"]["weights (1/4)"] == 0.0 and long["generate"]["kv cache"] > 0  # the parked decode
    assert sum(long["generate"].values()) > peaks[True]


def test_full_fine_tuning_s_root_reduction_sets_the_peak_where_the_root_dominates():
    """An untied 500k vocabulary on 2 narrow layers (on the meta device) and one-row micro-batches of 16 tokens:
    the root's fp32 gradient reduction at the end of the backward (2 + 4 bytes per root parameter) is larger than
    the activation peak (LoRA never reduces the root). At the Qwen2.5 shapes it is not (2 bytes per root parameter
    more against the layers in flight, the root's parameters and the lm_head's workspace)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=500_000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    units = mr.units_of(model)
    assert units.root_params == 2 * 500_000 * 256 + 256
    step = mp.StepShape(prompts=8, rows=16, prompt_len=8, completion_len=8)
    knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=1, by_rows=True)
    for lora in (False, True):
        cfg = load_train_config(None, [f"model.lora={str(lora).lower()}", "model.lora_r=4"])
        m = model_memory(model, cfg.model, torch.bfloat16)
        train = mr.predict(m, step, mp.RunFacts(), knobs, mr.Ranks(8, units))["train"]
        assert ("root fp32 reduce-scatter input" in train) is not lora
        if not lora:
            assert train["root fp32 reduce-scatter input"] == 4 * units.root_params
            assert train["root gradient (whole)"] == 2 * units.root_params
    assert train["replica (mapped)"] == m.weight_bytes - m.merge_copy_bytes  # merged LoRA: its frozen rest stays


def test_more_than_one_rank_needs_the_unit_sizes():
    _, m, _ = _model(True, True)
    with pytest.raises(ValueError, match="Ranks.units"):
        mr.predict(m, mp.StepShape(prompts=2, rows=4, prompt_len=4, completion_len=4), mp.RunFacts(), mp.Knobs(),
                   mr.Ranks(2))


def test_predict_table_of_the_bench_runs_without_a_gpu(capsys):
    """`bench_fsdp.py --predict` at 1, 2, 4, 8 ranks (the 1.5B shape, no GPU): the per-GPU peak falls with every
    rank count, for full fine-tuning and LoRA, and each row is printed."""
    args = bench_fsdp.argparse.Namespace(shape="1.5b", backend="static", G=8, tokens=512, steps=2, prompts=64,
                                         micro=16, gc=True, scaling="strong", set=[], modes="full,lora",
                                         ranks=[1, 2, 4, 8], tokenizer=None, device_gib=139.8)
    table = bench_fsdp.predict_table(args)
    for mode in ("full", "lora"):
        peaks = [table[mode][n]["peak_gib"] for n in (1, 2, 4, 8)]
        assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    out = capsys.readouterr().out
    assert all(f"{mode:5s} strong {n} GPU" in out for mode in ("full", "lora") for n in (1, 2, 4, 8))


def _run(gpus: int, prompts: int, tok_s: float, generate_s: float, train_s: float, peak: float, predicted: float):
    """One rank count's result file of bench_fsdp.py (the fields --summarize reads), one mode."""
    mode = {"global_prompts": prompts, "median_step_s": generate_s + train_s, "completion_tokens_per_s": tok_s,
            "median_phase_s": {"time/generate": generate_s, "time/score": 0.01, "time/logprobs": 0.0,
                               "time/train": train_s},
            "peak_gib_per_gpu_max": peak, "peak_gib_per_phase": {"generate": peak, "train": peak / 2},
            "predicted": {"peak_gib": predicted, "phase_gib": {"generate": predicted, "train": predicted / 2}}}
    return {"info": {"device": "NVIDIA H100", "gpus": gpus}, "modes": {"lora": mode}}


@pytest.mark.parametrize("scaling", ["strong", "weak"])
def test_summary_sets_each_rank_count_against_one_gpu(tmp_path, scaling, capsys):
    """--summarize: tokens/s speedup and efficiency, the rollout's and the update's speedup in prompts per second
    (weak scaling: N prompts' worth per GPU), the per-GPU peak ratio and the prediction's error; 8 GPUs missing."""
    args = bench_fsdp.argparse.Namespace(out=str(tmp_path), shape="1.5b", backend="static", scaling=scaling, tag="")
    weak = scaling == "weak"
    runs = {1: _run(1, 16, 1000.0, 4.0, 10.0, 14.0, 14.5),
            2: _run(2, 32 if weak else 16, 1900.0, 2.5 if weak else 3.0, 10.5 if weak else 5.0, 10.0, 9.5),
            4: _run(4, 64 if weak else 16, 3500.0, 3.0 if weak else 2.0, 11.0 if weak else 2.5, 8.0, 8.4)}
    for n, run in runs.items():
        (tmp_path / bench_fsdp.result_name(args, n)).write_text(bench_fsdp.json.dumps(run))
    summary = bench_fsdp.summarize(args)
    rows = summary["modes"]["lora"]
    assert [r["gpus"] for r in rows] == [1, 2, 4]
    for r in rows:
        n, one, mine = r["gpus"], runs[1]["modes"]["lora"], runs[r["gpus"]]["modes"]["lora"]
        assert r["speedup"] == pytest.approx(mine["completion_tokens_per_s"] / 1000.0)
        assert r["efficiency"] == pytest.approx(r["speedup"] / n)
        share = (n if weak else 1)
        assert r["phase_speedup"]["generate"] == pytest.approx(share * 4.0 / mine["median_phase_s"]["time/generate"])
        assert r["phase_speedup"]["train"] == pytest.approx(share * 10.0 / mine["median_phase_s"]["time/train"])
        assert r["peak_ratio"] == pytest.approx(mine["peak_gib_per_gpu_max"] / one["peak_gib_per_gpu_max"])
        assert r["prediction_error"] == pytest.approx(mine["predicted"]["peak_gib"] / mine["peak_gib_per_gpu_max"] - 1)
    saved = bench_fsdp.json.loads((tmp_path / bench_fsdp.result_name(args, "summary")).read_text())
    assert saved["modes"] == bench_fsdp.json.loads(bench_fsdp.json.dumps(summary["modes"]))
    assert "4 GPU" in capsys.readouterr().out


def test_summary_leaves_out_runs_that_timed_only_their_first_step(tmp_path, capsys):
    """A run cut after its first step (which compiles) is no measurement: left out of the ratios; a 1-GPU one
    is refused."""
    args = bench_fsdp.argparse.Namespace(out=str(tmp_path), shape="1.5b", backend="static", scaling="strong", tag="")
    runs = {1: _run(1, 16, 1000.0, 4.0, 10.0, 14.0, 14.5), 2: _run(2, 16, 1900.0, 3.0, 5.0, 10.0, 9.5),
            4: _run(4, 16, 300.0, 52.0, 5.0, 8.0, 8.4)}
    runs[4]["modes"]["lora"]["first_step_only"] = True
    for n, run in runs.items():
        (tmp_path / bench_fsdp.result_name(args, n)).write_text(bench_fsdp.json.dumps(run))
    assert [r["gpus"] for r in bench_fsdp.summarize(args)["modes"]["lora"]] == [1, 2]
    assert "4 GPU  left out: only its first step was timed" in capsys.readouterr().out
    runs[1]["modes"]["lora"]["first_step_only"] = True
    (tmp_path / bench_fsdp.result_name(args, 1)).write_text(bench_fsdp.json.dumps(runs[1]))
    with pytest.raises(SystemExit, match="timed only its first step"):
        bench_fsdp.summarize(args)


def test_summary_needs_the_one_gpu_run(tmp_path):
    args = bench_fsdp.argparse.Namespace(out=str(tmp_path), shape="7b", backend="static", scaling="weak", tag="")
    (tmp_path / bench_fsdp.result_name(args, 2)).write_text(bench_fsdp.json.dumps(_run(2, 8, 1.0, 1.0, 1.0, 1.0, 1.0)))
    with pytest.raises(SystemExit, match="needs the 1-GPU run .*fsdp_7b_static_1gpu.json"):
        bench_fsdp.summarize(args)


def test_torchrun_runs_resolve_the_per_gpu_memory_of_their_rank_count():
    """Under torchrun (world_size > 1) `resolve` makes no plan but gives the memory model's phases for the run's
    own settings, saved in resolved.json; one that cannot fit names the settings that make it leaner."""
    from bench.bench_plan import skeleton
    from logitless.trainer.memory import auto

    model = skeleton("1.5b")
    over = ["rollout.max_completion_length=512", "rollout.max_prompt_length=200", "train.prompts_per_step=64",
            "rollout.backend=static", "model.gradient_checkpointing=true", "model.lora=false"]
    cfg = load_train_config(None, over)
    one = auto.resolve(cfg, device=torch.device("cuda"), skeleton=model, free_gib=80.0)
    assert one.rank_memory is None and one.plan is not None and one.to_json()["rank_memory"] is None
    res = auto.resolve(cfg, world_size=4, device=torch.device("cuda"), skeleton=model, free_gib=80.0)
    assert res.plan is None and res.ranks == 4 and res.rank_memory.fits
    m = model_memory(model, res.cfg.model, torch.bfloat16)
    step = mp.StepShape(prompts=64, rows=64 * 8, prompt_len=200, completion_len=512,
                        context=model.config.max_position_embeddings)
    kernels = auto.layer_kernels(res.cfg.model.compile_layers, res.cfg.model.liger_kernels)  # (Liger where installed)
    facts = auto.run_facts(res.cfg, "static", kernels, torch.device("cuda"))
    assert res.rank_memory.phases == mr.predict(m, step, facts, mp.knobs_of(res.cfg), mr.Ranks(4, mr.units_of(model)))
    saved = res.to_json()["rank_memory"]
    assert saved["ranks"] == 4 and saved["predicted_gib"]["train"] == res.rank_memory.peak("train") / mp.GIB
    tight = auto.resolve(load_train_config(None, [*over, "train.memory_budget_gib=4"]), world_size=4,
                         device=torch.device("cuda"), skeleton=model)
    assert not tight.rank_memory.fits
    note = next(n for n in tight.notes if n.startswith("memory model on 4 ranks: the train phase is predicted at "))
    assert "micro_batch_tokens" in note and "more ranks" in note
    assert "model.gradient_checkpointing" not in note and "offload_during_rollout" not in note  # (on; the rollout's)


def test_dry_run_on_ranks_prints_the_per_gpu_table_and_checks_the_rank_count(tmp_path, capsys):
    """`logitless train --dry-run --ranks N` (a model folder with its config.json only): the memory model's table for
    N ranks; a step with fewer prompts than ranks is refused as torchrun would, a split rollout on one process as
    its run would; --ranks without --dry-run is a usage error."""
    from transformers import Qwen2Config

    from bench.bench_plan import SHAPES
    from logitless.cli import main

    Qwen2Config(vocab_size=151_936, max_position_embeddings=32_768, **SHAPES["1.5b"]).save_pretrained(tmp_path)
    over = [f"model.name_or_path={tmp_path}", "model.device=cpu", "train.memory_budget_gib=24",
            "train.prompts_per_step=8", "rollout.max_prompt_length=256"]
    assert main(["train", "--dry-run", "--ranks", "4", *over]) == 0
    err = capsys.readouterr().err
    assert "memory model on 4 ranks: predicted peak per GPU and phase (GiB), budget 24.0" in err
    assert "memory plan: predicted" not in err and "root unit (whole)" in err
    assert main(["train", "--dry-run", "--ranks", "16", *over]) == 1
    assert "train.prompts_per_step=8 is the global prompt count of a step, split across the 16 ranks" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--ranks", "2", *over])
    assert "--ranks 2: give a rank count of at least 1, with --dry-run" in capsys.readouterr().err
    # one process refuses a split rollout as its run would
    assert main(["train", "--dry-run", *over, "rollout.tensor_parallel=2"]) == 1
    assert "rollout.tensor_parallel=2 splits the rollout over 2 ranks of torchrun" in capsys.readouterr().err


def test_a_result_file_takes_new_modes_and_never_loses_one(tmp_path):
    """One command per mode adds to the rank count's result file; a mode measured already, or a file of other
    settings, is refused with the way out, before anything runs."""
    path, shape = tmp_path / "fsdp_7b_static_strong_8gpu.json", {"G": 8, "max_completion_length": 512}
    assert bench_fsdp.earlier_result(path, shape, ["lora"]) is None
    path.write_text(bench_fsdp.json.dumps({"info": {}, "shape": shape, "modes": {"lora": {"median_step_s": 3.0}}}))
    assert bench_fsdp.earlier_result(path, shape, ["full"])["modes"]["lora"] == {"median_step_s": 3.0}
    with pytest.raises(SystemExit, match="already holds lora; pass --tag NAME or another --out"):
        bench_fsdp.earlier_result(path, shape, ["full", "lora"])
    with pytest.raises(SystemExit, match="measured with other settings"):
        bench_fsdp.earlier_result(path, {**shape, "G": 16}, ["full"])
