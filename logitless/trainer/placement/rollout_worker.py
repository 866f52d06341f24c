"""The shared rollout's decode in a process of its own (rollout.device under torchrun, `shared_rollout.py`).

Rank 0 owns the replica on the rollout's GPU and writes it at every sync; a child process decodes from those same
weights (CUDA IPC: no copy) with a static engine of its own, so that the decode's host work never takes turns with
the update's (FSDP2's hooks, kernel launches) on rank 0's interpreter lock, and its CUDA context and compiled graphs
are its own. The child is started with `python -m logitless.trainer.placement.rollout_worker` (not multiprocessing's spawn,
which would re-run the caller's main module) and talks over a socket pair: rank 0 sends the replica once (shared, not
copied: CUDA IPC handles, or shared host memory on CPU), then one request per rollout, each after the replica's sync
has finished on the device; the child answers with the batch (pickled, its tensors by value) or the error's text. The
child ends when rank 0 closes the connection or exits.

Each rollout has a bound, `timeout_s` (half of train.collective_timeout_s, so that the ranks learn of it within their
rollout phase's bound, `watchdog.py`): a decode still running then prints its threads' stacks (`faulthandler`) and the
child ends; rank 0 waits a second longer at most, ends a child that has not answered (one that is stopped or stuck in
native code) and raises, naming the setting, which `SharedDecode` hands every rank.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import subprocess
import sys
import types
from multiprocessing.connection import Connection
from typing import Any

import torch

from logitless.rollout.engine import model_device
from logitless.rollout.types import RolloutBatch, SamplingOptions

TIMED_OUT = 1  # the exit code of a decode process that ran past its bound (faulthandler's exit)
AUTHKEY = "LOGITLESS_DECODE_AUTHKEY"  # rank 0's multiprocessing authkey: the child fetches shared host tensors with it


class DecodeWorker:
    """Rank 0's handle on the decode process: `submit` a rollout, `result` waits for its batch; `close` ends it."""

    def __init__(self, model: torch.nn.Module, cfg: Any, tokenizer: Any, timeout_s: float, choice: Any = None):
        self.device, self.timeout_s = model_device(model), float(timeout_s)
        mine, theirs = multiprocessing.Pipe(duplex=True)
        env = {**os.environ, AUTHKEY: bytes(multiprocessing.current_process().authkey).hex()}
        self.proc = subprocess.Popen([sys.executable, "-m", "logitless.trainer.placement.rollout_worker", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.conn: Connection = mine
        self.peak_gib = 0.0  # the decode process's allocator peak on the rollout GPU, in the last rollout
        self._send((plain_calls(model), cfg, choice, tokenizer))  # the replica's tensors shared, not copied

    def _send(self, obj: Any) -> None:
        try:
            self.conn.send(obj)
        except (BrokenPipeError, ConnectionResetError, EOFError) as e:
            raise RuntimeError(f"the rollout's decode process ended (exit code {self.proc.poll()})") from e

    def submit(self, prompts: list, options: SamplingOptions) -> None:
        """Start decoding `prompts` from the replica as it is now (its sync finished on the device first)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the replica's copies (queued from the training GPU too) are done
            torch.cuda.synchronize()
        self._send((prompts, options, self.timeout_s))

    def result(self) -> RolloutBatch:
        """The batch of the rollout last submitted (waits for it, `timeout_s` and a second at most); the decode's
        error raised here."""
        late = (f"did not answer within {self.timeout_s:g} s (half of train.collective_timeout_s; raise it for longer "
                "rollouts)")
        if not self.conn.poll(self.timeout_s + 1.0):
            self.proc.kill()
            raise RuntimeError(f"the rollout's decode process {late}; it was ended (exit code {self.proc.wait()})")
        try:
            kind, payload, peak = pickle.loads(self.conn.recv_bytes())
        except (EOFError, ConnectionResetError) as e:
            code = self.proc.wait()
            why = f"{late} and ended, printing its stacks" if code == TIMED_OUT else f"ended (exit code {code})"
            raise RuntimeError(f"the rollout's decode process {why}") from e
        if kind == "error":
            raise RuntimeError(payload)
        self.peak_gib = peak
        return payload

    def close(self) -> None:
        """End the decode process (it leaves when its connection closes)."""
        self.conn.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def plain_calls(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (rank 0's replica, which rank 0 itself no longer runs) as its classes define it, so that it pickles:
    no methods bound to a module instance (a forward that `modeling.outside_compile` made dispatch to Liger's kernels
    outside torch.compile gets its class's forward back, as do Liger's `extra_repr` and `_get_name`), no hooks
    (gradient checkpointing's input hook and the like: the decode needs none), no layer compiled in place. None of
    these changes the decode process's compiled decode: torch.compile traces the plain forwards (Liger's dispatch
    runs them there) and compiles the decode as a whole. Any other forward of a module's own is refused."""
    for m in model.modules():
        d = m.__dict__
        forward = d.get("forward")
        if forward is not None and getattr(forward, "__func__", None) is not type(m).forward and \
                d.get("_plain_forward") is not type(m).forward:
            raise ValueError(f"rollout.device under torchrun: the replica's {type(m).__name__} has a forward of its own, "
                             "which the decode process cannot take; unset rollout.device")
        for name, value in list(d.items()):
            if isinstance(value, types.MethodType) and value.__self__ is m or name in ("_kernel_forward", "_plain_forward"):
                del d[name]
            elif name.endswith("hooks") and isinstance(value, dict):
                d[name] = type(value)()
        if d.get("_compiled_call_impl") is not None:
            m._compiled_call_impl = None
    return model


def serve(conn: Connection) -> None:
    """The decode process: the replica and the engine's settings, then one rollout per request until the
    connection closes."""
    from logitless.trainer.placement.engines import EngineChoice, make_rollout_engine

    def answer(*message: Any) -> None:  # the batch's tensors by value: about 20x faster than batch_to_json's lists
        conn.send_bytes(pickle.dumps(message, protocol=5))  # (bench/bench_handoff.py)

    engine = error = None
    try:
        model, cfg, choice, tokenizer = conn.recv()
        device = model_device(model)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        engine = make_rollout_engine(cfg, model, tokenizer, choice or EngineChoice())
    except Exception as e:  # answered at the first request
        error = f"the rollout's decode process could not start: {type(e).__name__}: {e}"
    while True:
        try:
            prompts, options, timeout_s = conn.recv()
        except EOFError:
            return
        if error is not None:
            answer("error", error, 0.0)
            continue
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            faulthandler.dump_traceback_later(timeout_s, exit=True)  # past its bound: its stacks, then exit 1
            batch = engine.generate(prompts, options)
            faulthandler.cancel_dump_traceback_later()
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            answer("ok", batch, peak)
        except Exception as e:
            faulthandler.cancel_dump_traceback_later()
            answer("error", f"{type(e).__name__}: {e}", 0.0)


if __name__ == "__main__":
    multiprocessing.current_process().authkey = bytes.fromhex(os.environ.pop(AUTHKEY))
    serve(Connection(int(sys.argv[1])))
