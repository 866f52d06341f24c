"""The tensor-parallel rollout on several processes (`tests/test_tensor_parallel.py`); each rank of a torchrun runs
this file.

    python -m torch.distributed.run --nproc-per-node N tests/tp_worker.py rollout OUT_DIR TP[,TP...] FAMILY[,...] [TOKENIZER_DIR]
    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py train OUT_DIR TOKENIZER_DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py gpu OUT_DIR TOKENIZER_DIR
    python -m torch.distributed.run --nproc-per-node N tests/tp_worker.py bf16 OUT_DIR TP[,TP...] SHAPE[,...] [plain]

"rollout": for each tensor-parallel size, family and weights (LoRA, full), every rank decodes its own prompts twice
(before and after an update of the sharded weights) through the group's split replica, and the same prompts on its
own with the whole model (the one-rank rollout, `rank_seed` as the trainer seeds it); it writes what the test
checks to OUT_DIR/rank{R}.json; for each size also the draw over the vocabulary split against the gathered rows
(`vocab`) and the split decode in bf16 (`bf16`, the tiny shape); on 2 ranks the split decode compiled
(`compiled`). "bf16": the split rollout in bf16 (`bf16`) for each size and shape of `BF16_SHAPES`, written to
OUT_DIR/bf16_rank{R}.json; "plain" measures torch's own RowwiseParallel (partial products rounded to bf16, summed in
bf16) in place of the replica's fp32 sum, for comparison. "train": two training
steps of `dist_worker`'s run with rollout.tensor_parallel=2 (`TRAIN`), its records written to
OUT_DIR/{mode}_ranks.json by rank 0; "rollout" given a TOKENIZER_DIR runs "train" after it, in the same
processes (one launch for both). "gpu": the split rollout in bf16 on 2 GPUs (nccl) against the one-GPU rollout
(`gpu`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers as tf  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from logitless.rollout import SamplingOptions, make_engine, step_graph  # noqa: E402
from logitless.rollout.weights import LiveWeights, MergedLoraWeights  # noqa: E402
from logitless.trainer.distributed.parallel import World, rank_seed, rank_share, shard_model  # noqa: E402
from logitless.trainer.placement.tensor_parallel import TensorParallelCopy, group_decode, local, local_bytes, tp_mesh  # noqa: E402
from tests.test_rollout_families import TOK  # noqa: E402

# 8 query heads, 4 KV heads, MLP width 64: split over 2 or 4 ranks; the byte vocabulary (258) splits unevenly over 4
SHAPE = dict(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=128, initializer_range=0.2, pad_token_id=TOK.pad_token_id,
             bos_token_id=None, eos_token_id=TOK.eos_token_id)
FAMILIES = {"llama": lambda: tf.LlamaConfig(**SHAPE), "qwen2": lambda: tf.Qwen2Config(**SHAPE),  # q/k/v biases
            "qwen3": lambda: tf.Qwen3Config(**SHAPE, head_dim=4)}
# prompts of different lengths (each rank's share is padded differently in the group's batch than alone), 7 of
# them: uneven shares (4 + 3 on 2 ranks, 2 + 2 + 2 + 1 on 4), so a group's parts differ in size
PROMPTS = ["The quick brown fox", "Hi", "2+2 is", "Once upon a time there", "abc", "Tensor parallel decode of",
           "Hello, world! How"]
OPTIONS = SamplingOptions(num_generations=3, temperature=0.9, max_new_tokens=9)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model(family: str, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager").eval()
    if lora:
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
        update(m, 1)
    return m


@torch.no_grad()
def update(m: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """The same change of the trainable weights on every rank (as an optimizer step would make): of the whole
    tensors, or of this rank's FSDP2 shards (row chunks) of them."""
    g = torch.Generator().manual_seed(seed)
    for name, p in m.named_parameters():
        if p.requires_grad:
            noise = torch.randn(p.shape, generator=g) * (0.1 if "lora_" in name else 0.03) * scale
            noise = noise.to(p.device, p.dtype)
            if hasattr(p, "to_local"):
                piece = torch.chunk(noise, dist.get_world_size(), dim=0)[dist.get_rank()]
                assert piece.shape == p.to_local().shape
                p.to_local().add_(piece)
            else:
                p.add_(noise)


