"""Training on 2 and 4 processes (torchrun, gloo on CPU, FSDP2) against one process: same parameters and metrics
(on 4 ranks with uneven prompt shares and a rank that trains no row; the 2-rank runs of two modes with the tiled MLP,
`dist_worker.RANKS_ONLY`), exact resume from a sharded checkpoint, a loadable export, a failure on one rank ending
the run, bad input."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from logitless.trainer import checkpoint as ckpt
from logitless.trainer import dcp
from logitless.trainer.loop import train
from logitless.trainer.preflight import check_world
from logitless.trainer.distributed.parallel import World, rank_share
from tests import dist_worker as w
from tests.conftest import subprocess_env

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
WORKER = Path(w.__file__)


def torchrun(scenario: str, out: Path, tok_dir: Path, timeout: float = 300, argv: list[str] | None = None,
             ranks: int = 2):
    """Run the worker (or `argv`) on `ranks` ranks; a run past `timeout` (a hang) is ended (torchrun ends its
    workers) and fails the test."""
    env = subprocess_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           *(argv or [str(WORKER), scenario, str(out), str(tok_dir)])]
    log = out / f"torchrun-{scenario}.log"
    with open(log, "w") as f:  # a file, not a pipe: nothing waits on a worker that outlives torchrun
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun sends SIGTERM, then SIGKILL, to its workers
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"torchrun {scenario} did not end within {timeout} s:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    return subprocess.CompletedProcess(cmd, proc.returncode, text, "")


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The exported weights of the run's latest checkpoint (adapter or full model)."""
    from safetensors.torch import load_file

    folder = ckpt.resolve_checkpoint(run_dir) / "model"
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def close(a, b, rel=1e-5, abs_=1e-6) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
    return a == b


@pytest.fixture(scope="module")
def tok_dir(gpt2_tokenizer_dir):
    return gpt2_tokenizer_dir


def run_equivalence(out: Path, tok_dir: Path, modes: dict[str, list[str]] = w.MODES, scenario: str = "equivalence",
                    ranks: int = 2, timeout: float = 300) -> dict[str, list[dict]]:
    """One step on one process (recording its rollout), then the same step on `ranks` ranks replaying that rollout
    (the worker's `scenario`, which runs `modes`); returns the single-process records per mode."""
    tok = w.tokenizer(tok_dir)
    single = {}
    for mode, overrides in modes.items():
        real = w.placement.make_rollout_engine
        w.use_engine(lambda engine, mode=mode: w.Recording(w.Episodes(engine) if "episodes" in mode else engine,
                                                           out / f"rollout_{mode}.pt"))
        try:
            with w.offload_every_saved_tensor():
                single[mode] = train(w.config(out / f"{mode}_single", *overrides), model=w.model(mode),
                                     tokenizer=tok).records
        finally:
            w.placement.make_rollout_engine = real
    proc = torchrun(scenario, out, tok_dir, timeout=timeout, ranks=ranks)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return single


