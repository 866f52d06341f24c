"""Run untrusted programs, with tests or on their own, in sandboxed worker processes, in parallel.

    pool = SandboxPool(SandboxOptions(timeout_seconds=5.0), num_workers=2)
    pool.run([("def f(): return 1", ["assert f() == 1", "assert f() == 2"])])[0].passed   # [True, False]
    pool.execute(["print(6 * 7)", "1 / 0"])
    # [ExecResult(status='ok', stdout='42\\n', error=''),
    #  ExecResult(status='error', stdout='', error='ZeroDivisionError: division by zero')]

Each worker is a pre-warmed `python -I -S -B` interpreter (`sandbox_worker.py`) started with an empty environment,
inside new user, network, PID and mount namespaces when the kernel permits (`sandbox_setup.py`); it forks per
job, so starting a job costs a fork rather than an interpreter start. The pool is thread-safe: callers in several
threads share its workers, each job going to the next free one. What is and is not isolated is in
docs/rewards.md; `pool.features` says which kernel features this machine granted.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

WORKER = Path(__file__).with_name("sandbox_worker.py")
SETUP = Path(__file__).with_name("sandbox_setup.py")


@dataclass(frozen=True)
class SandboxOptions:
    """Limits of one job (a program and its tests, or a program alone)."""

    timeout_seconds: float = 5.0  # wall time for the program and all its tests; then the process group is killed
    cpu_seconds: int | None = None  # RLIMIT_CPU; default: ceil(timeout_seconds)
    memory_mb: int = 1024  # RLIMIT_AS (address space)
    output_kb: int = 1024  # stdout+stderr go to a file of at most this size (RLIMIT_FSIZE), never to the trainer
    max_open_files: int = 64  # RLIMIT_NOFILE

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_seconds, (int, float)) and 0 < self.timeout_seconds <= 3600):
            raise ValueError(f"sandbox timeout_seconds must be in (0, 3600], got {self.timeout_seconds!r}")
        for name in ("memory_mb", "output_kb", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"sandbox {name} must be a positive int, got {value!r}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox memory_mb={self.memory_mb} is too small for a Python interpreter; use >= 64")

    def job(self, program: str, tests: list[str] | None) -> dict:
        cpu = self.cpu_seconds if self.cpu_seconds is not None else max(1, int(-(-self.timeout_seconds // 1)))
        return {"program": program, "tests": tests, "timeout": self.timeout_seconds, "cpu": cpu,
                "memory_mb": self.memory_mb, "output_kb": self.output_kb, "files": self.max_open_files}


@dataclass
class SandboxResult:
    passed: list[bool]  # [n_tests] True where the test ran and its token reached the worker
    status: str  # ok | timeout | killed (a limit or the program ended the process) | crashed (worker died)

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


@dataclass
class ExecResult:
    """How a program run by `SandboxPool.execute` ended."""

    status: Literal["ok", "error", "timeout", "memory", "output_limit", "crashed"]
    stdout: str  # what it wrote to stdout and stderr, in order, at most options.output_kb (invalid UTF-8 replaced)
    error: str  # the last line(s) of the exception's traceback, or a short reason; "" when ok


@dataclass
class _Worker:
    proc: subprocess.Popen


class SandboxPool:
    """`num_workers` sandbox workers (default: CPU count) running jobs in parallel for any number of calling
    threads; a worker that dies is restarted, and its job reports `crashed`."""

    def __init__(self, options: SandboxOptions | None = None, num_workers: int | None = None, *,
                 namespaces: bool = True) -> None:
        self.options = options or SandboxOptions()
        self.namespaces = namespaces  # False: rlimits, uid and audit hook only (what a kernel without them gets)
        n = num_workers if num_workers is not None else (os.cpu_count() or 1)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"sandbox num_workers must be a positive int, got {num_workers!r}")
        self.num_workers = n
        self._workers: list[_Worker | None] = [None] * n
        self._threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.features: list[str] = []
        atexit.register(self.close)

    def run(self, jobs: list[tuple[str, list[str]]]) -> list[SandboxResult]:
        """Run (program, tests) jobs: each test runs after the program, in a namespace of its own. One result
        per job, in order."""
        specs = [self.options.job(program, list(tests)) for program, tests in jobs]
        results = []
        for spec, reply in zip(specs, self._gather(specs)):
            n = len(spec["tests"])
            if reply is None:
                results.append(SandboxResult([False] * n, "crashed"))
            else:
                passed = set(reply["passed"])
                results.append(SandboxResult([i in passed for i in range(n)], reply["status"]))
        return results

    def execute(self, programs: list[str]) -> list[ExecResult]:
        """Run each program once, top to bottom, under the same confinement as `run`; one result each, in order."""
        if isinstance(programs, str) or not all(isinstance(p, str) for p in programs):
            raise TypeError("SandboxPool.execute takes a list of program sources (str), e.g. execute(['print(1)'])")
        replies = self._gather([self.options.job(program, None) for program in programs])
        return [ExecResult("crashed", "", "the sandbox worker died") if r is None
                else ExecResult(r["status"], r["stdout"], r["error"]) for r in replies]

    def _gather(self, specs: list[dict]) -> list[dict | None]:
        futures = []
        with self._lock:
            if os.getpid() != self._pid:  # a forked copy of a pool: its workers and threads are the parent's
                self._threads, self._pid = [], os.getpid()
            if not self._threads:  # a new set of threads, each with a worker, on a new queue
                self._queue, self._workers = queue.SimpleQueue(), [None] * self.num_workers
                self._threads = [threading.Thread(target=self._serve, args=(slot, self._queue, self._workers),
                                                  daemon=True, name=f"sandbox-{slot}")
                                 for slot in range(self.num_workers)]
                for t in self._threads:
                    t.start()
            for spec in specs:
                futures.append(Future())
                self._queue.put((spec, futures[-1]))
        return [f.result() for f in futures]

    def _serve(self, slot: int, jobs: queue.SimpleQueue, workers: list[_Worker | None]) -> None:
        """One worker's thread: take the next job of any caller, run it in workers[slot], hand back the reply."""
        while (item := jobs.get()) is not None:
            spec, future = item
            try:
                future.set_result(self._run_one(workers, slot, spec))
            except BaseException as e:  # the worker could not start: the caller sees why
                future.set_exception(e)
        worker, workers[slot] = workers[slot], None
        if worker is not None and worker.proc.poll() is None:
            worker.proc.stdin.close()  # the worker removes its temporary directories and exits
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(worker.proc)

    def _start(self) -> _Worker:
        if self.namespaces:
            command = [sys.executable, "-I", "-S", "-B", str(SETUP), str(WORKER)]
        else:
            command = [sys.executable, "-I", "-S", "-B", str(WORKER)]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env={}, cwd="/", close_fds=True, start_new_session=True)
        hello = _receive(proc, 60.0)
        if hello is None or not hello.get("ready"):
            _kill(proc)
            raise RuntimeError(f"the sandbox worker ({WORKER}) did not start with {sys.executable}")
        self.features = list(hello["features"])
        return _Worker(proc)

    def _run_one(self, workers: list[_Worker | None], slot: int, job: dict) -> dict | None:
        worker = workers[slot]
        if worker is None or worker.proc.poll() is not None:
            if worker is not None:
                _kill(worker.proc)  # its PID-1 server may outlive it
            worker = workers[slot] = self._start()
        data = json.dumps(job).encode()
        try:
            worker.proc.stdin.write(struct.pack(">I", len(data)) + data)
            worker.proc.stdin.flush()
            reply = _receive(worker.proc, job["timeout"] + 10.0)
        except (BrokenPipeError, OSError):
            reply = None
        if reply is None:  # the worker died or hung: replace it
            _kill(worker.proc)
            workers[slot] = None
        return reply

    def close(self) -> None:
        """Stop the workers (they remove their temporary directories). The pool starts them again if used."""
        with self._lock:
            if os.getpid() != self._pid:
                return
            threads, self._threads = self._threads, []
            for _ in threads:  # after the jobs already queued
                self._queue.put(None)
        for t in threads:
            t.join()


def _kill(proc: subprocess.Popen) -> None:
    """Kill a worker and its PID-1 server (one process group: the worker leads its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _receive(proc: subprocess.Popen, timeout: float) -> dict | None:
    """One length-prefixed JSON message from the worker, or None on EOF / timeout."""
    fd, deadline, buf = proc.stdout.fileno(), time.monotonic() + timeout, b""
    need = 4
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, need - len(buf))
        if not chunk:
            return None
        buf += chunk
        if need == 4 and len(buf) == 4:
            need = 4 + struct.unpack(">I", buf)[0]
    return json.loads(buf[4:])