def one_rank(m: torch.nn.Module, prompts: list[str], seed: int, lora: bool):
    """The rollout of `prompts` on this process alone, from the whole model."""
    weights = MergedLoraWeights(m, "resident") if lora else LiveWeights(m)
    engine = make_engine("static", m, TOK, check_every=4, weights=weights)
    return engine.generate(prompts, OPTIONS.__class__(**{**OPTIONS.__dict__, "seed": seed}))


def case(tp: int, family: str, lora: bool, world: World) -> dict:
    device = torch.device("cpu")
    mesh = tp_mesh(world.size, tp, device)
    mine = rank_share(PROMPTS, world)
    seed = rank_seed(1234, world)
    sharded = model(family, lora)
    replica = TensorParallelCopy(sharded, mesh, device)
    assert all(p.device.type == "meta" for p in replica.model.parameters())  # nothing allocated before sharding
    shard_model(sharded, device)
    replica.materialize()
    whole = model(family, lora)  # the same weights, unsharded (the oracle)
    engine = group_decode(make_engine("static", replica.model, TOK, check_every=4), replica)
    out: dict = {"bytes": local_bytes(replica.model), "whole_bytes": sum(p.numel() * p.element_size()
                                                                          for p in replica.model.parameters()),
                 "norm_bytes": sum(p.numel() * p.element_size() for n, p in replica.model.named_parameters()
                                   if "norm" in n), "rounds": []}
    before = None
    for r in range(2):
        if r == 0:
            replica.sync(sharded)
        else:  # the shards parked (train.offload_during_rollout), each unit's lent back for its part of the sync
            out["lent"] = parked_sync(replica, sharded)
        got = engine.generate(mine, OPTIONS.__class__(**{**OPTIONS.__dict__, "seed": seed}))
        want = one_rank(whole, mine, seed, lora)
        same_shape = (got.completion_ids.shape == want.completion_ids.shape
                      and got.prompt_ids.shape == want.prompt_ids.shape)
        out["rounds"].append({
            "same_shape": same_shape,
            "tokens_equal": same_shape and torch.equal(got.completion_ids, want.completion_ids)
            and torch.equal(got.completion_mask, want.completion_mask) and torch.equal(got.prompt_ids, want.prompt_ids),
            "logp_diff": float((got.sampler_logp - want.sampler_logp).abs().max()) if same_shape else float("inf"),
            "index_equal": torch.equal(got.prompt_index, want.prompt_index) and got.completions == want.completions,
            "tokens": int(got.completion_mask.sum()),
            # the update moved the policy: a replica that missed it would sample other logprobs
            "moved": None if before is None else float((one_rank_logp(whole, got, lora) - before).abs().max()),
        })
        before = one_rank_logp(whole, got, lora)
        update(sharded, 100 + r)
        update(whole, 100 + r)
    return out


def compiled(world: World) -> dict:
    """The split Llama (LoRA) decoding with the engine's compiled forward (aot_eager on CPU, the group's collectives
    inside the graph) against the one-rank rollout, and what dynamo made of the forward."""
    from torch._dynamo.utils import counters

    device = torch.device("cpu")
    mesh = tp_mesh(world.size, world.size, device)
    sharded, whole = model("llama", True), model("llama", True)
    replica = TensorParallelCopy(sharded, mesh, device)
    shard_model(sharded, device)
    replica.materialize()
    replica.sync(sharded)
    options = OPTIONS.__class__(**{**OPTIONS.__dict__, "seed": rank_seed(99, world)})
    mine = rank_share(PROMPTS, world)
    counters.clear()
    got = group_decode(make_engine("static", replica.model, TOK, check_every=4, compile=True),
                       replica).generate(mine, options)
    stats = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}
    want = one_rank(whole, mine, options.seed, True)
    return {"tokens_equal": torch.equal(got.completion_ids, want.completion_ids),
            "logp_diff": float((got.sampler_logp - want.sampler_logp).abs().max()), **stats}


