"""Atomic training checkpoints: model (adapter or full, via `save_pretrained`), optimizer, scheduler, RNG, state.

Layout under `<output_dir>/checkpoints/`:

    step-000020/
        model/             save_pretrained output: adapter_model.safetensors (LoRA) or model.safetensors
        optimizer.pt       {"optimizer": ..., "scheduler": ...} state dicts (torch.save)
        rng.pt             torch CPU (and CUDA) generator states
        trainer_state.json step, data sampler position, python/numpy RNG, anything else the loop stores
    latest                 text file holding the name of the newest complete checkpoint ("step-000020")

A checkpoint is written into a hidden temp folder, every file is fsync'ed, the folder is renamed into place and
only then is `latest` replaced (write `latest.tmp`, fsync, `os.replace`). A crash or a full disk at any point
leaves the previous checkpoint as `latest`, intact.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from logitless.trainer.modeling import is_peft_model

LATEST = "latest"
STEP_PREFIX = "step-"


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


def read_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (the `checkpoints` folder), or None."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name or not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{pointer} names '{name}', which is not a complete checkpoint in {root}")
    return path


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
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dirname(step)
    tmp = root / f".tmp-{step_dirname(step)}-{os.getpid()}"
    py_rng, torch_rng = rng_state()
    state = {"step": step, "rng": py_rng, **(trainer_state or {})}
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        extra = {"save_embedding_layers": False} if is_peft_model(model) else {}  # adapters only, no vocab probe
        model.save_pretrained(str(tmp / "model"), safe_serialization=True, **extra)
        opt = {"optimizer": optimizer.state_dict() if optimizer is not None else None}
        opt["scheduler"] = scheduler.state_dict() if scheduler is not None else None
        _write_file(tmp / "optimizer.pt", lambda f: f.write(_serialized(opt)))
        _write_file(tmp / "rng.pt", lambda f: f.write(_serialized(torch_rng)))
        text = json.dumps(state, indent=1).encode()
        _write_file(tmp / "trainer_state.json", lambda f: f.write(text))
        _fsync_tree(tmp)
        old = None
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
            old = root / f".old-{final.name}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        pointer_tmp = root / (LATEST + ".tmp")
        _write_file(pointer_tmp, lambda f: f.write(final.name.encode()))
        os.replace(pointer_tmp, root / LATEST)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError, TypeError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            prev = read_latest(root)
        except CheckpointError:
            prev = None
        raise CheckpointError(
            f"could not write checkpoint {final.name} in {root}: {e}. "
            + (f"The previous checkpoint {prev.name} is still the latest." if prev else "No earlier checkpoint exists.")
        ) from e
    if keep is not None:
        prune(root, keep)
    return final


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` step folders (never the one `latest` names)."""
    latest = read_latest(root)
    steps = sorted(p for p in root.glob(STEP_PREFIX + "*") if p.is_dir())
    for p in steps[: max(len(steps) - keep, 0)]:
        if latest is None or p.name != latest.name:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# Load


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a run folder, its `checkpoints` folder or one `step-*` folder; return the checkpoint folder."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            found = read_latest(root)
            assert found is not None
            return found
    raise CheckpointError(
        f"--resume {str(path)!r}: no checkpoint found (expected a run folder with checkpoints/{LATEST}, a "
        f"checkpoints folder with a '{LATEST}' file, or a {STEP_PREFIX}NNNNNN folder)"
    )


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {folder}")
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        sd = load_file(str(folder / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, sd)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise CheckpointError(f"adapter weights in {folder} do not match the model: unexpected {unexpected[:5]}")
        return
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ptrs = {params[k].data_ptr() for k in sd if k in params}
    really_missing = [k for k in missing if k not in params or params[k].data_ptr() not in loaded_ptrs]  # not tied
    if unexpected or really_missing:
        raise CheckpointError(
            f"model weights in {folder} do not match the model: missing {really_missing[:5]}, unexpected {unexpected[:5]}"
        )


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
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if optimizer is not None and opt["optimizer"] is not None:
        optimizer.load_state_dict(opt["optimizer"])
    if scheduler is not None and opt["scheduler"] is not None:
        scheduler.load_state_dict(opt["scheduler"])
    state = json.loads((path / "trainer_state.json").read_text())
    if restore_rng:
        set_rng_state(state["rng"], torch.load(path / "rng.pt", weights_only=True))
    return state
