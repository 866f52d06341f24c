"""Atomic training checkpoints: model (adapter or full, via `save_pretrained`), optimizer, scheduler, RNG, state.

Layout under `<output_dir>/checkpoints/`:

    step-000020/
        model/             save_pretrained output: adapter_model.safetensors (LoRA) or model.safetensors
        optimizer.pt       {"optimizer": ..., "scheduler": ...} state dicts (torch.save)
        rng.pt             torch CPU (and CUDA) generator states
        trainer_state.json step, data sampler position, python/numpy RNG, anything else the loop stores
        config.yaml        copy of the run's current config (`current_config`): what the weights were trained with
        manifest.json      size and sha256 of every other file: a checkpoint checks itself before it is loaded
    latest                 text file holding the name of the newest complete checkpoint ("step-000020")

A checkpoint is written into a hidden temp folder, every file is fsync'ed, the folder is renamed into place and
only then is `latest` replaced (write `latest.tmp`, fsync, `os.replace`). A crash or a full disk at any point
leaves the previous checkpoint as `latest`, intact; a failed or interrupted save removes its temp folder (a crash
leaves it to the next save, or to `clean_temporaries`) and says why in one line. Loading resolves `latest`, checks
the manifest and falls back to the newest valid checkpoint, with a warning naming the bad file, when the latest one
(or the `latest` pointer itself) is damaged.

A checkpoint copies the run's current config (`runconfig.current_config`: config.yaml, or the newest
config.from-step-N.yaml a resume with changed settings wrote beside it).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from logitless.trainer.policy.modeling import is_peft_model
from logitless.trainer.config.files import RUN_CONFIG, current_config

LATEST = "latest"
STEP_PREFIX = "step-"
MANIFEST = "manifest.json"
TMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"  # a folder being written; a re-saved step's previous folder


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def _open_for_write(path: Path):
    """Open a checkpoint file for writing (a separate function so tests can inject a full disk)."""
    return open(path, "wb")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(Path(dirpath) / name, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _serialized(obj: Any) -> bytes:
    """torch.save into memory, so that an OS error of the file write (ENOSPC) surfaces as itself."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_file(path: Path, write: Callable[[Any], None]) -> None:
    with _open_for_write(path) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------
# RNG state


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able python/numpy RNG state, torch generator states)."""
    np_state = np.random.get_state()
    py = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    return py, tensors


def set_rng_state(py: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    v, state, gauss = py["python"]
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = py["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


# ----------------------------------------------------------------------------------------------------------
# Save


def _pointer(pointer: Path) -> tuple[str, str | None]:
    """(the name `latest` holds, what is wrong with the file or None); ("", None) when there is none."""
    if not pointer.is_file():
        return "", None
    raw = pointer.read_bytes()
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return "", f"{pointer} is not a checkpoint name (undecodable bytes {raw[:20]!r})"
    if "/" in name or "\\" in name or name in (".", ".."):
        return "", f"{pointer} names {name[:80]!r}, which is not a checkpoint folder name"
    return name, None if name else f"{pointer} is empty"


def read_latest(root: str | Path) -> Path | None:
    """The checkpoint `root/latest` names (`root` is the `checkpoints` folder), or None without a pointer."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name, bad = _pointer(pointer)
    if bad is not None:
        raise CheckpointError(bad)
    path = root / name
    if not name or not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{pointer} names '{name}', which is not a complete checkpoint in {root}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under `folder` except the manifest itself."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}