class PromptDriver:
    """Episodes answered from each row's prompt and sample alone (so a group's drivers, each answering its own
    rows, and one rank's driver answering all of them answer a row alike): turn k of sample g of prompt p gets an
    observation of 2 + (len(p) + g + k) % 4 tokens spelled from p, and the episode ends after 1 + (len(p) + g) % 3
    turns; a turn ends at one of 20 of the byte ids or after 5 tokens. `fail`: respond() raises on that rank."""

    turn_end_ids, turn_stops, max_turn_tokens = list(range(40, 60)), [], 5

    def __init__(self, prompts: list[str], fail: bool = False):
        self.prompts, self.fail = prompts, fail

    def begin(self, num_rows: int, num_generations: int) -> None:
        self.G, self.count = num_generations, [0] * num_rows

    def respond(self, turns):
        if self.fail:
            raise KeyError("no such tool")
        out = []
        for te in turns:
            p, g = self.prompts[te.row // self.G], te.row % self.G
            k = self.count[te.row]
            self.count[te.row] += 1
            n = 2 + (len(p) + g + k) % 4
            out.append(None if k + 1 >= 1 + (len(p) + g) % 3 else [(ord(p[j % len(p)]) + k) % 250 for j in range(n)])
        return out

    def finish(self):
        from logitless.rollout.episodes import EpisodeRecord

        return [EpisodeRecord(turns=c) for c in self.count]


def episodes(tp: int, world: World) -> dict:
    """The group's episodes (each rank's driver answering its own rows, the replies gathered every turn) against
    the one-rank episodes of the same prompts, seed and driver on the whole model; also a call every rank of the
    group makes alike (decoded once: the group's first rank answers), and a driver that raises on each group's
    second rank."""
    device = torch.device("cpu")
    mesh = tp_mesh(world.size, tp, device)
    sharded, whole = model("llama", True), model("llama", True)
    replica = TensorParallelCopy(sharded, mesh, device)
    shard_model(sharded, device)
    replica.materialize()
    replica.sync(sharded)
    engine = group_decode(make_engine("static", replica.model, TOK, check_every=4), replica)
    options = SamplingOptions(num_generations=2, temperature=0.9, max_new_tokens=24, seed=rank_seed(5, world))
    out = {}
    for name, prompts, opts in (("own", rank_share(PROMPTS, world), options),
                                ("same_call", PROMPTS[:3], dataclasses.replace(options, seed=5))):
        got = engine.generate(prompts, opts, episodes=PromptDriver(prompts))
        want = one_rank_episodes(whole, prompts, opts)
        out[name] = {**same(got, want), "env_equal": got.env_mask.shape == want.env_mask.shape
                     and torch.equal(got.env_mask, want.env_mask),
                     "turns": [r.turns for r in got.episodes], "want_turns": [r.turns for r in want.episodes],
                     "env_tokens": int((got.env_mask * got.completion_mask).sum())}
    try:
        engine.generate(rank_share(PROMPTS, world), options,
                        episodes=PromptDriver(rank_share(PROMPTS, world), fail=world.rank % tp == 1))
        out["failed"] = ""
    except RuntimeError as e:
        out["failed"] = str(e)
    return out


def one_rank_episodes(m: torch.nn.Module, prompts: list[str], options: SamplingOptions):
    engine = make_engine("static", m, TOK, check_every=4, weights=MergedLoraWeights(m, "resident"))
    return engine.generate(prompts, options, episodes=PromptDriver(prompts))


def same(a, b) -> dict:
    """How two rollouts of the same rows compare: equal tokens, and the largest logprob difference."""
    shape = a.completion_ids.shape == b.completion_ids.shape
    return {"tokens_equal": shape and torch.equal(a.completion_ids, b.completion_ids)
            and torch.equal(a.completion_mask, b.completion_mask),
            "logp_diff": float((a.sampler_logp - b.sampler_logp).abs().max()) if shape else float("inf"),
            "tokens": int(a.completion_mask.sum())}


# the draws the vocabulary split is checked with: plain, greedy, hot, top-k (the whole rows gathered for the filter),
# and the step of the CUDA-graph decode (run eagerly on CPU)
VOCAB_CASES = {"sample": ({}, {}), "greedy": ({"temperature": 0.0}, {}), "hot": ({"temperature": 1.7}, {}),
               "top_k": ({"top_k": 20, "temperature": 0.8}, {}), "step_graph": ({}, {"step_graph": True})}


def vocab(tp: int, world: World) -> dict:
    """The split replica drawing over its own vocabulary columns (the default) against the same weights with the
    lm_head's logits gathered (`split_vocab=False`: the whole-row sampler) and against the one-rank rollout, for
    each of `VOCAB_CASES`; the width of the split logits."""
    device = torch.device("cpu")
    mesh = tp_mesh(world.size, tp, device)
    sharded, whole = model("llama", False), model("llama", False)
    split, gathered = (TensorParallelCopy(sharded, mesh, device, split_vocab=v) for v in (True, False))
    shard_model(sharded, device)
    for replica in (split, gathered):
        replica.materialize()
        replica.sync(sharded)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        out: dict = {"columns": [r.model(input_ids=ids).logits.shape[-1] for r in (split, gathered)],
                     "shard": dataclasses.astuple(split.vocab_shard())[:4], "gathered_shard": gathered.vocab_shard()}
    mine = rank_share(PROMPTS, world)
    for name, (change, engine_options) in VOCAB_CASES.items():
        options = SamplingOptions(**{**OPTIONS.__dict__, "seed": rank_seed(77, world), **change})
        a, b = (group_decode(make_engine("static", r.model, TOK, check_every=4, **engine_options), r)
                .generate(mine, options) for r in (split, gathered))
        c = make_engine("static", whole, TOK, check_every=4).generate(mine, options)
        out[name] = {"vs_gathered": same(a, b), "vs_one": same(a, c)}
    return out


def unseeded(world: World) -> str:
    """The error of a group's generate where one rank gives no seed (raised on every rank: none waits)."""
    device = torch.device("cpu")
    mesh = tp_mesh(world.size, world.size, device)
    sharded = model("llama", False)
    replica = TensorParallelCopy(sharded, mesh, device)
    shard_model(sharded, device)
    replica.materialize()
    replica.sync(sharded)
    engine = group_decode(make_engine("static", replica.model, TOK), replica)
    seed = None if world.rank == 1 else 3
    try:
        engine.generate(rank_share(PROMPTS, world), OPTIONS.__class__(**{**OPTIONS.__dict__, "seed": seed}))
    except ValueError as e:
        return str(e)
    return ""


# bf16: "tiny" is SHAPE (Qwen2: q/k/v biases); "wide" has real widths, where the partial sums' rounding shows
BF16_SHAPES = {"tiny": {}, "wide": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                        num_attention_heads=16, num_key_value_heads=4, initializer_range=0.05)}
BF16_OPTIONS = SamplingOptions(num_generations=3, temperature=1.0, max_new_tokens=16, ignore_eos=True)