def check_equivalence(out: Path, single: dict[str, list[dict]], mode: str, atol: float, rel: float) -> None:
    """The 2-rank step left the same weights (within atol) and logged the same metrics (within rel)."""
    a, b = weights(out / f"{mode}_single"), weights(out / f"{mode}_ranks")
    assert a.keys() == b.keys() and a
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= atol
    before = {k: v.cpu() for k, v in w.model(mode).state_dict().items()} if mode.startswith("full") else None
    moved = [k for k in a if (before is None and "lora_B" in k) or (before is not None and k in before
                                                                     and not torch.equal(a[k], before[k]))]
    assert moved and any(float(a[k].abs().max()) > 0 for k in moved)  # the step changed the weights
    ranks = json.loads((out / f"{mode}_ranks.json").read_text())
    one = w.untimed(single[mode])
    assert len(ranks) == len(one) == 1 and ranks[0].keys() == one[0].keys()
    # (the static backend's replica of full fine-tuning exists on the ranks only: one process decodes from the model)
    diff = {k: (one[0][k], ranks[0][k]) for k in one[0]
            if k != "rollout/replica_gib" and not close(one[0][k], ranks[0][k], rel=rel)}
    assert not diff
    assert one[0]["train/tflop"] > 0  # the update's FLOPs are counted over every rank's rows, not rank 0's
    assert one[0]["grad_norm"] > w.config("unused", *w.ALL_MODES[mode]).optim.max_grad_norm  # clipping was active
    assert one[0]["rollout/mismatch_mean"] > 0.005  # the planted offset (w.PLANTED): a reduction that can fail
    if mode == "lora":  # only rank 1's 8 rows train: rank 0 ran zero-gradient padding passes, and nothing hung
        assert ranks[0]["trained_rows"] == 8.0 and ranks[0]["zero_variance_groups"] > 0
    elif mode == "lora_uneven4":  # the last 3 of 6 prompts train (12 rows): none of rank 0's, one group of rank 1's
        assert ranks[0]["trained_rows"] == 12.0 and ranks[0]["zero_variance_groups"] > 0
    elif mode.startswith("full"):
        assert ranks[0]["kl"] > 0  # the reference copy and the second optimizer step took part
    elif mode == "lora_episodes":  # several turns with observations between them, gathered over the ranks
        assert ranks[0]["episode/turns_mean"] > 1.5 and ranks[0]["tokens/env_mean"] > 1
    else:
        assert ranks[0]["trained_rows"] == 16.0  # every row trained, in packed token-budget micro-batches


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tok_dir, one_thread):
    """One launch of 2 ranks for the equivalence (`MODES`, then the mixture of experts' `MOE_MODES`), resume and
    async scenarios (one process start for the four): the folder of their files and the single-process records of
    the equivalence's modes."""
    out = tmp_path_factory.mktemp("two_ranks")
    return out, run_equivalence(out, tok_dir, {**w.MODES, **w.MOE_MODES},
                                scenario="equivalence,equivalence_moe,resume,async", timeout=900)


@pytest.mark.parametrize("mode", list(w.MODES))
def test_two_ranks_train_like_one_process(two_rank_runs, mode):
    check_equivalence(*two_rank_runs, mode, atol=1e-6, rel=1e-5)


def test_two_ranks_replay_routes_like_one_process(two_rank_runs):
    """Routing replay under FSDP2: a mixture-of-experts step on 2 ranks, each replaying its rows' recorded routes,
    leaves the weights (router and experts included) and metrics of the one-process step (the 2-rank launch's
    "equivalence_moe" scenario)."""
    out, single = two_rank_runs
    assert single["full_moe"][0]["rollout/route_disagreement"] == 0.0
    check_equivalence(out, single, "full_moe", atol=1e-6, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_train_like_one(tmp_path, tok_dir, monkeypatch):
    """The same on 2 GPUs (nccl, fp32; the fused op's Triton kernels are not batch-invariant, hence the looser
    tolerance)."""
    monkeypatch.setenv("LOGITLESS_TEST_CUDA", "1")
    single = run_equivalence(tmp_path, tok_dir)
    for mode in w.MODES:
        check_equivalence(tmp_path, single, mode, atol=1e-4, rel=1e-3)


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_liger_kernels_train_like_one(tmp_path, tok_dir, monkeypatch):
    """Liger's kernels in the decoder layers under FSDP2 (LoRA, and full fine-tuning whose norm weights' gradients
    come from Liger's backward and are reduce-scattered) against one process with them, as above."""
    pytest.importorskip("liger_kernel")
    monkeypatch.setenv("LOGITLESS_TEST_CUDA", "1")
    single = run_equivalence(tmp_path, tok_dir, w.LIGER_MODES, "equivalence_liger")
    for mode in w.LIGER_MODES:
        check_equivalence(tmp_path, single, mode, atol=1e-4, rel=1e-3)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, tok_dir, one_thread):
    out = tmp_path_factory.mktemp("four_ranks")
    return out, run_equivalence(out, tok_dir, w.FOUR_RANK_MODES, "equivalence4", ranks=4)


