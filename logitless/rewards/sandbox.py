"""Run untrusted programs with their tests in sandboxed worker processes, a batch in parallel.

    pool = SandboxPool(SandboxOptions(timeout_seconds=5.0), num_workers=2)
    results = pool.run([("def f(): return 1", ["assert f() == 1", "assert f() == 2"])])   # [SandboxResult]
    results[0].passed  # [True, False]

Each worker is a pre-warmed `python -I -S -B` interpreter (`sandbox_worker.py`) started with an empty
environment; it forks per job, so starting a job costs two forks rather than an interpreter start. What is and
is not isolated is in docs/rewards.md; `pool.features` says which kernel features this machine granted.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("sandbox_worker.py")


@dataclass(frozen=True)
class SandboxOptions:
    """Limits of one job (a program and its tests)."""

    timeout_seconds: float = 5.0  # wall time for the program and all its tests; then the process group is killed
    cpu_seconds: int | None = None  # RLIMIT_CPU; default: ceil(timeout_seconds)
    memory_mb: int = 1024  # RLIMIT_AS (address space)
    output_kb: int = 1024  # RLIMIT_FSIZE: stdout/stderr go to a file of at most this size, never to the trainer
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

    def job(self, program: str, tests: list[str]) -> dict:
        cpu = self.cpu_seconds if self.cpu_seconds is not None else max(1, int(-(-self.timeout_seconds // 1)))
        return {"program": program, "tests": tests, "timeout": self.timeout_seconds, "cpu": cpu,
                "memory_mb": self.memory_mb, "output_kb": self.output_kb, "files": self.max_open_files}


@dataclass
class SandboxResult:
    passed: list[bool]  # [n_tests] True where the test ran and reported success through the worker's channel
    status: str  # ok | timeout | killed (a limit or the program ended the process) | crashed (worker died)

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


@dataclass
class _Worker:
    proc: subprocess.Popen
    features: list[str] = field(default_factory=list)


class SandboxPool:
    """`num_workers` sandbox workers (default: CPU count) scoring jobs in parallel; a worker that dies is
    restarted, and its job scores 0."""

    def __init__(self, options: SandboxOptions | None = None, num_workers: int | None = None, *,
                 namespaces: bool = True) -> None:
        self.options = options or SandboxOptions()
        self.namespaces = namespaces  # False: rlimits, uid and audit hook only (what a kernel without them gets)
        n = num_workers if num_workers is not None else (os.cpu_count() or 1)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"sandbox num_workers must be a positive int, got {num_workers!r}")
        self.num_workers = n
        self._workers: list[_Worker | None] = [None] * n
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.features: list[str] = []
        atexit.register(self.close)

    def _start(self) -> _Worker:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(WORKER)] + ([] if self.namespaces else ["--no-namespaces"]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env={}, cwd="/", close_fds=True, start_new_session=True,
        )
        hello = _receive(proc, 60.0)
        if hello is None or not hello.get("ready"):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the sandbox worker ({WORKER}) did not start with {sys.executable}")
        self.features = list(hello["features"])
        return _Worker(proc, self.features)

    def _run_one(self, slot: int, job: dict) -> SandboxResult:
        n = len(job["tests"])
        worker = self._workers[slot]
        if worker is None or worker.proc.poll() is not None:
            worker = self._workers[slot] = self._start()
        data = json.dumps(job).encode()
        try:
            worker.proc.stdin.write(struct.pack(">I", len(data)) + data)
            worker.proc.stdin.flush()
            reply = _receive(worker.proc, job["timeout"] + 10.0)
        except (BrokenPipeError, OSError):
            reply = None
        if reply is None:  # the worker died or hung: replace it; this job scores 0
            worker.proc.kill()
            worker.proc.wait()
            self._workers[slot] = None
            return SandboxResult([False] * n, "crashed")
        passed = set(reply["passed"])
        return SandboxResult([i in passed for i in range(n)], reply["status"])

    def run(self, jobs: list[tuple[str, list[str]]]) -> list[SandboxResult]:
        """Run (program, tests) jobs in parallel over the workers; one result per job, in order."""
        if os.getpid() != self._pid:  # forked copy of a pool: its workers belong to the parent
            self._workers, self._pid = [None] * self.num_workers, os.getpid()
        results: list[SandboxResult | None] = [None] * len(jobs)
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i, (program, tests) in enumerate(jobs):
            todo.put((i, self.options.job(program, list(tests))))

        def drain(slot: int) -> None:
            while True:
                try:
                    i, job = todo.get_nowait()
                except queue.Empty:
                    return
                results[i] = self._run_one(slot, job)

        with self._lock:
            threads = [threading.Thread(target=drain, args=(s,), daemon=True)
                       for s in range(min(self.num_workers, len(jobs)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers (they remove their temporary directories)."""
        for i, w in enumerate(self._workers):
            if w is not None and w.proc.poll() is None and os.getpid() == self._pid:
                w.proc.stdin.close()
                try:
                    w.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
            self._workers[i] = None


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