def bf16(tp: int, shape: str, world: World) -> dict:
    """The split rollout of a bf16 Qwen2 of `shape` (full weights) against the one-rank rollout of the same rows:
    each sampler's gap to the trainer's logprobs (`completion_logprobs` of the whole model, bf16) on its own tokens
    (mean, max over the completion tokens), and where both drew the same tokens (each row's tokens before the first
    that differs), the gap between the two samplers' logprobs."""
    from logitless.models import completion_logprobs

    device = torch.device("cpu")
    mesh = tp_mesh(world.size, tp, device)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        config = tf.Qwen2Config(**{**SHAPE, **BF16_SHAPES[shape]})
        return tf.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()

    sharded, whole = build(), build()
    replica = TensorParallelCopy(sharded, mesh, device)
    shard_model(sharded, device)
    replica.materialize()
    replica.sync(sharded)
    mine = rank_share(PROMPTS, world)
    options = SamplingOptions(**{**BF16_OPTIONS.__dict__, "seed": rank_seed(21, world)})
    got = group_decode(make_engine("static", replica.model, TOK, check_every=4), replica).generate(mine, options)
    want = make_engine("static", whole, TOK, check_every=4).generate(mine, options)
    out = {}
    for name, b in (("split", got), ("one", want)):
        with torch.no_grad():
            trainer = completion_logprobs(whole, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                          temperature=options.temperature)[0].float()
        gap = (b.sampler_logp - trainer).abs()[b.completion_mask.bool()]
        out[name] = {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": int(gap.numel())}
    assert got.completion_ids.shape == want.completion_ids.shape  # (EOS ignored: every row decodes all tokens)
    differ = (got.completion_ids != want.completion_ids).cumsum(1) > 0  # from each row's first token that differs
    same = ~differ & want.completion_mask.bool()
    gap = (got.sampler_logp - want.sampler_logp).abs()[same]
    out["vs_one"] = {"mean": float(gap.mean()) if gap.numel() else 0.0,
                     "max": float(gap.max()) if gap.numel() else 0.0, "tokens": int(same.sum()),
                     "rows_equal": int((~differ.any(1)).sum()), "rows": int(differ.shape[0])}
    return out


def one_rank_logp(m: torch.nn.Module, b, lora: bool) -> torch.Tensor:
    from logitless.models import completion_logprobs

    with torch.no_grad():
        return completion_logprobs(m, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                   temperature=OPTIONS.temperature)[0].float()


# the run both sides train: 2 steps (the second samples from a replica synced after an optimizer step), LoRA (the
# merge per slice) or full fine-tuning, the static engine; the tiny Qwen2 of dist_worker ties its embeddings
# the LoRA run also evaluates after step 2 (5 held-out prompts in chunks of 2, 2 samples each: the group decodes each
# chunk once and counts it once)
EVAL = ["eval.every_steps=2", "eval.num_prompts=5", "eval.batch_size=2", "eval.pass_k=2",
        "data.eval_options={n: 10}"]
TRAIN = {"lora": ["train.max_steps=2", "rollout.backend=static", "checkpoint.save_steps=2", *EVAL],
         "full": ["train.max_steps=2", "rollout.backend=static", "checkpoint.save_steps=2", "model.lora=false",
                  "optim.learning_rate=0.002"],
         # the shards and optimizer states parked before the sync, each FSDP unit's lent back for its part of it
         "lora_parked": ["train.max_steps=2", "rollout.backend=static", "checkpoint.save_steps=2",
                         "train.offload_during_rollout=true"],
         # episodes: each rank's environments answer its own rows, the group gathers the replies every turn
         "agent": ["train.max_steps=2", "rollout.backend=static", "agent.environment=tests.agent_fixtures:Turns",
                   "agent.env_options={turns: 3}", "rollout.max_completion_length=24", "rollout.stop=[e]", *EVAL]}


def parked_sync(replica: TensorParallelCopy, sharded: torch.nn.Module) -> dict:
    """`replica.sync` with every shard of `sharded` parked: for each lent block, whether the shards resident are
    exactly those it was lent (one FSDP unit's), and whether all are parked again after the sync."""
    from contextlib import contextmanager

    from logitless.trainer.policy.offload import ParkedState

    params = list(sharded.parameters())
    resident = lambda: {id(p) for p in params if local(p).untyped_storage().nbytes() > 0}  # noqa: E731
    parked, blocks = ParkedState(), []
    parked.park(params)
    assert not resident()

    @contextmanager
    def lend(tensors):
        tensors = list(tensors)
        with parked.lend(tensors):
            blocks.append(resident() == {id(t) for t in tensors} and len(tensors) > 0)
            yield

    replica.sync(sharded, lend=lend)
    after = not resident()
    parked.unpark()
    return {"blocks": len(blocks), "only_the_unit": all(blocks), "parked_after": after}


def train(out_dir: str, tok_dir: str) -> None:
    from logitless.trainer.loop import train as run
    from tests import dist_worker as w

    torch.set_num_threads(1)
    tok = w.tokenizer(tok_dir)
    for mode, overrides in TRAIN.items():
        result = run(w.config(Path(out_dir) / f"{mode}_ranks", *overrides, "rollout.tensor_parallel=2"),
                     model=w.model(), tokenizer=tok)
        if int(os.environ["RANK"]) == 0:
            Path(out_dir, f"{mode}_ranks.json").write_text(json.dumps(w.untimed(result.records)))


# the GPU check: a Qwen2-shaped bf16 model of real widths (16 query and 4 KV heads of 64, the GPT-2 vocabulary, split
# unevenly), LoRA on every linear layer, every row decoding GPU_TOKENS tokens
GPU_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.02)
GPU_TOKENS = 96