@pytest.mark.parametrize("mode", list(w.FOUR_RANK_MODES))
def test_four_ranks_with_uneven_shares_train_like_one_process(four_ranks, mode):
    """6 prompts on 4 ranks (shares of 2, 2, 1, 1 prompts x 4 samples, micro-batches of 3 rows, padded to the most
    any rank has): the step's weights and metrics are one process's. With LoRA (hf weight path) rank 0 trains no
    row and runs padding passes only; full fine-tuning (every row trained: 3, 3, 2, 2 micro-batches) syncs the
    static backend's replica on every rank."""
    out, single = four_ranks
    check_equivalence(out, single, mode, atol=1e-6, rel=1e-5)
    shares = [json.loads((out / f"{mode}_share{r}.json").read_text()) for r in range(4)]
    G = 4
    assert [s[0]["rows"] for s in shares] == [2 * G, 2 * G, G, G]
    assert {s[0]["micro"] for s in shares} == {max(-(-s[0]["trained"] // 3) for s in shares)}  # in step
    if mode == "lora_uneven4":
        assert [s[0]["trained"] for s in shares] == [0, G, G, G]
        assert [s[0]["padding"] for s in shares] == [2, 0, 0, 0]  # rank 0: padding passes only
    else:  # beta > 0: every row trains; the rollout sampled from a replica of the whole model on every rank
        assert [s[0]["trained"] for s in shares] == [2 * G, 2 * G, G, G]
        assert [s[0]["padding"] for s in shares] == [0, 0, 1, 1]
        plain = sum(p.numel() * p.element_size() for p in w.model().parameters()) / 2**30
        assert json.loads((out / f"{mode}_ranks.json").read_text())[0]["rollout/replica_gib"] == pytest.approx(plain)


def test_exported_adapter_loads_in_one_process_with_the_same_logprobs(two_rank_runs):
    """The 2-rank run's model/ folder is a PEFT adapter: loaded on one process it gives the single run's logprobs."""
    from peft import PeftModel

    from logitless.models import completion_logprobs

    out, _ = two_rank_runs
    torch.manual_seed(1)
    ids, cids = torch.randint(0, w.VOCAB, (2, 5)), torch.randint(0, w.VOCAB, (2, 4))
    masks = torch.ones_like(ids), torch.ones_like(cids)
    logp = {}
    for run in ("lora_single", "lora_ranks"):
        m = PeftModel.from_pretrained(w.model(), str(ckpt.resolve_checkpoint(out / run) / "model"))
        logp[run] = completion_logprobs(m, ids, masks[0], cids, masks[1])[0]
    base = completion_logprobs(w.model(), ids, masks[0], cids, masks[1])[0]
    assert torch.allclose(logp["lora_single"], logp["lora_ranks"], atol=1e-6)
    assert not torch.allclose(base, logp["lora_ranks"], atol=1e-4)  # the adapter is not a no-op


@pytest.fixture(scope="module")
def resume_runs(two_rank_runs):
    """The folder of the 2-rank launch's resume scenario."""
    return two_rank_runs[0]


def test_static_backend_samples_from_a_replica_synced_every_step(resume_runs):
    """After each optimizer step the replica is updated: the sampler's logprobs are the trainer's (is/logp_diff
    compares them on every token); a stale replica would differ by the update."""
    for rank in (0, 1):
        records = json.loads((resume_runs / f"static_rank{rank}.json").read_text())
        assert [r["step"] for r in records] == [1, 2, 3]
        assert all(r["is/logp_diff/max"] < 1e-4 for r in records), [r["is/logp_diff/max"] for r in records]
        assert records[-1]["kl"] > 1e-3  # the policy moved away from the reference, so a stale replica would show
        # a merged LoRA replica: the size of the model without adapters, and no merged copy beside it
        plain = sum(p.numel() * p.element_size() for p in w.model().parameters()) / 2**30
        assert all(r["rollout/replica_gib"] == pytest.approx(plain, rel=1e-9) for r in records)
        assert all(r["rollout/weights_copy_gib"] == 0 for r in records)


def test_parking_the_shards_and_optimizer_states_during_the_rollout_changes_nothing(resume_runs):
    """train.offload_during_rollout on 2 ranks with a replica: the FSDP2 parameter shards (DTensor local
    storages) and the optimizer states go to the host for each rollout and come back bit for bit."""
    for rank in (0, 1):
        plain = json.loads((resume_runs / f"static_rank{rank}.json").read_text())
        parked = json.loads((resume_runs / f"parked_rank{rank}.json").read_text())
        key = "memory/parked_gib"
        shards = sum(p.numel() * p.element_size() for p in w.model().parameters()) / 2 / 2**30  # about half each
        assert [r[key] for r in plain] == [0.0] * 3 and all(r[key] > 0.9 * shards for r in parked)
        assert parked[1][key] > parked[0][key]  # from step 2 on, the adapters' AdamW moments too
        strip = [[{k: v for k, v in r.items() if k != key} for r in w.untimed(x)] for x in (plain, parked)]
        assert strip[0] == strip[1] and plain[-1]["kl"] > 1e-3
    a, b = weights(resume_runs / "static"), weights(resume_runs / "parked")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_and_resume_on_two_ranks_continue_like_an_uninterrupted_run(resume_runs, tok_dir, one_thread):
    tmp_path = resume_runs
    for rank in (0, 1):
        r = json.loads((tmp_path / f"resume_rank{rank}.json").read_text())
        assert r["interrupted"] == 15 and r["cut_step"] == 1  # a SIGTERM to rank 0 stopped both ranks
        assert [x["step"] for x in r["full"]] == [1, 2, 3]
        assert r["cut"] + r["resumed"] == r["full"] and r["full"][-1]["kl"] > 0
    a, b = weights(tmp_path / "full"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    step = ckpt.resolve_checkpoint(tmp_path / "cut")
    assert dcp.saved_world_size(step) == 2 and (step / "dcp").is_dir() and (step / "rng-rank1.pt").is_file()
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]  # rank 0 alone writes the metrics
    # a resume on another number of ranks is refused, naming the fix
    tok = w.tokenizer(tok_dir)
    with pytest.raises(ckpt.CheckpointError, match=r"written by 2 rank\(s\) but this run has 1.*--nproc-per-node 2"):
        train(w.config(tmp_path / "cut", "train.max_steps=4", "objective.beta=0.04"), model=w.model(), tokenizer=tok,
              resume=tmp_path / "cut")  # the run's own settings: only the number of ranks differs


def check_async(out: Path, rel: float = 0.0) -> None:
    """The "async" scenario's runs (`dist_worker.async_runs`): step 1 samples the initial weights (its sampler
    logprobs are the trainer's), every later step's samples are one update behind (|logp - sampler_logp| > 0, with
    the sampler's real logprobs), LoRA and full fine-tuning; stopped after step 3's rollout and resumed, the run
    takes each rank's pending rollout from the checkpoint (a file of its own: the ranks' shares differ) and goes on
    like the uninterrupted run (exactly; within `rel` where given)."""
    for rank in (0, 1):
        r = json.loads((out / f"async_rank{rank}.json").read_text())
        for run in ("full", "fft"):
            diffs = [x["is/logp_diff"] for x in r[run]]
            assert len(diffs) == 4 and diffs[0] < 1e-4 and min(diffs[1:]) > 1e-3, (run, diffs)
        assert r["cut_step"] == 2
        if not rel:
            assert w.untimed(r["cut"] + r["resumed"]) == w.untimed(r["full"])
        else:
            for a, b in zip(w.untimed(r["cut"] + r["resumed"]), w.untimed(r["full"]), strict=True):
                assert a.keys() == b.keys() and all(close(a[k], b[k], rel=rel, abs_=1e-6) for k in a), (a, b)
    step = out / "async_cut" / "checkpoints" / "step-000002"  # the checkpoint the resume started from
    assert "prefetch" not in json.loads((step / "trainer_state.json").read_text())
    pending = [json.loads((step / dcp.rank_state_file(k)).read_text())["prefetch"] for k in (0, 1)]
    assert [p["step"] for p in pending] == [3, 3] and pending[0]["batch"] != pending[1]["batch"]
    a, b = weights(out / "async_full"), weights(out / "async_cut")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) if not rel else torch.allclose(a[k], b[k], rtol=rel, atol=1e-6) for k in a)


def test_async_rollouts_on_two_ranks_sample_one_update_behind_and_resume_exactly(two_rank_runs):
    """train.async_rollout under torchrun: each rank decodes its share of step k + 1 from its replica while step k
    updates (`check_async`)."""
    check_async(two_rank_runs[0])


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_async_rollouts_sample_one_update_behind_and_resume(tmp_path, tok_dir, monkeypatch):
    """The same on 2 GPUs (nccl): each rank's compiled decode (its step graphs) runs on the rollout's thread and
    stream while the update's collectives run on the main thread; the resumed run within 1e-4 of the
    uninterrupted one (GPU reductions are not bitwise reproducible)."""
    monkeypatch.setenv("LOGITLESS_TEST_CUDA", "1")
    proc = torchrun("async", tmp_path, tok_dir, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    check_async(tmp_path, rel=1e-4)


def test_a_failure_on_one_rank_ends_every_rank(tmp_path, tok_dir):
    """`torchrun -m logitless train` with a reward function that raises on rank 1 only: the run ends with the
    error (rank 0 waits in a collective and is ended by torchrun) instead of hanging."""
    model_dir = tmp_path / "tiny"
    w.model().save_pretrained(model_dir)
    w.tokenizer(tok_dir).save_pretrained(model_dir)
    cfg = w.config(tmp_path / "run", "reward.reward_funcs=[tests.dist_worker:raise_on_rank1]", "train.max_steps=3")
    overrides = [f"model.name_or_path={model_dir}", f"train.output_dir={tmp_path / 'run'}", "model.device=cpu",
                 "reward.reward_funcs=[tests.dist_worker:raise_on_rank1]", "data.options={difficulty: 1, n: 40, chat: false}",
                 f"train.prompts_per_step={cfg.train.prompts_per_step}", "rollout.max_completion_length=6",
                 "logging.tensorboard=false", "logging.plot=false"]
    proc = torchrun("cli_fail", tmp_path, tok_dir, timeout=240, argv=["-m", "logitless", "train", *overrides])
    assert proc.returncode != 0
    assert "error: reward function 'raise_on_rank1' raised KeyError: 'rank 1 fails'" in proc.stdout


def test_a_rank_that_hangs_fails_both_ranks_within_the_bound_naming_it_and_its_phase(tmp_path, tok_dir):
    """Rank 1 hangs after its rollout; rank 0 waits in the update's first collective. With
    train.collective_timeout_s=3 rank 1's watchdog ends it with its stacks, and rank 0 ends naming rank 1 (it used
    to wait for the process group's 30 minutes)."""
    t0 = time.monotonic()
    proc = torchrun("stuck_rank", tmp_path, tok_dir, timeout=240)
    assert proc.returncode != 0
    out = proc.stdout
    rank1 = ("error: rank 1: the rollout phase of step 1 did not finish within train.collective_timeout_s=3 s; this "
             "rank itself is stuck (its stacks follow)")
    assert rank1 in out, out[-6000:]
    # rank 0 names rank 1 and its phase: told of its failure, past its own bound, or when its collective failed as
    # rank 1 ended (gloo fails at once), whichever comes first
    assert re.search(r"rank 0: .*rank 1( failed: rank 1: the rollout phase of step 1| is still in the rollout phase "
                     r"of step 1)", out), out[-6000:]
    assert "in hook" in out and "Current thread" in out  # faulthandler's stacks of the stuck rank
    assert time.monotonic() - t0 < 200


def test_a_rank_that_dies_fails_the_other_naming_it(tmp_path, tok_dir):
    proc = torchrun("dead_rank", tmp_path, tok_dir, timeout=240)
    assert proc.returncode != 0
    text = (tmp_path / "dead_rank0.txt").read_text()
    assert text.startswith("rank 0: the update phase of step 1 failed ("), text
    assert "rank 1 stopped answering" in text and "last in the rollout phase of step 1" in text, text


def _cfg(*overrides):
    return w.config("unused", *overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.prompts_per_step=1"], r"train.prompts_per_step=1 .* split across the 2 ranks, and each rank needs at "
                                       r"least one prompt; set it to at least 2"),
        (["rollout.backend=continuous"], r"rollout.backend='continuous' cannot run under torchrun .* set rollout.backend=hf"),
        (["objective.top_entropy_quantile=0.8"], r"objective.top_entropy_quantile=0.8 .* set objective.top_entropy_quantile=1.0"),
        (["advantage.scale=batch"], r"advantage.scale='batch' .* set advantage.scale=group"),
        (["advantage.multi_reward=normalize_then_sum"],
         r"advantage.multi_reward='normalize_then_sum' \(GDPO\) .* set advantage.multi_reward=sum_then_normalize"),
        (["model.load_in_4bit=true"], r"model.load_in_4bit=true \(QLoRA\) is not supported with FSDP2 under torchrun yet; "
                                      r"set model.load_in_4bit=false"),
        (["optim.optimizer=adamw_8bit"], r"optim.optimizer=adamw_8bit is not supported .* set optim.optimizer=adamw"),
        (["model.device=cuda:0"], r"model.device='cuda:0' puts every rank on the same device; .* set model.device=auto"),
    ],
)
def test_settings_that_cannot_run_on_several_ranks_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_world(_cfg(*overrides), World(rank=0, size=2))
    check_world(_cfg(*overrides), World())  # one process: no restriction


