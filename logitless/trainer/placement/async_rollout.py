"""`train.async_rollout: true`: step k+1's samples are generated while step k scores, computes logprobs and
updates, one step off policy.

When step k takes its rollout, the rollout of step k+1 starts at once on a worker thread (on CUDA, on a stream of
the highest priority, ROLLOUT_STREAM_PRIORITY, so that the GPU starts the decode's queued kernels first; the
update's GEMMs still hold the SMs they run on, and beside them the decode runs at about 60 % of its speed alone,
bench/LOG.md): its prompts are drawn and the rollout weights (a merged-LoRA copy, `rollout/weights.py`) are
synced on the main thread first, so it samples from the weights before update k while update k writes only the
trainable parameters. With `rollout.device` it decodes from a replica on a GPU of its own, synced the same way
(across the GPUs; the rollout's stream waits for the copies), and the update has the training GPU to itself. Under
torchrun each rank draws the step's prompts, keeps its share, syncs its replica from the FSDP2 shards (a collective,
on every rank's main thread, before its rollout starts) and decodes beside its share of the update; the replica stays
resident, and each rank's pending rollout goes into the checkpoint as a file of its own. With a shared rollout GPU
(rollout.device under torchrun, trainer/placement/shared_rollout.py) the ranks' prompts are gathered when the rollout starts,
rank 0's decode process decodes them all, and each rank gets its rows when the step takes them (`Handout`). The
objective gets the rollout's real sampler logprobs, so the sampler importance-sampling options
(`objective.sampler_is_mode`) correct the one-step lag.

While one thread compiles (torch.compile traces with FX, which sets a process-wide flag), a compiled function
called on the other thread (the decode step, the sampler, `model.compile_layers`' layers) would raise
"Detected that you are using FX to symbolically trace a dynamo-optimized function"; during an async run such a
call runs its function uncompiled instead (dynamo's `error_on_nested_fx_trace=False`): the same math, once.

A checkpoint holds the prefetched rollout (its prompts' sampler position and the batch, with its episode records),
so a resumed run takes exactly the samples the uninterrupted run took; a step dropped by a stop signal puts its
rollout back.

With an agent (multi-turn episodes) the step's driver is made on the main thread when its rollout starts (the
prompts rendered, environments reset) and answers the model between turns on the rollout's thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from logitless.data import PromptRow, PromptSampler
from logitless.rollout import RolloutBatch, RolloutEngine, RolloutTiming, SamplingOptions
from logitless.rollout.engine import model_device, same_device
from logitless.rollout.episodes import EpisodeRecord
from logitless.rollout.weights import LiveWeights
from logitless.trainer.placement.shared_rollout import Handout, SharedDecode

ROLLOUT_STREAM_PRIORITY = -1  # CUDA stream priority of the rollout (lower runs first; -1 is torch's "high")
BATCH_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logp", "finished",
                 "truncated", "prompt_index")
ROUTE_TENSORS = ("prompt_routes", "completion_routes")  # mixture-of-experts routes, when recorded


@dataclass
class Prefetched:
    step: int  # the step these samples are for
    sampler_before: dict[str, Any]  # the prompt sampler's state before this step's prompts were drawn
    rows: list[PromptRow]
    options: SamplingOptions
    future: Future | Handout  # -> RolloutBatch (`result()`)


def batch_to_json(b: RolloutBatch) -> dict[str, Any]:
    """A JSON-able copy of a rollout batch (fp32 logprobs round-trip exactly through Python floats)."""
    names = BATCH_TENSORS + tuple(k for k in ROUTE_TENSORS if getattr(b, k) is not None)
    out: dict[str, Any] = {k: getattr(b, k).cpu().tolist() for k in names}
    out["dtypes"] = {k: str(getattr(b, k).dtype).removeprefix("torch.") for k in names}
    out["completions"] = list(b.completions)
    out["timing"] = dict(b.timing.__dict__)
    if b.env_mask is not None:  # multi-turn episodes
        out["env_mask"] = b.env_mask.cpu().tolist()
        out["episodes"] = [asdict(r) for r in b.episodes]
    return out


def batch_from_json(d: dict[str, Any]) -> RolloutBatch:
    tensors = {k: torch.tensor(d[k], dtype=getattr(torch, d["dtypes"][k])) for k in d["dtypes"]}
    episodes = {}
    if "env_mask" in d:
        episodes = {"env_mask": torch.tensor(d["env_mask"], dtype=torch.long),
                    "episodes": [EpisodeRecord(**r) for r in d["episodes"]]}
    return RolloutBatch(**tensors, completions=list(d["completions"]), timing=RolloutTiming(**d["timing"]), **episodes)


class AsyncRollout:
    """One rollout in flight on a worker thread, for the next step.

    `device` is the training device. `sync` brings the engine's weights up to date (a replica's sync from the
    trainer: rollout.device, or each rank's replica under torchrun, where the sync is a collective every rank runs
    on its main thread); None: the engine's own merged-LoRA copy (`engine.weights`) is synced. On a GPU of its own
    (the engine's weights elsewhere than `device`) the rollout shares neither memory nor SMs with the update.
    `share` picks this process's rows of the step's prompts (`parallel.rank_share` under torchrun; all of them)."""

    def __init__(self, engine: RolloutEngine, sampler: PromptSampler, prompts_per_step: int, device: torch.device,
                 sync: Callable[[], None] | None = None, agent: Any = None,
                 share: Callable[[list[PromptRow]], list[PromptRow]] = list):
        self.shared = isinstance(engine, SharedDecode)  # rank 0's decode process decodes every rank's share
        weights = None if self.shared else getattr(engine, "weights", None)
        if sync is None and (weights is None or isinstance(weights, LiveWeights)):
            raise ValueError(
                "train.async_rollout=true samples from a copy of the weights while the update writes the trainable "
                "ones: it needs rollout.backend=static with a merged LoRA copy (model.lora=true, "
                "rollout.merge_lora unset or true) or a replica on rollout.device; set train.async_rollout=false "
                "otherwise"
            )
        module = getattr(weights, "module", None)
        # the device the rollout decodes on (a shared rollout's GPU: another process decodes there)
        where = engine.device if self.shared else model_device(module) if module is not None else device
        if (same_device(where, device) and device.type == "cuda" and not self.shared
                and getattr(engine, "max_kv_gib", None) is None):
            raise ValueError(
                "train.async_rollout=true on CUDA needs rollout.max_kv_gib: the rollout then shares the GPU with the "
                "update, and the automatic budget (85 % of the memory free when the rollout starts) would take the "
                "update's memory. Set rollout.max_kv_gib to what the GPU can spare beside the update's peak, or "
                "decode on another GPU (rollout.device)"
            )
        engine.auto_sync = False  # synced here, on the main thread, before each rollout starts
        self.engine, self.sampler, self.n, self.agent, self.share = engine, sampler, prompts_per_step, agent, share
        self.sync: Callable[[], None] = sync or weights.sync
        self.device = where
        self.stream = (torch.cuda.Stream(where, priority=ROLLOUT_STREAM_PRIORITY)
                       if where.type == "cuda" and not self.shared else None)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="logitless-rollout")
        self._nested_fx = torch._dynamo.config.error_on_nested_fx_trace
        torch._dynamo.config.error_on_nested_fx_trace = False  # one thread compiling must not fail the other's call
        self.pending: Prefetched | None = None
        self.taken: Prefetched | None = None  # the rollout of the running step (put back if it is dropped)

    def start(self, step: int, options: SamplingOptions) -> None:
        """Draw step `step`'s prompts and start sampling them from the current weights."""
        before = self.sampler.state_dict()
        rows = self.share(self.sampler.next_batch(self.n))
        self.sync()
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # after the sync's copies (from another GPU too)
        driver = None if self.agent is None else self.agent.driver(rows, options.num_generations)
        prompts = [r.prompt for r in rows] if driver is None else driver.prompt_ids
        if self.shared:  # the ranks' prompts gathered here (main thread), decoded by rank 0's decode process,
            parts = self.engine.gather(prompts, options)  # handed out when the step takes them
            future = Handout(self.engine, parts, self.engine.submit(parts))
        else:
            future = self.pool.submit(self._generate, prompts, options, ready, driver)
        self.pending = Prefetched(step, before, rows, options, future)

    def _generate(self, prompts: list, options: SamplingOptions, ready: torch.cuda.Event | None,
                  driver: Any) -> RolloutBatch:
        episodes = {} if driver is None else {"episodes": driver}
        with torch._dynamo.config.patch(error_on_nested_fx_trace=False):  # dynamo's config can be per thread
            if self.stream is None:
                return self.engine.generate(prompts, options, **episodes)
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                batch = self.engine.generate(prompts, options, **episodes)
            self.stream.synchronize()
            return batch

    def take(self, step: int) -> tuple[list[PromptRow], RolloutBatch, SamplingOptions]:
        """Step `step`'s rollout, started earlier (waits for it)."""
        if self.pending is None or self.pending.step != step:
            have = None if self.pending is None else self.pending.step
            raise RuntimeError(f"async rollout: step {step} asks for its rollout, but the one in flight is {have}")
        self.taken, self.pending = self.pending, None
        return self.taken.rows, self.taken.future.result(), self.taken.options

    def put_back(self) -> None:
        """A dropped step: its rollout becomes the pending one again and the next step's is discarded."""
        if self.pending is not None:
            self.pending.future.result()  # let it finish: the engine is not re-entrant
        self.pending, self.taken = self.taken, None

    def state(self) -> dict[str, Any]:
        """The pending rollout for a checkpoint (waits for it); {} when none. Under torchrun each rank's is its own
        (its share of the prompts, its samples): the checkpoint keeps it per rank (`dcp.save_sharded`'s rank_state)."""
        p = self.pending
        if p is None:
            return {}
        return {"prefetch": {"step": p.step, "sampler_before": p.sampler_before, "options": dict(p.options.__dict__),
                             "batch": batch_to_json(p.future.result())}}

    def restore(self, state: dict[str, Any]) -> None:
        """Make a checkpoint's pending rollout pending again (the sampler re-draws its prompts)."""
        if "prefetch" not in state:
            return
        p = state["prefetch"]
        self.sampler.load_state_dict(p["sampler_before"])
        rows = self.share(self.sampler.next_batch(self.n))
        done: Future = Future()
        done.set_result(batch_from_json(p["batch"]))
        self.pending = Prefetched(int(p["step"]), p["sampler_before"], rows, SamplingOptions(**p["options"]), done)

    def close(self, wait: bool = True) -> None:
        """Stop the worker (wait=False: without waiting for a rollout in flight, on an error or a stop-at-once)."""
        self.pool.shutdown(wait=wait, cancel_futures=not wait)
        torch._dynamo.config.error_on_nested_fx_trace = self._nested_fx