def gpu(out_dir: str, tok_dir: str) -> None:
    """Each rank: the one-GPU rollout of its prompts (whole model, merged LoRA copy, the engine's CUDA defaults), its
    rows of the group's split rollout (its synced weights in sleepable memory, freed and written again between two
    calls, the second time with the shards parked in host memory and lent back a unit at a time), of the same split
    with the lm_head's logits gathered (the whole-row draw) and of the split with step_graph=true (its eager step
    captured); each sampler's gap to the trainer's logprobs on its own tokens, the decode tokens/s of the second
    call of each, how the draw over the vocabulary split compares with the gathered rows' draw and the captured step
    with the eager one. Writes OUT_DIR/gpu_rank{R}.json."""
    from logitless.models import completion_logprobs
    from tests import dist_worker as w

    cuda = torch.cuda.is_available()  # (off CUDA, in fp32 over gloo: a check of the script itself)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = World(rank=dist.get_rank(), size=dist.get_world_size())
    tok = w.tokenizer(tok_dir)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        config = tf.Qwen2Config(vocab_size=len(tok), **GPU_SHAPE, eos_token_id=tok.eos_token_id)
        m = tf.Qwen2ForCausalLM(config).to(device, torch.bfloat16 if cuda else torch.float32).eval()
        m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
        update(m, 1, scale=0.3)  # (before sharding: whole tensors)
        return m

    words = ["alpha", "beta", "gamma", "delta", "sum", "of", "the", "numbers", "is", "42", "+", "="]
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=g).tolist())
               for n in (12, 16, 20, 24, 9, 30, 14, 18)]
    mine = rank_share(prompts, world)
    options = SamplingOptions(num_generations=4, temperature=1.0, max_new_tokens=GPU_TOKENS, ignore_eos=True,
                              seed=rank_seed(7, world))
    whole, sharded = build(), build()
    mesh = tp_mesh(world.size, world.size, device)
    replica = TensorParallelCopy(sharded, mesh, device, sleep=cuda)  # (the trainer's default on CUDA)
    gathered = TensorParallelCopy(sharded, mesh, device, split_vocab=False)  # (the lm_head's logits gathered)
    shard_model(sharded, device)
    replica.materialize()
    gathered.materialize()
    split = group_decode(make_engine("static", replica.model, tok, step_graph=False), replica)  # the eager loop
    alone = make_engine("static", whole, tok, weights=MergedLoraWeights(whole, "resident"))
    out: dict = {"bytes": local_bytes(replica.model), "whole_bytes": sum(
        p.numel() * p.element_size() for n, p in whole.named_parameters() if "lora_" not in n)}
    batches = {}
    for name, engine, sync, release in (
            ("one_gpu", alone, lambda: None, lambda: None),
            ("split", split, lambda: replica.sync(sharded), replica.release),
            ("gathered", group_decode(make_engine("static", gathered.model, tok, step_graph=False), gathered),
             lambda: gathered.sync(sharded), lambda: None),
            ("split_graph", group_decode(make_engine("static", replica.model, tok), replica),  # (the default)
             lambda: replica.sync(sharded), replica.release)):
        resync = sync
        if name == "split":  # written again with the shards parked in host memory, a unit's lent back at a time
            resync = lambda: out.__setitem__("lent", parked_sync(replica, sharded))  # noqa: E731
        sync()
        step_graph._warned.clear()  # the capture warning is said once per reason and process: here, for this engine
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = engine.generate(mine, options)
        out[f"{name}_uncaptured"] = [str(w.message)[:300] for w in caught if "could not be captured" in str(w.message)]
        release()  # the replica's weights freed (sleep) and written again: the same samples after
        resync()
        again = engine.generate(mine, options)  # compiled and captured by now: the decode's own speed
        with torch.no_grad():
            trainer = completion_logprobs(whole, *(t.to(device) for t in (
                batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)),
                temperature=1.0)[0].float().cpu()
        mask = batch.completion_mask.bool()
        gap = (batch.sampler_logp - trainer).abs()[mask]
        out[name] = {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": int(mask.sum()),
                     "same_again": torch.equal(batch.completion_ids, again.completion_ids),
                     "tokens_per_s": again.timing.num_tokens / again.timing.generate_seconds}
        batches[name] = batch
    out["split_vs_gathered"] = same(batches["split"], batches["gathered"])  # the draw over the vocabulary split
    out["graph_vs_eager"] = same(batches["split_graph"], batches["split"])  # the eager step, captured
    Path(out_dir, f"gpu_rank{world.rank}.json").write_text(json.dumps(out))


