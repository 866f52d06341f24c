"""The tensor-parallel rollout (rollout.tensor_parallel): on 4 CPU processes (gloo, fp32; one launch), in two
groups of 2 and in one group of 4, each rank's rows of its group's decode are the one-rank rollout's (tokens
equal, logprobs within 1e-5), before and after an update of the FSDP2 shards, for Llama, Qwen2 and Qwen3, LoRA and
full weights; the draw over each rank's vocabulary columns samples what the gathered rows sample; in bf16 the split
rollout is as close to the trainer's logprobs as the one-rank rollout (the row-parallel sums in fp32); each rank
holds 1/N of the decode weights; a run on 4 ranks with rollout.tensor_parallel=2 (two groups) trains like one
process; several calls' prompts decoded as one keep each call's samples; bad settings are refused naming the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from logitless.rollout import SamplingOptions, make_engine
from logitless.trainer.loop import train
from logitless.trainer.preflight import check_world
from logitless.trainer.distributed.parallel import World, rank_seed, rank_share
from logitless.trainer.placement.tensor_parallel import check_tensor_parallel, family_refusal, prompt_rows
from tests import tp_worker
from tests.test_parallel import close, torchrun, weights
from tests.test_rollout_families import TOK, make_model

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
WORKER = Path(tp_worker.__file__)
TOL = 1e-5
OWN_MEMORY = {"rollout/replica_gib", "rollout/weights_copy_gib"}  # the rollout weights each side keeps


def run_worker(out: Path, ranks: int, sizes: str, families: str, tok_dir: Path) -> tuple[Path, list[dict], dict]:
    """One launch on `ranks` ranks: the rollout cases (`tp_worker` "rollout"), then the training runs of
    `tp_worker.TRAIN` with rollout.tensor_parallel=2, after their one-process references (`single_runs`). Returns
    the folder, each rank's rollout results and the references' records per mode."""
    single = single_runs(out, ranks, tok_dir)
    argv = [str(WORKER), "rollout", str(out), sizes, families, str(tok_dir)]
    proc = torchrun("tp", out, None, timeout=900, ranks=ranks, argv=argv)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], single


@pytest.fixture(scope="module")
def tp4(tmp_path_factory, gpt2_tokenizer_dir, one_thread):
    """The one launch of the module: 4 ranks, groups of 2 and of 4 (a group of the whole world, as on 2 ranks of
    2, is the size-4 case), then the training runs (two groups of 2)."""
    return run_worker(tmp_path_factory.mktemp("tp4"), 4, "2,4", "llama,qwen2,qwen3", gpt2_tokenizer_dir)


@pytest.fixture(scope="module")
def four_ranks(tp4):
    return tp4[1]


def check_exact(ranks: list[dict], case: str) -> None:
    for r, results in enumerate(ranks):
        rounds = results[case]["rounds"]
        for k, x in enumerate(rounds):
            where = f"{case} rank {r} round {k}"
            assert x["same_shape"] and x["tokens_equal"] and x["index_equal"], where
            assert x["logp_diff"] <= TOL, (where, x["logp_diff"])
            assert x["tokens"] > 0, where
        assert rounds[1]["moved"] > 0.1  # the update moved the policy: a stale replica would not match
        # round 2 synced with the shards parked: one unit's lent at a time, then parked again; the 2 layer units
        # (LoRA: the root's frozen weights are written by the first sync only), and the root's (full)
        lent = results[case]["lent"]
        assert lent["blocks"] == (2 if case.endswith("lora") else 3) and lent["only_the_unit"] and lent["parked_after"]


def check_bytes(ranks: list[dict], case: str, n: int) -> None:
    """Each rank holds its slices: the group's slices add up to the whole weights once (the norms, replicated,
    aside), none more than a 1/n share rounded up by one vocabulary row per split tensor."""
    whole, norms = ranks[0][case]["whole_bytes"], ranks[0][case]["norm_bytes"]
    for g in range(len(ranks) // n):
        group = [ranks[g * n + i][case]["bytes"] - norms for i in range(n)]
        assert sum(group) == whole - norms, (case, group)
        assert max(group) <= (whole - norms) / n + 2 * 32 * 4 * 2, (case, group)  # 2 vocab tensors x H x fp32


def test_the_compiled_decode_of_a_split_replica_is_one_graph_and_samples_the_same(four_ranks):
    """The engine's compiled forward (aot_eager on CPU, `tests/conftest.py`; inductor on a GPU) traces the split
    model, its collectives included, as one graph without a break (what the CUDA-graph decode step captures on a
    GPU), and samples what the one-rank rollout samples."""
    for r, results in enumerate(four_ranks):
        x = results["compiled"]
        assert x["graphs"] == 1 and x["breaks"] == 0, (r, x)
        assert x["tokens_equal"] and x["logp_diff"] <= TOL, (r, x)


def test_a_rank_without_a_seed_is_refused_on_every_rank_of_its_group(four_ranks):
    """The ranks of a group draw from their seeds' streams: a rank without a seed makes every rank of the group
    raise (none is left waiting in the decode's collectives)."""
    for results in four_ranks:
        assert "each must give its rollout a seed (SamplingOptions.seed)" in results["unseeded"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("weights", ["lora", "full"])
def test_four_ranks_sample_what_one_rank_samples(four_ranks, tp, family, weights):
    case = f"tp{tp}-{family}-{weights}"
    check_exact(four_ranks, case)
    check_bytes(four_ranks, case, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_draw_over_each_ranks_vocabulary_columns_samples_what_the_gathered_rows_sample(four_ranks, tp):
    """The lm_head's logits stay split by vocabulary rows (each rank its own columns; the byte vocabulary of 258
    tokens in 65 + 65 + 65 + 63 over 4), and the draw that reduces over the group draws the tokens of the gathered
    rows' draw and of the one-rank rollout, logprobs within 1e-5: sampling, greedy, hot, top-k (the rows gathered
    for the filter) and the CUDA-graph decode's step (eager on CPU)."""
    for r, x in enumerate(four_ranks):
        x = x[f"vocab-tp{tp}"]
        chunk = -(-258 // tp)
        start = (r % tp) * chunk
        assert x["columns"] == [min(chunk, 258 - start), 258] and x["gathered_shard"] is None, x["columns"]
        assert x["shard"] == [start, min(chunk, 258 - start), 258, tp], x["shard"]
        for case in tp_worker.VOCAB_CASES:
            for other in ("vs_gathered", "vs_one"):
                y = x[case][other]
                assert y["tokens_equal"] and y["logp_diff"] <= TOL and y["tokens"] > 0, (r, case, other, y)


@pytest.mark.parametrize("tp", [2, 4])
def test_episodes_of_a_split_rollout_are_the_one_rank_episodes(four_ranks, tp):
    """Multi-turn episodes through the group: each rank's driver answers its own rows, the replies are gathered
    every turn, and each rank gets the episodes its own call on one rank gives (tokens, observations, turns; logprobs
    within 1e-5); a call every rank makes alike is decoded once; a driver that raises on one rank is named on every
    rank of the group (none waits in a collective)."""
    for r, x in enumerate(four_ranks):
        x = x[f"episodes-tp{tp}"]
        for name in ("own", "same_call"):
            y = x[name]
            assert y["tokens_equal"] and y["env_equal"] and y["logp_diff"] <= TOL, (r, name, y)
            assert y["turns"] == y["want_turns"] and max(y["turns"]) >= 2 and y["env_tokens"] > 0, (r, name, y)
        assert "the episode driver of rank 1 of the tensor-parallel group failed in respond(): KeyError" in x["failed"]


def group_gap(ranks: list[dict], case: str, side: str) -> float:
    """The mean gap of `side` over every rank's tokens (each rank's mean weighted by its tokens)."""
    xs = [r[case][side] for r in ranks]
    return sum(x["mean"] * x["tokens"] for x in xs) / sum(x["tokens"] for x in xs)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_split_rollout_in_bf16_is_as_close_to_the_trainer_as_one_rank(four_ranks, tp):
    """bf16 on CPU: the split rollout's logprobs are as close to the trainer's (on its own tokens) as the one-rank
    rollout's are (on its own), within 1.5x of that gap measured in the same run on the same model (the group's
    mean); where both drew the same tokens, the two samplers differ by less than the one-rank sampler from the
    trainer. The row-parallel layers' partial products summed in bf16 were 3.2x (2 ranks) and 3.6x (4) of the
    one-rank gap, and the two samplers 3x apart; summed in fp32 (`tp_styles.RowwiseFp32Sum`), 1.2x and 0.5x."""
    results, case = four_ranks, f"bf16-tp{tp}"
    one, split = group_gap(results, case, "one"), group_gap(results, case, "split")
    assert 0 < one < 0.02, one  # bf16 rounding, not a broken reference
    assert split <= 1.5 * one, (split, one)
    assert group_gap(results, case, "vs_one") <= one, (group_gap(results, case, "vs_one"), one)
    assert sum(r[case]["vs_one"]["tokens"] for r in results) > 100  # most rows drew the same tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_partial_product_on_cuda_keeps_the_fp32_sum_of_its_bf16_inputs():
    """`partial_product` on CUDA (a bf16 GEMM with an fp32 output), eager and compiled: the fp32 product of the bf16
    inputs, within fp32 accumulation (a bf16 output would be 2**-9 off)."""
    from logitless.trainer.placement.tp_styles import partial_product

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 5, 1536, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1000, 1536, device="cuda", generator=g).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.double(), w.double())
    for fn in (partial_product, torch.compile(partial_product)):
        got = fn(x, w)
        assert got.dtype == torch.float32 and got.shape == (3, 5, 1000)
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


OPTS = SamplingOptions(num_generations=2, temperature=0.8, max_new_tokens=8, seed=5)


def test_prompts_of_several_calls_decoded_as_one_keep_each_calls_samples(one_thread):
    """SamplingOptions.streams: the union's rows are each call's own, the same tokens (logprobs to fp32 rounding:
    the batch pads the prompts otherwise); `prompt_rows` takes a call's rows back, with that call's padding."""
    model = make_model("llama")
    engine = make_engine("static", model, TOK, check_every=4)
    parts = [(["The quick brown fox", "Hi"], 11), (["2+2 is a longer prompt than the others"], 12), (["x", "ab"], 11)]
    union = engine.generate([p for ps, _ in parts for p in ps], SamplingOptions(
        **{**OPTS.__dict__, "streams": [(seed, len(ps)) for ps, seed in parts]}))
    start = 0
    for prompts, seed in parts:
        alone = engine.generate(prompts, SamplingOptions(**{**OPTS.__dict__, "seed": seed}))
        got = prompt_rows(union, start, len(prompts), OPTS.num_generations)
        for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "prompt_index", "finished",
                  "truncated"):
            assert torch.equal(getattr(got, f), getattr(alone, f)), f
        torch.testing.assert_close(got.sampler_logp, alone.sampler_logp, atol=TOL, rtol=0)  # other padding: rounding
        assert got.completions == alone.completions and got.timing.num_tokens == alone.timing.num_tokens
        start += len(prompts)
    # the streams matter: the second call's prompt with the first call's seed samples otherwise
    other = engine.generate(parts[1][0], SamplingOptions(**{**OPTS.__dict__, "seed": 11}))
    assert not torch.equal(other.completion_ids, prompt_rows(union, 2, 1, 2).completion_ids)
    with pytest.raises(ValueError, match=r"streams=.* count 4 prompts, but the call has 5"):
        engine.generate([p for ps, _ in parts for p in ps], SamplingOptions(**{**OPTS.__dict__, "streams": [(1, 4)]}))
    with pytest.raises(ValueError, match="SamplingOptions.streams .* use rollout.backend=static"):
        make_engine("hf", model, TOK).generate(["Hi"], SamplingOptions(**{**OPTS.__dict__, "streams": [(1, 1)]}))


class RankStreams:
    """The one-process reference of a 2-rank run's rollout: each rank's half of the step's prompts drawn from that
    rank's random streams (`rank_seed`, prompt indices counted in its half), as that rank's own rollout draws them."""

    def __init__(self, engine, ranks: int):
        self.engine, self.ranks = engine, ranks

    def __getattr__(self, name):
        return getattr(self.__dict__["engine"], name)

    def generate(self, prompts, options, episodes=None):
        if options.num_generations != 4:  # the eval's call (eval.pass_k=2): each rank of a group makes the same one
            return self.engine.generate(prompts, options, episodes=episodes)
        worlds = [World(rank=r, size=self.ranks) for r in range(self.ranks)]
        streams = [(rank_seed(options.seed, w), len(rank_share(prompts, w))) for w in worlds]
        return self.engine.generate(prompts, dataclasses.replace(options, streams=streams), episodes=episodes)


def single_runs(out: Path, ranks: int, tok_dir: Path) -> dict[str, list[dict]]:
    """The runs of `tp_worker.TRAIN` on one process, each rank's share of the rollout drawn from that rank's streams
    (`RankStreams`), in `out`/{mode}_single; their records per mode."""
    from tests import dist_worker as w

    single = {}
    for mode, overrides in tp_worker.TRAIN.items():
        real = w.placement.make_rollout_engine
        w.use_engine(lambda engine: RankStreams(engine, ranks))
        try:
            single[mode] = train(w.config(out / f"{mode}_single", *overrides), model=w.model(),
                                 tokenizer=w.tokenizer(tok_dir)).records
        finally:
            w.placement.make_rollout_engine = real
    return single


@pytest.fixture(scope="module")
def training(tp4):
    """The folder and one-process records of the run of `tp_worker.TRAIN` on 4 ranks with rollout.tensor_parallel=2
    (two groups: the eval's rows split over them), from the module's launch (`run_worker`)."""
    out, _, single = tp4
    return out, single


@pytest.mark.parametrize("mode", list(tp_worker.TRAIN))
def test_ranks_with_a_split_rollout_train_like_one_process(training, mode):
    """Two steps (LoRA, full, LoRA with multi-turn episodes): the rollouts (sampled on each rank's group, from a
    replica synced from the shards after the first optimizer step), the metrics (the eval's too) and the weights
    are those of one process."""
    from tests import dist_worker as w

    out, single = training
    a, b = weights(out / f"{mode}_single"), weights(out / f"{mode}_ranks")
    assert a.keys() == b.keys() and a
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    one, ranks = w.untimed(single[mode]), json.loads((out / f"{mode}_ranks.json").read_text())
    assert [r["step"] for r in ranks] == [1, 2] and len(one) == 2
    for x, y in zip(one, ranks):
        assert x.keys() - OWN_MEMORY == y.keys() - OWN_MEMORY
        diff = {k: (x[k], y[k]) for k in x.keys() - OWN_MEMORY if not close(x[k], y[k], rel=1e-5, abs_=1e-5)}
        assert not diff
        assert y["completion/length_mean"] > 1 and y["reward/std"] > 0 and y["grad_norm"] > 0
        assert y["rollout/mismatch_max"] < 1e-5  # the sampler's logprobs are the trainer's (fp32)
        if mode == "agent":  # several turns, observations from every rank's environments
            assert y["episode/turns_mean"] > 1.5 and y["tokens/env_mean"] > 3, y
    if mode in ("lora", "agent"):  # the eval after step 2 (compared above): each chunk decoded once by the group
        assert ranks[1]["eval/completion_length"] > 1 and "eval/pass@2" in ranks[1]
        whole = sum(p.numel() * p.element_size() for p in w.model().parameters()) / 2**30  # tied embedding once
        assert 0.45 * whole < y["rollout/replica_gib"] < 0.55 * whole  # this rank's half of the decode weights


def _cfg(*overrides):
    from tests import dist_worker as w

    return w.config("unused", *overrides)


@pytest.mark.parametrize(
    "overrides, size, match",
    [
        (["rollout.tensor_parallel=2", "rollout.backend=static"], 1,
         r"rollout.tensor_parallel=2 splits the rollout over 2 ranks of torchrun; launch with torchrun "
         r"--nproc-per-node 2"),
        (["rollout.tensor_parallel=4", "rollout.backend=static"], 6,
         r"rollout.tensor_parallel=4 must divide the number of ranks \(6\): set it to one of 1, 2, 3, 6"),
        (["rollout.tensor_parallel=2", "rollout.backend=static", "rollout.merge_lora=false"], 2,
         r"rollout.merge_lora=false is not supported with rollout.tensor_parallel=2"),
        (["rollout.tensor_parallel=2", "rollout.backend=static", "rollout.fuse_projections=true"], 2,
         r"rollout.fuse_projections=true is not supported with rollout.tensor_parallel=2"),
        (["rollout.tensor_parallel=2", "rollout.backend=static", "train.fsdp_offload=true"], 2,
         r"train.fsdp_offload=true is not supported with rollout.tensor_parallel=2 yet; set train.fsdp_offload=false"),
        (["rollout.tensor_parallel=2", "rollout.backend=static", "rollout.weight_copy=in_place"], 2,
         r"rollout.weight_copy=in_place is not supported .* set rollout.weight_copy=sleep or resident"),
    ],
)
def test_settings_the_split_rollout_cannot_run_are_refused(overrides, size, match):
    with pytest.raises(ValueError, match=match):
        check_world(_cfg(*overrides, "train.prompts_per_step=12"), World(rank=0, size=size))


def test_the_hf_backend_and_a_split_of_zero_are_refused_in_the_config():
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel=2 needs rollout.backend=static \(got 'hf'\)"):
        _cfg("rollout.tensor_parallel=2", "rollout.backend=hf")
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel must be > 0, got 0"):
        _cfg("rollout.tensor_parallel=0")
    check_tensor_parallel(_cfg("rollout.backend=hf"), 2)  # 1: nothing to split
    from logitless.trainer.memory.auto import rollout_backend

    backend, why = rollout_backend(_cfg("rollout.tensor_parallel=2"), torch.device("cpu"), None)
    assert backend == "static" and "rollout.tensor_parallel" in why  # backend auto: the engine that splits


def test_models_the_split_cannot_run_are_refused_naming_the_key():
    import transformers as tf

    from tests.test_rollout_families import FAMILIES

    for family in ("llama", "qwen2", "qwen3", "mistral"):
        assert family_refusal(FAMILIES[family][0](), 2) is None
    heads = family_refusal(FAMILIES["llama"][0](), 4)  # 4 query heads but 2 KV heads
    assert heads is not None and "num_key_value_heads=2" in heads and "set rollout.tensor_parallel to one" in heads
    assert "(at most 4: 1, 2)" in heads
    other = family_refusal(FAMILIES["gemma"][0](), 2)
    assert other is not None and "model_type 'gemma'" in other and "set rollout.tensor_parallel=1" in other
    mlp = family_refusal(tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=4, intermediate_size=66,
                                        hidden_size=32), 4)
    assert mlp is not None and "intermediate_size=66" in mlp


