"""Training runs for the multi-process tests (`tests/test_parallel.py`); each rank of a torchrun runs this file.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_worker.py SCENARIO OUT_DIR TOKENIZER_DIR
    python -m torch.distributed.run --nproc-per-node 4 tests/dist_worker.py equivalence4 OUT_DIR TOKENIZER_DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/dist_worker.py equivalence,equivalence_moe,resume,async \\
        OUT_DIR TOKENIZER_DIR

Scenarios: "equivalence" (one step, LoRA and full fine-tuning, on a recorded rollout; `MODES`; on GPUs
"equivalence_liger", `LIGER_MODES`), "equivalence_moe" (the same for a mixture of experts replaying its recorded
routes; `MOE_MODES`), "equivalence4"
(the same on 4 ranks with uneven prompt shares; `FOUR_RANK_MODES`), "resume" (a run, the same run stopped by
SIGTERM and resumed; then a run on the static backend), "async" (train.async_rollout: a run, the same stopped
and resumed, and full fine-tuning), "stuck_rank" and "dead_rank" (a rank that hangs or dies after its rollout).
Scenarios joined by commas run one after the other in one launch (their files do not collide). `raise_on_rank1` is
a reward function for the failure test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitless.rollout import RolloutBatch  # noqa: E402
from logitless.rollout.episodes import EpisodeRecord  # noqa: E402
from logitless.rollout.types import RolloutTiming  # noqa: E402
from logitless.trainer import loop  # noqa: E402
from logitless.trainer.placement import placement  # noqa: E402
from logitless.trainer.policy import offload  # noqa: E402
from logitless.trainer.config.schema import load_train_config  # noqa: E402
from logitless.trainer.loop import train  # noqa: E402
from tests.conftest import TINY_LORA_QUIET, tiny_qwen2  # noqa: E402
from tests.episode_driver import ScriptedDriver  # noqa: E402

VOCAB = 50_257  # GPT-2 tokenizer
# metrics that depend on the clock; train/tflop (a FLOP count) stays and must match across world sizes
TIMING = ("time/", "tokens_per_s", "train_tokens_per_s", "memory/", "rollout/ceiling_fraction", "train/mfu",
          "train/tflops_per_s", "step/")  # step/: the step against its limit per GPU (seconds, the world's share)


def config(run_dir, *overrides):
    base = [
        f"train.output_dir={run_dir}",
        "train.max_steps=1",
        "train.prompts_per_step=4",
        "train.micro_batch_size=3",  # 16 rows: 6 micro-batches on one process, 3 on each of 2 ranks
        "rollout.num_generations=4",
        "rollout.max_completion_length=6",
        "data.options={difficulty: 1, n: 40, chat: false}",
        "reward.reward_funcs=[numeric_answer, tests.dist_worker:digits]",
        "optim.learning_rate=0.05",
        "optim.max_grad_norm=0.05",  # clipping active: the DTensor gradient norm is checked too
        # Adam's first step is lr * g / (|g| + eps): with eps = 1e-8 a gradient entry near 1e-8 turns a rounding
        # difference of the summation order (1 vs 2 ranks) into a visible one; 1e-3 keeps the step smooth in g
        "optim.adam_epsilon=1e-3",
        *TINY_LORA_QUIET,
        "checkpoint.save_steps=1",
        "checkpoint.save_total_limit=null",
        "logging.peak_tflops=1",  # device peaks given, so the efficiency metrics are logged on CPU too
        "logging.hbm_tbs=1",
    ]
    return load_train_config(None, base + list(overrides))


def tokenizer(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def device() -> torch.device:
    """CPU (gloo), or this rank's GPU (nccl) when LOGITLESS_TEST_CUDA=1."""
    if os.environ.get("LOGITLESS_TEST_CUDA") == "1":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def model(mode: str = ""):
    """The tiny Qwen2 model, or for a "moe" mode a tiny Qwen3-MoE (8 experts, top 2, in both layers)."""
    if "moe" in mode:
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig

        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                             initializer_range=0.2, tie_word_embeddings=True)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device())
    return tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=2).to(device())


