"""Several decode steps per CUDA graph launch: the static engine's step graphs.

A compiled decode step captured alone (torch.compile's "reduce-overhead") still costs the host one graph launch,
the compiled function's Python wrapper and guards, and the launches of everything outside the graph (sampling,
the step's bookkeeping) at every token; at 128 rows of a 1.5B model the host needs about as long per step as
the GPU (bench/LOG.md, "Decode at 128 rows"). A step graph holds n whole steps (sample, record, forward) over
one wave's static state, so the host launches once per n tokens and the GPU runs the steps back to back.

What makes a step replayable: every tensor it reads or writes lives at a fixed address for the wave (the rows'
logits, keys, finished flags, positions, the KV cache, the output buffers), the step index is a device tensor,
and every update is in place. `capture` records n calls of such a step; `replay` runs them again on the current
stream. Captures do not synchronize the device or empty torch's cache (unlike `torch.cuda.graph`), and they
are thread-local, so a rollout beside the update (train.async_rollout) captures without stalling it.
"""

from __future__ import annotations

from typing import Callable

import torch


class StepGraphs:
    """CUDA graphs of `n` calls of one step function each, keyed by what the caller says changes the captured
    work (here: the rows being decoded, the visible cache length, n), sharing one memory pool.

    A graph reads and writes the tensors the step touched during its capture, by address: the caller keeps
    them alive and in place while the graph may be replayed.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool: tuple[int, int] | None = None  # the first capture's private pool, reused by the others
        self.stream = torch.cuda.Stream(device)

    def run(self, key: tuple, n: int, step: Callable[[], None]) -> None:
        """Run `step` n times: replay the graph of (key, n), capturing it first if it is new. The first run of a
        new graph therefore costs a capture (host time of n steps, no device work) and then the replay."""
        graph = self.graphs.get((key, n))
        if graph is None:
            graph = self.graphs[(key, n)] = self._capture(step, n)
        graph.replay()

    def _capture(self, step: Callable[[], None], n: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the capture reads state the current stream wrote
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                for _ in range(n):
                    step()
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        if self.pool is None:
            self.pool = graph.pool()
        return graph