def test_the_model_check_before_loading_refuses_a_split_the_model_cannot_take():
    """preflight's model check (the config and a meta skeleton, no weights) names the key and the sizes that work."""
    from logitless.trainer.checks.model import check_model
    from tests.test_rollout_families import FAMILIES

    config = FAMILIES["llama"][0]()  # 4 query heads, 2 KV heads
    lines = check_model(_cfg("rollout.tensor_parallel=2", "rollout.backend=static"), config)
    assert "rollout.tensor_parallel=2: its heads and MLP width split over 2 ranks" in lines
    refusal = r"rollout.tensor_parallel=4: the model.s num_key_value_heads=2 .* \(at most 4: 1, 2\)"
    with pytest.raises(ValueError, match=refusal):
        check_model(_cfg("rollout.tensor_parallel=4", "rollout.backend=static"), config)


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_split_rollout_samples_the_trainers_policy_like_one_gpu(tmp_path, gpt2_tokenizer_dir):
    """bf16 on 2 GPUs (nccl; the split decode eager, the one-GPU one compiled with its CUDA-graph step): each rank's
    split rollout is as close to the trainer's logprobs on its own tokens as the one-GPU rollout is on its (1.5x the
    mean gap, 2x the max, measured in the same run on the same weights), and a second call, after the replica's
    sleeping weights were freed and written again (with the shards parked, each unit's lent back), samples the same
    tokens; the draw over each GPU's vocabulary
    columns (with the Triton kernel) samples the tokens of the same split with the logits gathered; with
    rollout.step_graph unset (the default) the eager split step is captured and samples what the eager loop
    (rollout.step_graph=false) samples."""
    from bench import gpu_exactness as G

    argv = [str(WORKER), "gpu", str(tmp_path), str(gpt2_tokenizer_dir)]
    proc = torchrun("tp_gpu", tmp_path, None, timeout=900, argv=argv)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for rank in (0, 1):
        x = json.loads((tmp_path / f"gpu_rank{rank}.json").read_text())
        one, split = x["one_gpu"], x["split"]
        print(f"rank {rank}: one GPU {one}, split {split}, gathered {x['gathered']}")  # tokens/s of each
        assert one["tokens"] == split["tokens"] == 4 * 4 * tp_worker.GPU_TOKENS  # 4 prompts x 4 samples, EOS ignored
        assert one["mean"] < 0.03, one  # the reference is at bf16 noise, so the bound is not vacuous
        assert split["mean"] <= G.BOUND_MEAN * one["mean"] and split["max"] <= G.BOUND_MAX * one["max"], (one, split)
        assert one["same_again"] and split["same_again"]  # (the split's second sync with the shards parked:)
        lent = x["lent"]  # one unit's shards on the GPU at a time (4 layers; the root's frozen: written once)
        assert lent["blocks"] == 4 and lent["only_the_unit"] and lent["parked_after"], lent
        same = x["split_vs_gathered"]  # the draw over each GPU's vocabulary columns: the gathered rows' tokens
        assert same["tokens_equal"] and same["logp_diff"] <= TOL, same
        # rollout.step_graph unset: the eager split step captured as one CUDA graph (NCCL collectives inside) draws
        # what the eager loop draws
        assert not x["split_graph_uncaptured"], x["split_graph_uncaptured"]
        graph = x["graph_vs_eager"]
        assert graph["tokens_equal"] and graph["logp_diff"] <= TOL and x["split_graph"]["same_again"], graph
        assert x["bytes"] < 0.55 * x["whole_bytes"]  # this rank's half of the decode weights


