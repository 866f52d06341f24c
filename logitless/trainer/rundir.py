"""The run folder (`train.output_dir`) as a unit that only its owner writes.

`claim_run_dir(cfg, resume=..., overwrite=...)` runs before the model is loaded and:
- takes an exclusive lock (`fcntl.flock` on `<run>/.lock`, which records the owner's pid, host and command). The
  kernel drops the lock when its process dies, so a lock left by a crashed or killed run is stale and is taken
  over; a live owner is named in the error;
- refuses a new run into a folder that already holds a run, unless `--resume` (continue it) or `--overwrite`
  (delete the old run's files first); nothing of an old run is deleted without `--overwrite`, and a folder
  holding files that no run writes is never cleared;
- for `--resume`, continues in the run folder of the checkpoint, recorded as an absolute path (a warning says so
  when `train.output_dir` names another folder), and resolves the newest intact checkpoint.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.config import TrainerConfig

LOCK_FILE = ".lock"
# What a `logitless train` run writes into its folder; only these are removed by --overwrite.
RUN_FILES = ("config.yaml", "resolved.json", "metrics.jsonl", "checkpoints", "tensorboard", "curves.png", LOCK_FILE)


class RunDirError(RuntimeError):
    """The run folder cannot be used as asked (in use, holds another run, not writable)."""


@dataclass
class RunDir:
    cfg: TrainerConfig  # the config with train.output_dir made absolute (the resumed run's folder on --resume)
    path: Path  # absolute run folder
    resume_from: Path | None  # intact checkpoint folder to continue from (--resume), else None
    _fd: int | None = None

    def release(self) -> None:
        """Give up the lock (the lock file stays: unlinking it would let two later runs lock different files)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_dir_of_checkpoint(path: str | Path) -> Path:
    """The run folder of a `--resume` path (a run folder, its checkpoints folder or a step folder), absolute."""
    path = Path(path).resolve()
    if (path / "trainer_state.json").is_file() or path.name.startswith(ckpt.STEP_PREFIX):
        return path.parent.parent
    if path.name == "checkpoints" and not (path / "checkpoints").is_dir():
        return path.parent
    return path


def _absolute_paths(cfg: TrainerConfig, run_dir: Path) -> TrainerConfig:
    """`cfg` with train.output_dir = `run_dir` and relative local paths (model folder, data files) made absolute,
    so that the run's config.yaml means the same from any working directory (`--resume` reuses it)."""

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).expanduser().exists():
            return str(Path(value).expanduser().resolve())
        return value

    data = dataclasses.replace(
        cfg.data,
        options={k: absolute(v) if k == "path" else v for k, v in cfg.data.options.items()},
        eval_options={k: absolute(v) if k == "path" else v for k, v in cfg.data.eval_options.items()},
    )
    model = dataclasses.replace(cfg.model, name_or_path=absolute(cfg.model.name_or_path))
    return dataclasses.replace(cfg, model=model, data=data, train=dataclasses.replace(cfg.train, output_dir=str(run_dir)))


def _make_writable_dir(path: Path) -> None:
    """Create `path` (and parents); a clear error naming train.output_dir when that is impossible."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"train.output_dir={str(path)!r} is not a writable folder ({type(e).__name__}: {e.strerror or e}); "
            "set train.output_dir=<a folder you can write to>"
        ) from e


def _refuse_held(fd: int, path: Path) -> NoReturn:
    """RunDirError naming the process that holds the lock of run folder `path` (whose lock file is open as fd)."""
    owner = os.pread(fd, 4096, 0).decode(errors="replace")
    os.close(fd)
    try:
        info = json.loads(owner)
        who = f"process {info['pid']} on {info['host']} ({info['command']}, started {info['started']})"
    except (ValueError, KeyError, TypeError):
        who = "another process"
    raise RunDirError(
        f"train.output_dir={str(path)!r} is in use by {who}; wait for that run to finish or stop it, "
        "or set train.output_dir=<another folder>"
    ) from None


def _lock(path: Path) -> int:
    """Exclusive, non-blocking lock of `path/.lock`; return its fd. Error naming the owner when it is held."""
    lock = path / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if isinstance(e, BlockingIOError):
            _refuse_held(fd, path)
        warnings.warn(f"{lock}: this filesystem does not support locks ({e}); nothing stops a second run from "
                      "writing into this folder", stacklevel=3)
        return fd
    stale = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if stale:  # the holder died without releasing: the kernel already dropped its lock
        warnings.warn(f"{lock}: taking over the stale lock of a run that is no longer running ({stale})", stacklevel=3)
    owner = {
        "pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    return fd


def _describe(path: Path, entries: list[Path]) -> str:
    parts = []
    try:
        latest = ckpt.read_latest(path / "checkpoints")
        if latest is not None:
            parts.append(f"checkpoints up to {latest.name}")
    except ckpt.CheckpointError:
        parts.append("a damaged checkpoints folder")
    if (path / "metrics.jsonl").is_file():
        n = sum(1 for line in (path / "metrics.jsonl").read_text(errors="replace").splitlines() if line.strip())
        parts.append(f"metrics.jsonl with {n} records")
    return ", ".join(parts) or ", ".join(sorted(e.name for e in entries))


def _check_fresh(path: Path, overwrite: bool) -> None:
    """Refuse a new run into a folder that holds an earlier run (or foreign files); clear it on --overwrite."""
    entries = [e for e in path.iterdir() if e.name != LOCK_FILE]
    if not entries:
        return
    foreign = sorted(e.name for e in entries if e.name not in RUN_FILES)
    if foreign:
        raise RunDirError(
            f"train.output_dir={str(path)!r} holds files that no logitless run writes ({', '.join(foreign[:5])}); "
            "nothing was changed. Set train.output_dir=<a new or empty folder>"
        )
    if not overwrite:
        raise RunDirError(
            f"train.output_dir={str(path)!r} already holds a run ({_describe(path, entries)}); nothing was changed. "
            f"Continue it with --resume {path}, replace it with --overwrite, or set train.output_dir=<a new folder>"
        )
    for e in entries:
        shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()


def claim_run_dir(cfg: TrainerConfig, *, resume: str | Path | None = None, overwrite: bool = False) -> RunDir:
    """Lock the run folder of `cfg` (or of the resumed run) for this process and check it may be written.

    Returns the RunDir (a context manager releasing the lock) with the config whose train.output_dir is the
    absolute run folder (and whose local model and data paths are absolute), and on resume the intact
    checkpoint to continue from.
    """
    if resume is not None and overwrite:
        raise RunDirError("--resume continues a run and --overwrite deletes it; give only one of them")
    configured = Path(cfg.train.output_dir).expanduser().resolve()
    path = configured if resume is None else run_dir_of_checkpoint(resume)
    if resume is not None and not path.is_dir():
        raise ckpt.CheckpointError(f"--resume {str(resume)!r}: no such run folder")
    if resume is not None and path != configured:
        warnings.warn(
            f"train.output_dir={cfg.train.output_dir!r} (= {configured}) is not the resumed run's folder; "
            f"continuing in {path}, where the resumed run lives",
            stacklevel=2,
        )
    _make_writable_dir(path)
    fd = _lock(path)
    run = RunDir(cfg=_absolute_paths(cfg, path), path=path, resume_from=None, _fd=fd)
    try:
        if resume is None:
            _check_fresh(path, overwrite)
        else:
            ckpt.clean_temporaries(path / "checkpoints")
            given = Path(resume)
            run.resume_from = ckpt.resolve_checkpoint(given if given.name.startswith(ckpt.STEP_PREFIX) else path)
    except BaseException:
        run.release()
        raise
    return run