def plain_rowwise() -> None:
    """Split the row-parallel layers with torch's own RowwiseParallel (bf16 partial products summed in bf16), as the
    replica did before it summed them in fp32: a measurement's "before"."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from logitless.trainer.placement import tensor_parallel as tp

    split = tp.style
    tp.style = lambda name: RowwiseParallel() if name == "rowwise" else split(name)


def main(kind: str, out_dir: str, *args: str) -> None:
    if kind in ("train", "gpu"):
        return {"train": train, "gpu": gpu}[kind](out_dir, *args)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = World(rank=dist.get_rank(), size=dist.get_world_size())
    if kind == "bf16":
        sizes, shapes, *how = args
        if how == ["plain"]:
            plain_rowwise()
        results = {f"tp{tp}-{shape}": bf16(int(tp), shape, world)
                   for tp in sizes.split(",") for shape in shapes.split(",")}
        Path(out_dir, f"bf16_rank{world.rank}.json").write_text(json.dumps(results))
        return
    sizes, families, *tok_dir = args
    results = {}
    for tp in map(int, sizes.split(",")):
        for family in families.split(","):
            for lora in (True, False):
                results[f"tp{tp}-{family}-{'lora' if lora else 'full'}"] = case(tp, family, lora, world)
        results[f"bf16-tp{tp}"] = bf16(tp, "tiny", world)
        results[f"vocab-tp{tp}"] = vocab(tp, world)
        results[f"episodes-tp{tp}"] = episodes(tp, world)
    results["compiled"] = compiled(world)  # (one group of the whole world)
    results["unseeded"] = unseeded(world)
    Path(out_dir, f"rank{world.rank}.json").write_text(json.dumps(results))
    if tok_dir:  # the training runs join the group made above
        train(out_dir, *tok_dir)


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Every rank is through and its files are written: leave without the interpreter's teardown of torch and the
    # process group (seconds per rank on a loaded 2-core runner), as tests/dist_worker.py does.
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
