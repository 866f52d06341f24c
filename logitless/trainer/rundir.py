"""The run folder (`train.output_dir`) as a unit that only its owner writes.

`claim_run_dir(cfg, resume=..., overwrite=...)` runs before the model is loaded and:
- takes an exclusive lock (`fcntl.flock` on `<run>/.lock`, which records the owner's pid, host and command). The
  kernel drops the lock when its process dies, so a lock left by a crashed or killed run is stale and is taken
  over; a live owner is named in the error;
- refuses a new run into a folder that already holds a run, unless `--resume` (continue it) or `--overwrite`
  (replace it); nothing of an old run is deleted without `--overwrite`, and a folder holding files that no run
  writes is never cleared. A run that saved no checkpoint (it failed early: nothing to resume) is taken over by a
  new run as if `--overwrite` were given, with a warning;
- a new run that ends before finishing its first step removes what it wrote (its config, an empty metrics.jsonl),
  so a failure before step 1 leaves no debris;
- `--overwrite` moves the old run aside into `<run>/.replaced-<time>/` and deletes it only once the new run has
  finished its first step (`RunDir.first_step_done`). A new run that ends before that (an error, a stop signal)
  puts the old run back (`RunDir.release`, with a warning); one that was killed leaves it for the next claim of
  the folder, which puts it back first. Every move is a rename inside the run folder;
- for `--resume`, continues in the run folder of the checkpoint, recorded as an absolute path (a warning says so
  when `train.output_dir` names another folder), resolves the newest intact checkpoint, checks `metrics.jsonl`,
  and compares the config with the run's own (`runconfig.py`): a change of what is trained is refused unless
  allowed (`--allow-config-change`), and then saved beside the run's config, which is kept.

While the run trains, `RunDir.check_alive` (every step, before anything is written) stops it with an error
naming the folder when the folder was removed, moved or made unwritable.
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
from logitless.trainer.config.schema import ConfigError, TrainerConfig, load_train_config, to_yaml
from logitless.trainer.report.metrics import METRICS_FILE, check_metrics_file
from logitless.trainer.report.traces import TRACES_FILE
from logitless.trainer.config.files import (
    CHANGED_CONFIG_PREFIX,
    CHANGED_CONFIG_SUFFIX,
    changed_config_name,
    changes_training,
    config_differences,
    current_config,
    describe,
)

LOCK_FILE = ".lock"
# What a `logitless train` run writes into its folder (and config.from-step-N.yaml); only these are replaced by
# --overwrite.
RUN_FILES = ("config.yaml", "resolved.json", "metrics.jsonl", "checkpoints", "tensorboard", "curves.png", LOCK_FILE,
             "wandb", "trackers.json", "export", TRACES_FILE)
# --overwrite's folders inside the run folder: the old run set aside, being put back, being deleted
REPLACED, RESTORING, DISCARDED, PARTIAL = ".replaced-", ".restoring-", ".discarded-", ".partial"
BOOKKEEPING = (REPLACED, RESTORING, DISCARDED)


def is_run_file(name: str) -> bool:
    """A file or folder a run writes into its run folder."""
    return name in RUN_FILES or (name.startswith(CHANGED_CONFIG_PREFIX) and name.endswith(CHANGED_CONFIG_SUFFIX))


class RunDirError(RuntimeError):
    """The run folder cannot be used as asked (in use, holds another run, not writable)."""


@dataclass
class RunDir:
    cfg: TrainerConfig  # the config with train.output_dir made absolute (the resumed run's folder on --resume)
    path: Path  # absolute run folder
    resume_from: Path | None  # intact checkpoint folder to continue from (--resume), else None
    _fd: int | None = None
    replaced: Path | None = None  # --overwrite: the old run, set aside until the new one finishes a step
    config_file: Path | None = None  # where the run's config is written when it starts (None: it is unchanged)
    config_note: str | None = None  # what changed (--allow-config-change), said when the run starts
    new_run: bool = False  # a run started anew (not --resume): what it wrote goes if it ends before its first step
    stepped: bool = False  # the run finished a step

    def save_config(self, cfg: TrainerConfig) -> None:
        """Write the run's config into `config_file` (atomically), and say what changed."""
        if self.config_file is not None:
            write_atomic(self.config_file, to_yaml(cfg))

    def first_step_done(self) -> None:
        """The new run finished a step: the old run it replaces (--overwrite) is deleted."""
        self.stepped = True
        if self.replaced is not None:
            doomed = self.path / (DISCARDED + self.replaced.name[len(REPLACED):])
            os.rename(self.replaced, doomed)  # first out of the way, so a crash here never puts it back
            self.replaced = None
            shutil.rmtree(doomed, ignore_errors=True)

    def _lost(self) -> str | None:
        """How the claimed folder was lost since the claim (removed, replaced, unwritable), or None."""
        if self._fd is None:
            return None
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path / LOCK_FILE)
        except OSError:
            now = None
        if held.st_nlink == 0 or now is None:
            return "was removed (or moved away)"
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return "was replaced by another folder"
        if not os.access(self.path, os.W_OK | os.X_OK):
            return "is no longer writable"
        return None

    def check_alive(self) -> None:
        """Raise RunDirError naming the folder when it was removed, moved, replaced or made unwritable since the
        claim (nothing this run writes could be kept there)."""
        why = self._lost()
        if why is None:
            return
        if why == "is no longer writable":
            name = newest_checkpoint_name(self.path)
            then = (f"make it writable again (chmod u+w {self.path}) and continue from its checkpoint {name} with: "
                    f"logitless train --resume {self.path}" if name is not None else
                    "make it writable again and start again with the same command (no checkpoint was saved)")
        else:
            then = "if you moved it, continue it from its new place with --resume <folder>; otherwise start again"
        raise RunDirError(
            f"the run folder {self.path} (train.output_dir) {why} while the run was training; stopping now, since "
            f"its metrics and checkpoints can no longer be written there. To go on, {then}"
        )

    def release(self) -> None:
        """Put back an old run that --overwrite set aside if the new run never finished a step (with a warning), or
        remove what a new run that never finished a step wrote into its folder (its config, an empty metrics.jsonl,
        a tracker's folder: no debris that a rerun would take for a run); then give up the lock (the lock file
        stays: unlinking it would let two later runs lock different files)."""
        try:
            if self.replaced is not None and self.replaced.is_dir():
                replaced, self.replaced = self.replaced, None
                _put_back(self.path, replaced)
                warnings.warn(f"--overwrite: the new run ended before finishing its first step, so the run it was "
                              f"to replace is back in {self.path}, as it was", stacklevel=2)
            elif self.new_run and not self.stepped and self._lost() is None:  # (never in a folder not ours)
                for e in list(self.path.iterdir()):
                    if is_run_file(e.name) and e.name != LOCK_FILE:
                        try:
                            shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
                        except OSError:  # best effort: the error that ended the run is the one to report
                            pass
        finally:
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


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` or its previous content, never a part (a temp file in the same folder, fsync, rename)."""
    tmp = path.with_name(f"{ckpt.TMP_PREFIX}{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _set_aside(path: Path, entries: list[Path]) -> Path:
    """Move the old run's `entries` into `<run>/.replaced-<time>` (complete once that name exists)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    partial = path / f"{REPLACED}{stamp}{PARTIAL}"
    partial.mkdir()
    for e in entries:
        os.rename(e, partial / e.name)
    aside = path / f"{REPLACED}{stamp}"
    os.rename(partial, aside)
    return aside


def _put_back(path: Path, aside: Path) -> None:
    """The new run's files go (into `.discarded-*`, then deleted), then the set-aside old run's come back; each
    phase is marked by a folder name, so that a crash at any point is finished by the next claim (`_recover`)."""
    stamp = aside.name[len(REPLACED):]
    discard = path / f"{DISCARDED}{stamp}"
    shutil.rmtree(discard, ignore_errors=True)
    discard.mkdir()
    for e in list(path.iterdir()):
        if is_run_file(e.name) and e.name != LOCK_FILE:
            os.rename(e, discard / e.name)
    restoring = path / f"{RESTORING}{stamp}"
    os.rename(aside, restoring)
    _finish_put_back(path, restoring)


def _finish_put_back(path: Path, restoring: Path) -> None:
    for e in list(restoring.iterdir()):
        if not (path / e.name).exists():
            os.rename(e, path / e.name)
    shutil.rmtree(restoring)
    for d in path.glob(f"{DISCARDED}*"):
        shutil.rmtree(d, ignore_errors=True)


def _recover(path: Path) -> None:
    """Finish what an earlier owner of the folder left half done: an --overwrite whose new run never finished a
    step (its old run is put back, with a warning), a put-back or a deletion cut short, a config being written."""
    for p in sorted(path.iterdir()):
        name = p.name
        if name.startswith(REPLACED) and name.endswith(PARTIAL):  # the claim stopped while setting aside
            for e in list(p.iterdir()):
                os.rename(e, path / e.name)
            p.rmdir()
        elif name.startswith(REPLACED):
            _put_back(path, p)
            warnings.warn(f"{path}: an earlier --overwrite of this folder stopped before its new run finished a step; "
                          "the run it was to replace was put back", stacklevel=3)
        elif name.startswith(RESTORING):
            _finish_put_back(path, p)
        elif name.startswith(DISCARDED):
            shutil.rmtree(p, ignore_errors=True)
        elif name.startswith(ckpt.TMP_PREFIX) and p.is_file():  # a config being written (`write_atomic`)
            p.unlink()


def newest_checkpoint_name(path: Path) -> str | None:
    """The name of the checkpoint run folder `path` would resume from (its `latest`, else its newest step folder;
    intact or not), or None when it holds none."""
    root = path / "checkpoints"
    try:
        latest = ckpt.read_latest(root)
    except ckpt.CheckpointError:  # a damaged pointer: resume falls back to an intact step folder, if any
        latest = None
    steps = sorted(p.name for p in root.glob(ckpt.STEP_PREFIX + "*") if p.is_dir()) if root.is_dir() else []
    return latest.name if latest is not None else (steps[-1] if steps else None)


def restart_advice(path: str | Path | None) -> str:
    """What to run after a run in folder `path` stopped: --resume when it has a checkpoint, else how to start
    again (no --resume that would fail; a folder without a checkpoint is taken over by the same command)."""
    if path is None:
        return "nothing was written"
    name = newest_checkpoint_name(Path(path))
    if name is not None:
        return f"the run keeps its checkpoint {name}; continue it with: logitless train --resume {path}"
    return "no checkpoint was saved, so there is nothing to resume: start again with the same command"


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


def _check_fresh(path: Path, overwrite: bool) -> Path | None:
    """Refuse a new run into a folder that holds an earlier run (or foreign files); on --overwrite set the earlier
    run aside (returned) until the new one has finished a step."""
    entries = [e for e in path.iterdir() if e.name != LOCK_FILE]
    if not entries:
        return None
    foreign = sorted(e.name for e in entries if not is_run_file(e.name))
    if foreign:
        raise RunDirError(
            f"train.output_dir={str(path)!r} holds files that no logitless run writes ({', '.join(foreign[:5])}); "
            "nothing was changed. Set train.output_dir=<a new or empty folder>"
        )
    if not overwrite and newest_checkpoint_name(path) is None:  # nothing to resume: a run that ended early
        warnings.warn(f"train.output_dir={str(path)!r} holds a run that saved no checkpoint "
                      f"({_describe(path, entries)}); starting anew there: its files are replaced once this run "
                      "finishes its first step (and put back if it does not)", stacklevel=3)
    elif not overwrite:
        raise RunDirError(
            f"train.output_dir={str(path)!r} already holds a run ({_describe(path, entries)}); nothing was changed. "
            f"Continue it with --resume {path}, replace it with --overwrite, or set train.output_dir=<a new folder>"
        )
    return _set_aside(path, entries)


def _plan_config(run: RunDir, step: int, allow_change: bool) -> None:
    """On resume: compare the config with the run's own (its current config file, else the checkpoint's copy) and
    decide where the config is written (`RunDir.config_file`): nowhere when equal; in place when only keys that
    may change freely changed; a new `config.from-step-N.yaml` beside the kept one when training changes, which
    needs `allow_change` (else RunDirError listing the changes). Model weight keys are left to `check_resume`."""
    from logitless.trainer.preflight import WEIGHT_KEYS

    current = current_config(run.path)
    copy = run.resume_from / ckpt.RUN_CONFIG if run.resume_from is not None else None
    baseline = current or (copy if copy is not None and copy.is_file() else None)
    if baseline is None:  # nothing to compare with: the given config becomes the run's
        run.config_file = run.path / ckpt.RUN_CONFIG
        return
    try:
        saved = _absolute_paths(load_train_config(baseline), run.path)
    except ConfigError as e:
        raise RunDirError(f"{baseline} (the config the run was trained with) is not a valid config: {e}. Fix that "
                          "file, or continue the run with a config file of your own and --allow-config-change") from e
    diffs = config_differences(saved, run.cfg)
    training = [d for d in diffs if changes_training(d[0], run.cfg)]
    if any(k in {f"model.{w}" for w in WEIGHT_KEYS} for k, _, _ in training):
        return  # check_resume names them: the checkpoint's weights cannot change
    if not training:
        run.config_file = (current or run.path / ckpt.RUN_CONFIG) if diffs or current is None else None
        return
    new = run.path / changed_config_name(step + 1)
    if not allow_change:
        raise RunDirError(
            f"--resume {run.path}: this config changes what the run trains, against its own config "
            f"({baseline.name}):{describe(training)}\nSteps from {step + 1} on would train unlike steps 1-{step}. "
            f"To continue with these settings anyway, add --allow-config-change ({baseline.name} is kept as it is; "
            f"the new config is saved beside it as {new.name}). Otherwise drop these changes (what may change "
            "freely: train.max_steps, train.max_minutes, logging.*, checkpoint.*, eval.* and a few more)"
        )
    run.config_file = new
    run.config_note = (f"--allow-config-change: from step {step + 1} on the run trains with changed settings, saved "
                       f"as {new.name} ({baseline.name} is kept):{describe(training)}")


def claim_run_dir(cfg: TrainerConfig, *, resume: str | Path | None = None, overwrite: bool = False,
                  allow_config_change: bool = False) -> RunDir:
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
        _recover(path)
        if resume is None:
            run.replaced = _check_fresh(path, overwrite)
            run.config_file = path / ckpt.RUN_CONFIG
            run.new_run = True
        else:
            ckpt.clean_temporaries(path / "checkpoints")
            given = Path(resume)
            if not given.name.startswith(ckpt.STEP_PREFIX) and newest_checkpoint_name(path) is None:
                raise ckpt.CheckpointError(
                    f"--resume {str(resume)!r}: the run in {path} saved no checkpoint, so there is nothing to resume; "
                    f"start it anew with the same command without --resume (a run folder with no checkpoint is "
                    "taken over)")
            run.resume_from = ckpt.resolve_checkpoint(given if given.name.startswith(ckpt.STEP_PREFIX) else path)
            check_metrics_file(path / METRICS_FILE)  # a damaged record, found before the model loads
            _plan_config(run, ckpt.checkpoint_step(run.resume_from), allow_config_change)
    except BaseException:
        run.release()
        raise
    return run
