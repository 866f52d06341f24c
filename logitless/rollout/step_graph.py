"""The static engine's decode step as one CUDA graph: the forward, the token draw and the step's bookkeeping.

Compiled with mode "reduce-overhead", the forward alone is one graph replay, but each step still costs the host
dynamo's guard check, the CUDA-graph tree's checks of its inputs and transformers' wrapper, then about eight
eager launches for the draw and the writes: on an H200 at 128 rows about as long as the GPU's own step
(bench/LOG.md), so the GPU waits on the host and a faster kernel gains nothing. Here the forward is compiled
without CUDA graphs and the whole step is captured once per wave; a step is one `replay()`.

Every tensor the step reads or writes lives at a fixed address for the wave (the last token, the positions, the
done flags, the outputs, the KV cache), and the step index is a counter on the device that the step itself
increments, so one graph serves every step. One step is equivalent to the loop of `StaticEngine._decode_wave`:

    logits = model(token[:, None], mask, next_pos, cache).logits[:, -1]     # [b, V]
    next_pos += 1; t += 1
    token, logp = draw(logits, keys, t)                                      # [b], [b]
    token = where(done, pad, token)
    history[:, P + t] = token; out_logp[:, t] = logp
    done |= is_stop(token, eos)

Off CUDA the same step runs eagerly (no capture), which is what the CPU tests check against the loop.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

WARMUP_STEPS = 2  # eager steps before the capture (compilation, autotuning, lazy initialization)


def is_stop(token: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b] bool: token [b] is one of `ids` [k]. A broadcast compare, not `torch.isin`: isin sorts once `ids` holds
    int(10·b^0.145) ids or more (numpy's rule: 15 at 24 rows, 20 at 128), and its sort takes the unique elements,
    a device sync that no CUDA graph may hold (an episode driver's 30 turn-end ids made the step's capture fail) and
    a host round trip per eager step."""
    return (token[:, None] == ids[None, :]).any(1)


class DecodeStep:
    """One wave's decode step over fixed buffers; `advance()` runs the next step (a graph replay once captured).

    forward: the model's forward (compiled without CUDA graphs on CUDA). draw: `sampling.StepSampler`. The buffers
    are the wave's own and are updated in place: mask [b, L], next_pos [b, 1], done [b], keys [b], history
    [b, P + S], out_logp [b, S]. stream: the CUDA side stream to warm up and capture on (one per engine and
    device, so the libraries' per-stream workspaces exist before a capture); None: every step runs eagerly.
    `first(logits)` draws step 0 from the prefill's logits; every `advance()` decodes one more step."""

    def __init__(self, forward: Callable, draw: Callable, cache: Any, *, mask: torch.Tensor, next_pos: torch.Tensor,
                 done: torch.Tensor, keys: torch.Tensor, history: torch.Tensor, out_logp: torch.Tensor,
                 prompt_len: int, pad_id: int, eos: torch.Tensor, codes: torch.Tensor, temperature: float,
                 greedy: bool, stream: Any = None, limit: torch.Tensor | None = None):
        self.forward, self.draw, self.cache = forward, draw, cache
        self.mask, self.next_pos, self.done, self.keys = mask, next_pos, done, keys
        self.history, self.out_logp = history, out_logp
        self.P, self.pad_id, self.eos, self.codes = prompt_len, pad_id, eos, codes
        self.T, self.greedy = temperature, greedy
        self.token = torch.empty(done.shape, dtype=torch.long, device=done.device)  # [b] the last drawn token
        self.t = torch.zeros((), dtype=torch.long, device=done.device)  # the step drawn last (or, at 0, next)
        self.limit = limit  # [b] long or None: a row is done once it has drawn this many tokens (episode turns)
        self.stream = stream
        self.graph: torch.cuda.CUDAGraph | None = None
        self.uncapturable: str | None = None  # why the capture failed, if it did (the step then runs eagerly)
        self.steps_run = 0

    def first(self, logits: torch.Tensor) -> None:
        """Draw step 0 from `logits` [b, V] (the prefill's), eagerly."""
        self._emit(logits)

    def body(self) -> None:
        logits = self.forward(input_ids=self.token[:, None], attention_mask=self.mask, position_ids=self.next_pos,
                              past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        self.next_pos.add_(1)
        self.t.add_(1)
        self._emit(logits)

    def _emit(self, logits: torch.Tensor) -> None:
        """Draw step t from `logits` and write it: the token (the pad id for rows done), its logprob, the flags."""
        token, logp = self.draw(logits, self.keys, self.t, self.codes, self.T, self.greedy)
        token = torch.where(self.done, self.pad_id, token)
        b = token.shape[0]
        self.history.scatter_(1, (self.t + self.P).expand(b, 1), token[:, None])
        self.out_logp.scatter_(1, self.t.expand(b, 1), logp[:, None])
        if self.eos.numel():
            self.done.logical_or_(is_stop(token, self.eos))
        if self.limit is not None:
            self.done.logical_or_(self.t + 1 >= self.limit)
        self.token.copy_(token)

    def advance(self) -> None:
        """Decode the next step: eagerly for the first WARMUP_STEPS (on a side stream on CUDA), then captured once
        and replayed (on CUDA; off CUDA every step runs eagerly)."""
        self.steps_run += 1
        if self.stream is None:
            self.body()
            return
        if self.graph is None and self.steps_run <= WARMUP_STEPS:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.body()
            torch.cuda.current_stream().wait_stream(self.stream)
            return
        if self.graph is None:
            if self.uncapturable is None:
                try:
                    self.graph = capture(self.body, self.stream)
                except RuntimeError as e:  # the model's forward does something a graph cannot hold
                    self.uncapturable = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    warn_uncapturable(self.uncapturable)
            if self.graph is None:  # decode on without a graph (each step relaunches its kernels)
                self.body()
                return
        self.graph.replay()

    def release(self) -> None:
        """Free the graph and its memory pool (the wave is over)."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None


_warned: set[str] = set()


def warn_uncapturable(reason: str) -> None:
    """Say once per reason that the decode step could not be captured and runs as separate launches."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"rollout.step_graph: the decode step could not be captured as one CUDA graph ({reason}); it "
                      "runs its compiled forward and draw as separate launches instead (same tokens, slower). Set "
                      "rollout.step_graph=false to skip the attempt", stacklevel=3)


def capture(fn: Callable[[], None], side: Any) -> torch.cuda.CUDAGraph:
    """Capture `fn`'s kernels on the side stream `side` into a graph with a memory pool of its own; nothing runs.
    Thread-local capture mode: with train.async_rollout another thread keeps using the GPU while this one captures.
    Unlike `torch.cuda.graph`, no `empty_cache()` first: the update's cached blocks stay cached."""
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    side.synchronize()
    # A capture registers the device's default random generator state with the graph, and a capture that fails
    # (cudaStreamEndCapture raises) never releases it: every later random op of the process then fails ("Offset
    # increment outside graph capture"). The step draws no torch random numbers (counter-based keys), so the graph
    # gets a copy of the state, and the generator its own state back whatever happens.
    generator = torch.cuda.default_generators[side.device.index if side.device.index is not None
                                              else torch.cuda.current_device()]
    own = generator.graphsafe_get_state()
    generator.graphsafe_set_state(generator.clone_state())
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
            try:
                fn()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # "a previous error during capture": the first one says why
                    graph.capture_end()
                raise
            graph.capture_end()
    finally:
        generator.graphsafe_set_state(own)
    torch.cuda.current_stream().wait_stream(side)
    return graph