def test_the_memory_model_counts_a_split_replica_per_rank():
    """The per-rank memory model (`memory_ranks`, what a torchrun run predicts per GPU) on 4 ranks with
    rollout.tensor_parallel=2: half the replica on each rank; the KV cache of the group's rows (twice the rank's)
    at half the KV heads, the same bytes; the sampler's buffers of the group's rows over half the vocabulary, the
    same bytes; the update's working set with half the replica mapped, the rest of it unchanged."""
    from logitless.trainer.memory import plan as mp
    from logitless.trainer.memory import ranks as mr
    from logitless.trainer.memory.auto import model_memory
    from logitless.trainer.config.schema import load_train_config
    from tests.conftest import tiny_qwen2

    model = tiny_qwen2(vocab_size=1000, hidden=64, layers=3, tie=False).to(torch.bfloat16)  # 4 heads, 2 KV heads
    m = model_memory(model, load_train_config(None, ["model.lora_r=4"]).model, torch.bfloat16)
    step = mp.StepShape(prompts=8, rows=32, prompt_len=37, completion_len=50)
    facts = mp.RunFacts(backend="static")
    knobs = mp.Knobs(gradient_checkpointing=True, micro_batch_size=3, by_rows=True)
    units = mr.units_of(model)
    for copy in ("resident", "sleep"):
        whole = mr.predict(m, step, facts, knobs, mr.Ranks(4, units, weight_copy=copy))
        split = mr.predict(m, step, facts, knobs, mr.Ranks(4, units, weight_copy=copy, tensor_parallel=2))
        g, h = whole["generate"], split["generate"]
        assert h["replica (1/2)"] == g["replica (whole)"] / 2 > 0
        assert h["kv cache"] == g["kv cache"] > 0 and h["sampler"] == g["sampler"] > 0
        assert split["train"]["replica (mapped)"] == whole["train"]["replica (mapped)"] / 2
        rest = lambda parts: {k: v for k, v in parts.items() if k != "replica (mapped)"}  # noqa: E731
        assert rest(split["train"]) == rest(whole["train"])
    assert mr.decode_step(step, mr.Ranks(4, units, tensor_parallel=2)).rows == 16  # the group's rows