def untimed(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


FIRST_HALF: set = set()  # the prompts of rank 0's share of the recorded step (see `digits_second_half`)
# nats x (token id mod 5) added to the recorded sampler logprobs, so that the sampler-trainer mismatch metrics
# (rollout/mismatch_*) are far from 0 and the ranks' reduction (mean over every token, max over all) shows
PLANTED = 0.01


class Recording:
    """The real engine, whose step-1 rollout (and its prompts) is saved for the multi-process runs to replay."""

    def __init__(self, engine, path):
        self.engine, self.path = engine, path

    def generate(self, prompts, options):
        FIRST_HALF.clear()
        FIRST_HALF.update(prompts[: len(prompts) // 2])
        batch = self.engine.generate(prompts, options)
        batch.sampler_logp = batch.sampler_logp + PLANTED * (batch.completion_ids % 5) * batch.loss_mask()
        torch.save({"prompts": list(prompts), "batch": dataclasses.asdict(batch)}, self.path)
        return batch


class Replay:
    """Each rank's rows of a recorded rollout: the same global batch as the single-process step."""

    def __init__(self, path):
        saved = torch.load(path, weights_only=False, map_location="cpu")
        self.prompts, self.fields = saved["prompts"], saved["batch"]
        FIRST_HALF.clear()
        FIRST_HALF.update(self.prompts[: len(self.prompts) // 2])

    def generate(self, prompts, options):
        k = len(prompts)
        off = next(i for i in range(len(self.prompts)) if self.prompts[i : i + k] == list(prompts))
        f = self.fields
        rows = ((f["prompt_index"] >= off) & (f["prompt_index"] < off + k)).nonzero().view(-1)
        out = {n: (v[rows] if isinstance(v, torch.Tensor) else v) for n, v in f.items() if n not in ("completions", "timing")}
        out["prompt_index"] = out["prompt_index"] - off
        if out.get("episodes") is not None:
            out["episodes"] = [EpisodeRecord(**out["episodes"][i]) for i in rows.tolist()]
        texts = [f["completions"][i] for i in rows.tolist()]
        return RolloutBatch(completions=texts, timing=RolloutTiming(**f["timing"]), **out)


class Episodes:
    """The real engine running multi-turn episodes of a scripted driver: 1-3 turns of at most 4 tokens, each
    followed by 1-3 observation tokens."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, options):
        driver = ScriptedDriver(lambda b: 1 + b % 3, lambda b, k: [50 + b % 7, 60 + k][: 1 + (b + k) % 2],
                                max_turn_tokens=4, reward=lambda b: float(b % 2))
        return self.engine.generate(prompts, options, episodes=driver)


def use_engine(make):
    """Replace the trainer's engine factory (the multi-process code under test is left as it is)."""
    real = placement.make_rollout_engine
    placement.make_rollout_engine = lambda *args: make(real(*args))


MODES = {
    # rank 0's groups all have zero advantage and are skipped: it pads with zero-gradient micro-batches
    "lora": ["reward.reward_funcs=[tests.dist_worker:digits_second_half]"],
    # a frozen reference copy (beta > 0), old logprobs and two optimizer steps (mu = 2), gradient checkpointing
    "full": ["model.lora=false", "optim.learning_rate=0.002", "model.gradient_checkpointing=true", "objective.beta=0.04",
             "train.num_iterations=2"],
    # padding-free micro-batches filled to a token budget, checkpointed layer inputs offloaded (host copies on CPU),
    # decoder layers compiled on the ranks (`RANKS_ONLY`)
    "lora_packed_offload": ["train.packed=true", "rollout.max_prompt_length=48", "train.micro_batch_tokens=160",
                            "model.gradient_checkpointing=true", "model.activation_offload=true"],
    # multi-turn episodes (the `Episodes` engine): only the model's tokens trained, packed in token-budget
    # micro-batches, the per-sequence normalizer and the entropy bonus over the model's tokens of every rank
    "lora_episodes": ["rollout.max_completion_length=20", "rollout.max_prompt_length=48", "train.packed=true",
                      "train.micro_batch_tokens=80", "objective.loss_type=grpo", "objective.entropy_coef=0.01"],
    # "full" with FSDP2 CPU offload: one process shards over a 1-rank group of its own, 2 ranks over torchrun's
    "full_fsdp_offload": ["model.lora=false", "optim.learning_rate=0.002", "model.gradient_checkpointing=true",
                          "objective.beta=0.04", "train.num_iterations=2", "train.fsdp_offload=true"],
}


# 4 ranks (`python -m torch.distributed.run --nproc-per-node 4 ... equivalence4`): 6 prompts x 4 samples split 2, 2,
# 1, 1 prompts (uneven shares), micro-batches of 3 trained rows, padding passes up to the most any rank has
FOUR_RANK_MODES = {
    # the hf weight path (the sharded model's units all-gathered for the rollout); the first 3 prompts' groups
    # have zero variance, so rank 0 (prompts 0 and 1) trains no row and rank 1 one group
    "lora_uneven4": ["train.prompts_per_step=6", "reward.reward_funcs=[tests.dist_worker:digits_second_half]",
                     "optim.max_grad_norm=0.02"],  # (its gradient norm is about 0.05: clipping stays active)
    # the static backend's weight path (a replica synced in place on every rank), a reference copy and mu = 2
    "full_static_uneven4": ["train.prompts_per_step=6", "rollout.backend=static", "model.lora=false",
                            "optim.learning_rate=0.002", "objective.beta=0.04", "train.num_iterations=2"],
}

# CUDA only (`LOGITLESS_TEST_CUDA=1`, the "equivalence_liger" scenario): Liger's Triton kernels in the decoder layers
# of the sharded model, against one process with them (tests/test_liger_kernels.py holds one process to the plain
# model)
LIGER_MODES = {
    "lora_liger": ["model.liger_kernels=true", "model.gradient_checkpointing=true", "train.packed=true",
                   "rollout.max_prompt_length=48", "train.micro_batch_tokens=160"],
    "full_liger": ["model.liger_kernels=true", "model.lora=false", "optim.learning_rate=0.002",
                   "model.gradient_checkpointing=true", "objective.beta=0.04", "train.num_iterations=2"],
}

# Routing replay under FSDP2 (a mixture-of-experts model, `model("moe")`): the recorded rollout's routes split with
# its rows; full fine-tuning (router and experts trained), a reference copy, mu = 2, gradient checkpointing
MOE_MODES = {
    "full_moe": ["model.lora=false", "optim.learning_rate=0.002", "model.gradient_checkpointing=true",
                 "objective.beta=0.04", "train.num_iterations=2", "model.routing_replay=true"],
}

ALL_MODES = {**MODES, **FOUR_RANK_MODES, **LIGER_MODES, **MOE_MODES}

# Overrides of the ranks' runs only: their MLPs tiled (models/tiled_mlp.py, chunks of 5 tokens, far fewer than a
# micro-batch's) against the untiled single process, so the comparison also holds the tiled MLP to the untiled one
# under FSDP2: padded LoRA micro-batches without checkpointing, and full fine-tuning (the MLP weights' gradients
# reduce-scattered) under checkpointing with a no-grad logprobs pass; and the decoder layers compiled under FSDP2
# against the eager single process (which need not pay for a compile of its own: on a 2-core CPU it is most of
# the mode's time).
RANKS_ONLY = {"lora": ["model.mlp_chunk_tokens=5"], "full": ["model.mlp_chunk_tokens=5"],
              "lora_packed_offload": ["model.compile_layers=true"]}


@contextlib.contextmanager
def offload_every_saved_tensor():
    """Activation offload takes every saved tensor, not only those of 1 MiB or more (none is, in the tiny model),
    so that the offload path really runs under FSDP2."""
    saved, offload.MIN_BYTES = offload.MIN_BYTES, 0
    try:
        yield
    finally:
        offload.MIN_BYTES = saved


@contextlib.contextmanager
def recording_shares(path: Path):
    """The trainer's update plans as they are made, recorded for this rank in `path`: the rows of its share, the
    rows it trains and its padding passes (the trainer's own `plan_update`, called through)."""
    real, shares = loop.plan_update, []

    def plan_update(ctx, ro, scored, rows=None):
        plan = real(ctx, ro, scored, rows)
        shares.append({"rows": int(ro.batch.completion_mask.shape[0]), "trained": int(plan.trained.numel()),
                       "micro": len(plan.micro), "padding": plan.padding})
        return plan

    loop.plan_update = plan_update
    try:
        yield
    finally:
        loop.plan_update = real
        path.write_text(json.dumps(shares))


def equivalence(out: Path, tok, modes: dict[str, list[str]] = MODES) -> None:
    rank, real = int(os.environ["RANK"]), placement.make_rollout_engine
    try:
        for mode, overrides in modes.items():
            placement.make_rollout_engine = real
            use_engine(lambda engine, mode=mode: Replay(out / f"rollout_{mode}.pt"))
            with offload_every_saved_tensor(), recording_shares(out / f"{mode}_share{rank}.json"):
                result = train(config(out / f"{mode}_ranks", *overrides, *RANKS_ONLY.get(mode, [])), model=model(mode),
                               tokenizer=tok)
            if rank == 0:
                (out / f"{mode}_ranks.json").write_text(json.dumps(untimed(result.records)))
    finally:  # the trainer's own engines again, for a scenario after this one in the same launch
        placement.make_rollout_engine = real


def resume(out: Path, tok) -> None:
    steps = ["train.max_steps=3", "objective.beta=0.04"]  # the LoRA reference: adapters disabled on the sharded model
    full = train(config(out / "full", *steps), model=model(), tokenizer=tok)

    def hook(event, step):  # SIGTERM to rank 0 only, after the rollout of step 2: every rank must stop there
        if event == "after_rollout" and step == 2 and int(os.environ["RANK"]) == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    cut = train(config(out / "cut", *steps), model=model(), tokenizer=tok, hook=hook)
    resumed = train(config(out / "cut", *steps), model=model(), tokenizer=tok, resume=out / "cut")
    runs = {"full": untimed(full.records), "cut": untimed(cut.records), "resumed": untimed(resumed.records),
            "interrupted": cut.interrupted, "cut_step": cut.step}
    (out / f"resume_rank{os.environ['RANK']}.json").write_text(json.dumps(runs))
    # The static backend samples from a replica synced before each rollout: its logprobs are the trainer's.
    static = ["rollout.backend=static", "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]
    result = train(config(out / "static", *steps, *static), model=model(), tokenizer=tok)
    (out / f"static_rank{os.environ['RANK']}.json").write_text(json.dumps(result.records))
    # The same with the parameter shards and the optimizer states in host memory during each rollout.
    parked = train(config(out / "parked", *steps, *static, "train.offload_during_rollout=true"), model=model(), tokenizer=tok)
    (out / f"parked_rank{os.environ['RANK']}.json").write_text(json.dumps(parked.records))


ASYNC = ["rollout.backend=static", "train.async_rollout=true", "train.max_steps=4", "rollout.max_kv_gib=0.25",
         "objective.sampler_is_mode=token_truncate", "objective.sampler_is_clip_max=2.0"]  # (the cap: CUDA needs one)


def async_runs(out: Path, tok) -> None:
    """train.async_rollout on every rank: an uninterrupted LoRA run, the same run stopped by SIGTERM (to rank 0
    only) after the rollout of step 3 and resumed, and full fine-tuning (a replica of the whole model)."""
    rank = int(os.environ["RANK"])
    full = train(config(out / "async_full", *ASYNC), model=model(), tokenizer=tok)

    def hook(event, step):
        if event == "after_rollout" and step == 3 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    cut = train(config(out / "async_cut", *ASYNC), model=model(), tokenizer=tok, hook=hook)
    resumed = train(config(out / "async_cut", *ASYNC), model=model(), tokenizer=tok, resume=out / "async_cut")
    fft = train(config(out / "async_fft", *ASYNC, "model.lora=false", "optim.learning_rate=0.002"), model=model(),
                tokenizer=tok)
    runs = {"full": full.records, "cut": cut.records, "resumed": resumed.records, "cut_step": cut.step,
            "fft": fft.records}
    (out / f"async_rank{rank}.json").write_text(json.dumps(runs))


SHARED = ["rollout.backend=static", "train.max_steps=3", "objective.beta=0.04"]


def shared_runs(out: Path, tok) -> None:
    """rollout.device under torchrun (trainer/placement/shared_rollout.py), against the same runs with a replica on every rank:
    LoRA with an eval during training, full fine-tuning with uneven shares (3 prompts on 2 ranks), and async rollouts
    (uninterrupted, and stopped by SIGTERM to rank 0 after step 3's rollout and resumed)."""
    rank, here = int(os.environ["RANK"]), "cuda:2" if device().type == "cuda" else "cpu"
    # 5 held-out prompts in chunks of 2, 2 samples each, before training and after step 2: every rank asks for the
    # same chunks, which rank 0 decodes once (against one process's eval of the initial policy, below)
    eval_ = ["eval.every_steps=2", "eval.on_start=true", "eval.num_prompts=5", "eval.batch_size=2", "eval.pass_k=2",
             "data.eval_options={n: 10}"]
    full = ["model.lora=false", "optim.learning_rate=0.002", "train.prompts_per_step=3"]
    runs = {}
    cuda = device().type == "cuda"  # on GPUs (each run compiles its decode): LoRA with the eval, and async
    for name, overrides in {"lora": SHARED + eval_, **({} if cuda else {"full": SHARED + full}),
                            "async": ASYNC}.items():
        for where in ("own", "shared"):
            device_ = [f"rollout.device={here}"] if where == "shared" else []
            runs[f"{name}_{where}"] = train(config(out / f"{name}_{where}", *overrides, *device_), model=model(),
                                            tokenizer=tok).records

    def hook(event, step):
        if event == "after_rollout" and step == 3 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    if not cuda:  # (the resume is the same code on GPUs)
        cut_cfg = [*ASYNC, f"rollout.device={here}"]
        cut = train(config(out / "async_cut", *cut_cfg), model=model(), tokenizer=tok, hook=hook)
        resumed = train(config(out / "async_cut", *cut_cfg), model=model(), tokenizer=tok, resume=out / "async_cut")
        runs.update(cut=cut.records, resumed=resumed.records, cut_step=cut.step)
    if rank == 0:  # the initial policy's eval in this process alone, with an engine of its own (no collective)
        from logitless.trainer.builders import load_rows
        from logitless.trainer.evaluate import evaluate

        cfg = config(out / "unused", *SHARED, *eval_)
        rows = load_rows(cfg.data, cfg.eval.split or cfg.data.eval_split, eval=True)[: cfg.eval.num_prompts]
        runs["one_process_eval"] = evaluate(model(), tok, rows, cfg).metrics()
    (out / f"shared_rank{rank}.json").write_text(json.dumps(runs))


def shared_failure(out: Path, tok) -> None:
    """Rank 0's decode process killed after step 1's rollout, under a shared rollout: step 2's rollout fails on
    every rank with the reason (none waits in a collective)."""
    from logitless.trainer.placement import rollout_worker

    workers, init = [], rollout_worker.DecodeWorker.__init__

    def record(self, *args, **kwargs):  # the real worker, remembered so that the hook can kill its process
        init(self, *args, **kwargs)
        workers.append(self)

    rollout_worker.DecodeWorker.__init__ = record

    def hook(event, step):
        if event == "after_rollout" and step == 1 and workers:
            workers[0].proc.kill()
            workers[0].proc.wait()

    try:
        train(config(out / "fail", *SHARED, "rollout.device=cpu"), model=model(), tokenizer=tok, hook=hook)
    except RuntimeError as e:
        (out / f"failure_rank{os.environ['RANK']}.txt").write_text(str(e))


def stuck_rank(out: Path, tok) -> None:
    """Rank 1 stops (a hang) after step 1's rollout while rank 0 goes on to the update's first collective: with
    train.collective_timeout_s=3 both end (watchdog.py) naming rank 1 and its phase."""
    def hook(event, step):
        if event == "after_rollout" and step == 1 and int(os.environ["RANK"]) == 1:
            threading.Event().wait()  # the hang: this rank never reaches the update's collectives

    train(config(out / "stuck", "train.collective_timeout_s=3"), model=model(), tokenizer=tok, hook=hook)


def dead_rank(out: Path, tok) -> None:
    """Rank 1's process ends abruptly (os._exit, as a kill would) after step 1's rollout: rank 0's collective fails
    and its error names rank 1."""
    def hook(event, step):
        if event == "after_rollout" and step == 1 and int(os.environ["RANK"]) == 1:
            os._exit(3)

    try:
        train(config(out / "dead", "train.collective_timeout_s=30"), model=model(), tokenizer=tok, hook=hook)
    except RuntimeError as e:
        (out / f"dead_rank{os.environ['RANK']}.txt").write_text(str(e))


def digits(prompts, completions, **fields):
    """Share of digit characters plus a length term: varies between samples, so advantages are non-zero (of an
    episode, the text of its messages)."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.01 * len(c) for c in texts]


def digits_second_half(prompts, completions, **fields):
    """`digits`, but 0 for every sample of the first half of the step's prompts (zero-variance groups)."""
    return [0.0 if p in FIRST_HALF else d for p, d in zip(prompts, digits(prompts, completions))]


def raise_on_rank1(prompts, completions, **fields):
    if int(os.environ.get("RANK", 0)) == 1:
        raise KeyError("rank 1 fails")
    return [float(len(c)) for c in completions]


def main(scenario: str, out_dir: str, tok_dir: str) -> None:
    torch.set_num_threads(1)
    scenarios = {"equivalence": equivalence, "resume": resume, "async": async_runs,
                 "shared": shared_runs, "shared_failure": shared_failure, "stuck_rank": stuck_rank,
                 "dead_rank": dead_rank,
                 "equivalence4": lambda out, tok: equivalence(out, tok, FOUR_RANK_MODES),
                 "equivalence_liger": lambda out, tok: equivalence(out, tok, LIGER_MODES),
                 "equivalence_moe": lambda out, tok: equivalence(out, tok, MOE_MODES)}
    for name in scenario.split(","):  # several scenarios in one launch: one process start for all
        scenarios[name](Path(out_dir), tokenizer(tok_dir))
    # Every rank is through and its files are written and closed: leave without the interpreter's teardown of
    # torch and the process group, which takes seconds per rank on a loaded 2-core runner.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from tests import dist_worker  # the module the reward specs "tests.dist_worker:..." name, not __main__

    dist_worker.main(*sys.argv[1:4])