def validate_checkpoint(path: str | Path) -> str | None:
    """None when checkpoint folder `path` is complete and intact, else what is wrong, naming the file.

    Checks every file of its manifest (size, then sha256); a checkpoint written before manifests existed is only
    checked for its trainer_state.json.
    """
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        return f"{path / 'trainer_state.json'} is missing"
    if not (path / MANIFEST).is_file():
        return None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"{path / MANIFEST} is unreadable ({e})"
    for rel, want in manifest.items():
        f = path / rel
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != want["size"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if _sha256(f) != want["sha256"]:
            return f"{f} does not match its checksum in {MANIFEST} (corrupted)"
    return None


def clean_temporaries(root: str | Path) -> list[str]:
    """Remove what an interrupted save left in `root` (temp folders, `latest.tmp`); return their names.

    A re-saved step whose old folder was moved aside (`.old-step-N-PID`) but whose new folder never arrived is
    moved back. Only the owner of the run folder may call this (another process may be saving right now).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(OLD_PREFIX) and p.is_dir():
            step_name = p.name[len(OLD_PREFIX):].rsplit("-", 1)[0]
            if not (root / step_name).exists() and validate_checkpoint(p) is None:
                os.rename(p, root / step_name)
                removed.append(f"{p.name} (restored as {step_name})")
                continue
        if p.name.startswith((TMP_PREFIX, OLD_PREFIX)) or p.name == LATEST + ".tmp":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p.name)
    return removed


def _write_files(tmp: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any, state: dict[str, Any],
                 torch_rng: Any, run_config: Path) -> None:
    """Every file of a checkpoint into the new folder `tmp`: model (or adapters), optimizer and schedule, RNG,
    trainer state, the run's config, then the manifest of them all; synced to disk."""
    tmp.mkdir()
    extra = {"save_embedding_layers": False} if is_peft_model(model) else {}  # adapters only, no vocab probe
    model.save_pretrained(str(tmp / "model"), safe_serialization=True, **extra)
    opt = {"optimizer": optimizer.state_dict() if optimizer is not None else None}
    opt["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    _write_file(tmp / "optimizer.pt", lambda f: f.write(_serialized(opt)))
    _write_file(tmp / "rng.pt", lambda f: f.write(_serialized(torch_rng)))
    text = json.dumps(state, indent=1).encode()
    _write_file(tmp / "trainer_state.json", lambda f: f.write(text))
    if run_config.is_file():
        config = run_config.read_bytes()
        _write_file(tmp / RUN_CONFIG, lambda f: f.write(config))
    manifest = json.dumps(_manifest(tmp), indent=1).encode()
    _write_file(tmp / MANIFEST, lambda f: f.write(manifest))
    _fsync_tree(tmp)


def check_finite_weights(model: torch.nn.Module, step: int) -> None:
    """Raise CheckpointError when a trained parameter holds nan or inf: such weights are never saved (a resume
    would load them, and every later sample would be garbage)."""
    bad = [name for name, p in model.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]
    if bad:
        raise CheckpointError(
            f"checkpoint {step_dirname(step)} not written: {len(bad)} trained tensor(s) hold nan or inf (e.g. "
            f"{bad[0]}); the weights diverged (lower optim.learning_rate, keep optim.max_grad_norm set). The previous "
            "checkpoint stays the latest; resume from it with a lower learning rate"
        )


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    trainer_state: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint `step` atomically under `root` and point `root/latest` at it; return its folder.

    `trainer_state` must be JSON-serializable. `keep` prunes older `step-*` folders beyond the newest `keep`.
    On any error (e.g. ENOSPC) the temp folder is removed and `CheckpointError` is raised; `latest` is unchanged.
    Leftovers of an earlier interrupted save are removed first.
    """
    root = Path(root)
    check_finite_weights(model, step)
    root.mkdir(parents=True, exist_ok=True)
    clean_temporaries(root)
    final = root / step_dirname(step)
    tmp = root / f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}"
    py_rng, torch_rng = rng_state()
    state = {"step": step, "rng": py_rng, **(trainer_state or {})}
    old = None
    try:
        config = current_config(root.parent) or root.parent / RUN_CONFIG
        _write_files(tmp, model, optimizer, scheduler, state, torch_rng, config)
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
            old = root / f"{OLD_PREFIX}{final.name}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        pointer_tmp = root / (LATEST + ".tmp")
        _write_file(pointer_tmp, lambda f: f.write(final.name.encode()))
        os.replace(pointer_tmp, root / LATEST)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except KeyboardInterrupt:  # a stop-at-once signal: leave no half-written folder behind
        _undo_save(root, tmp, final, old)
        raise
    except Exception as e:  # any error of any writer (torch, safetensors, json, the OS) is one clear line
        _undo_save(root, tmp, final, old)
        try:
            prev = read_latest(root)
        except CheckpointError:
            prev = None
        code = _errno(e)
        full = code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise CheckpointError(
            f"could not write checkpoint {final.name} in {root}: {failure_reason(e)}. "
            + (f"The previous checkpoint {prev.name} is still the latest." if prev else "No earlier checkpoint exists.")
            + (" Free space on that disk (or lower checkpoint.save_total_limit)." if full else "")
        ) from e
    if keep is not None:
        prune(root, keep)
    return final


def _undo_save(root: Path, tmp: Path, final: Path, old: Path | None) -> None:
    """What a failed save wrote goes; `latest` keeps naming a complete checkpoint."""
    shutil.rmtree(tmp, ignore_errors=True)
    (root / (LATEST + ".tmp")).unlink(missing_ok=True)
    if old is not None and old.exists():  # a re-save: keep exactly one complete version of the step
        if final.exists():  # the new version is complete and in place (only the pointer write failed)
            shutil.rmtree(old, ignore_errors=True)
        else:  # the previous version goes back where `latest` expects it
            os.rename(old, final)


def _errno(e: BaseException) -> int | None:
    """The OS error number of `e`, also when a library wrapped it in its own text ("... (os error 28)")."""
    code = getattr(e, "errno", None)
    if isinstance(code, int):
        return code
    m = re.search(r"\(os error (\d+)\)", str(e))
    return int(m.group(1)) if m else None


def failure_reason(e: BaseException) -> str:
    """What made a write fail, in a few words: the OS error when there is one (`No space left on device
    (ENOSPC)`), else the exception's type and the first line of its text."""
    code = _errno(e)
    if code:
        return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` step folders (never the one `latest` names)."""
    latest = read_latest(root)
    steps = sorted(p for p in root.glob(STEP_PREFIX + "*") if p.is_dir())
    for p in steps[: max(len(steps) - keep, 0)]:
        if latest is None or p.name != latest.name:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# Load


def _newest_valid(root: Path, flag: str) -> Path:
    """The checkpoint `root/latest` names if it is intact; else the newest intact `step-*` folder, with a warning
    naming what is wrong with the skipped ones."""
    problems = []
    pointer = root / LATEST
    named, bad_pointer = _pointer(pointer)
    if named:
        bad = validate_checkpoint(root / named) if (root / named).is_dir() else f"{root / named} does not exist"
        if bad is None:
            return root / named
        problems.append(f"{pointer} names '{named}', which is not a complete checkpoint: {bad}")
    elif bad_pointer is not None:
        problems.append(bad_pointer)
    for step_dir in sorted((p for p in root.glob(STEP_PREFIX + "*") if p.is_dir()), reverse=True):
        if step_dir.name == named:
            continue
        bad = validate_checkpoint(step_dir)
        if bad is None:
            if problems:
                warnings.warn(
                    f"{flag} {root}: the latest checkpoint is damaged: {'; '.join(problems)}. "
                    f"Falling back to {step_dir.name}, the newest intact checkpoint.",
                    stacklevel=3,
                )
            return step_dir
        problems.append(bad)
    raise CheckpointError(f"{flag} {str(root)!r}: no intact checkpoint: " + "; ".join(problems))


def resolve_checkpoint(path: str | Path, flag: str = "--resume") -> Path:
    """Accept a run folder, its `checkpoints` folder or one `step-*` folder; return an intact checkpoint folder.

    A damaged latest checkpoint falls back to the newest intact one (with a warning); a damaged step folder given
    directly is an error naming the bad file. `flag` names the option the path came from in messages.
    """
    path = Path(path)
    if (path / "trainer_state.json").is_file() or path.name.startswith(STEP_PREFIX):
        bad = validate_checkpoint(path)
        if bad is not None:
            raise CheckpointError(f"{flag} {str(path)!r}: damaged checkpoint: {bad}; give the run folder to use "
                                  "its newest intact checkpoint")
        return path
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file() or any(p.is_dir() for p in root.glob(STEP_PREFIX + "*")):
            return _newest_valid(root, flag)
    raise CheckpointError(
        f"{flag} {str(path)!r}: no checkpoint found (expected a run folder with checkpoints/{LATEST}, a "
        f"checkpoints folder with a '{LATEST}' file, or a {STEP_PREFIX}NNNNNN folder)"
    )


def checkpoint_config(path: str | Path) -> dict[str, Any] | None:
    """The run config (as a dict) checkpoint folder `path` was trained with, or None if it holds none.

    Checkpoints carry a copy of the run's config; older ones fall back to the run folder's current config.
    """
    import yaml

    path = Path(path)
    for f in (path / RUN_CONFIG, current_config(path.parent.parent)):
        if f is not None and f.is_file():
            try:
                loaded = yaml.safe_load(f.read_text())
            except yaml.YAMLError as e:
                raise CheckpointError(f"{f} is not valid YAML: {e}") from e
            return loaded if isinstance(loaded, dict) else None
    return None


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint folder was saved at."""
    f = Path(path) / "trainer_state.json"
    try:
        return int(json.loads(f.read_text())["step"])
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{f} is unreadable ({type(e).__name__}: {e})") from e


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {folder}")
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        sd = _read(folder / "adapter_model.safetensors", lambda f: load_file(str(f)))
        result = set_peft_model_state_dict(model, sd)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise CheckpointError(f"adapter weights in {folder} do not match the model: unexpected {unexpected[:5]}")
        return
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_read(f, lambda f: load_file(str(f))))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ptrs = {params[k].data_ptr() for k in sd if k in params}
    really_missing = [k for k in missing if k not in params or params[k].data_ptr() not in loaded_ptrs]  # not tied
    if unexpected or really_missing:
        raise CheckpointError(
            f"model weights in {folder} do not match the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}"
        )


def _read(path: Path, load: Callable[[Path], Any]) -> Any:
    """load(path), with any error of a damaged file re-raised as a CheckpointError naming the file."""
    try:
        return load(path)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors, zip (torch.load) and JSON errors have no common base class
        raise CheckpointError(f"{path} is damaged or unreadable ({type(e).__name__}: {e})") from e


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load weights, optimizer, scheduler and RNG from checkpoint `path` in place; return the trainer state."""
    path = resolve_checkpoint(path)
    load_model_weights(model, path / "model")
    opt = _read(path / "optimizer.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True))
    if optimizer is not None and opt["optimizer"] is not None:
        optimizer.load_state_dict(opt["optimizer"])
    if scheduler is not None and opt["scheduler"] is not None:
        scheduler.load_state_dict(opt["scheduler"])
    state = _read(path / "trainer_state.json", lambda f: json.loads(f.read_text()))
    if restore_rng:
        set_rng_state(state["rng"], _read(path / "rng.pt", lambda f: torch.load(f, weights_only=True)))
    return state