@pytest.mark.parametrize("setting, fix", [("model.liger_kernels", "model.liger_kernels=false or rollout.tensor_parallel=1"),
                                          ("train.async_rollout", "rollout.tensor_parallel=1 .* or train.async_rollout=false")])
def test_liger_kernels_and_async_rollouts_run_under_torchrun_with_a_replica_per_gpu_not_a_split_one(setting, fix):
    check_world(_cfg(f"{setting}=true", "rollout.backend=static"), World(rank=0, size=2))
    check_world(_cfg(f"{setting}=true", "rollout.backend=static"), World(rank=1, size=4))
    with pytest.raises(ValueError, match=rf"{setting}=true with rollout.tensor_parallel=2: .* set {fix}"):
        check_world(_cfg(f"{setting}=true", "rollout.backend=static", "rollout.tensor_parallel=2"),
                          World(rank=0, size=2))
    if setting == "model.liger_kernels":  # (the hf rollout decodes from the sharded model: Liger runs there too)
        check_world(_cfg("model.liger_kernels=true", "rollout.backend=hf"), World(rank=1, size=4))


def test_rank_shares_are_contiguous_and_cover_the_step():
    rows = list(range(8))
    shares = [rank_share(rows, World(rank=r, size=4)) for r in range(4)]
    assert shares == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_share(rows, World()) == rows
    for n, k in ((6, 4), (13, 8), (8, 8), (9, 2)):  # uneven: the first n % k ranks take one more
        shares = [rank_share(list(range(n)), World(rank=r, size=k)) for r in range(k)]
        assert sum(shares, []) == list(range(n))
        assert [len(s) for s in shares] == [n // k + (r < n % k) for r in range(k)]


def test_a_replica_sync_all_gathers_one_fsdp_unit_at_a_time(monkeypatch):
    """The static backend's replicas read the sharded model one FSDP2 unit at a time: one all-gather per decoder
    layer (and the root's, where it holds trained weights), not one per weight, and write what the unsharded model
    holds: W + scaling x B @ A for a merged LoRA replica, the adapters for an unmerged one, every weight for full
    fine-tuning. (One gloo rank in this process: the unit logic is the same on N.)"""
    import copy

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import FSDPModule

    from logitless.trainer.distributed.parallel import make_replica, shard_model
    from tests.conftest import tiny_qwen2

    unshards: list[str] = []
    real = FSDPModule.unshard
    monkeypatch.setattr(FSDPModule, "unshard", lambda self, *a, **k: (unshards.append(type(self).__name__),
                                                                    real(self, *a, **k))[1])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        for kind in ("merged", "unmerged", "full"):
            base = tiny_qwen2(vocab_size=100, hidden=32, layers=3)
            model = base if kind == "full" else get_peft_model(base, LoraConfig(r=2, target_modules="all-linear"))
            for n, p in model.named_parameters():  # non-zero adapters (B starts at 0), so the merge shows
                if "lora_B" in n:
                    p.data.normal_()
            want = (copy.deepcopy(model).merge_and_unload() if kind == "merged" else copy.deepcopy(model)).state_dict()
            replica = make_replica(model, False if kind == "unmerged" else None)
            for p in replica.model.parameters():  # everything the sync writes starts wrong
                p.data.zero_()
            sharded = shard_model(model, torch.device("cpu"))
            unshards.clear()
            replica.sync(sharded)
            assert unshards == ["FSDPQwen2DecoderLayer"] * 3 + (["FSDPQwen2ForCausalLM"] if kind == "full" else [])
            got = replica.model.state_dict()
            written = [k for k in got if ("lora_" in k if kind == "unmerged" else k.endswith("proj.weight") or
                                          kind == "full")]
            assert written and all(torch.allclose(got[k], want[k], atol=1e-6) for k in written)
    finally:
        dist.destroy_process_group()
