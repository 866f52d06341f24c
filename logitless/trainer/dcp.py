"""Sharded checkpoints of a torchrun run (`torch.distributed.checkpoint`), with an export one process can load.

A step folder of a run on N > 1 ranks, or of one process with train.fsdp_offload=true (N = 1; beside it,
`latest` as in `checkpoint.py`):

    step-000020/
        dcp/                 model and optimizer state, every rank writing its own shards (DCP format)
        model/               export: save_pretrained of the full adapter (PEFT) or full model (safetensors),
                             gathered on rank 0; `logitless eval --checkpoint RUN` loads it in one process
        optimizer.pt         {"optimizer": None, "scheduler": ...} (the optimizer state is in dcp/)
        rng-rank{r}.pt       rank r's python, numpy and torch RNG states
        state-rank{r}.json   rank r's own trainer state, where it has one (train.async_rollout: its pending rollout)
        trainer_state.json   step, world_size, data sampler position, entropy coefficient
        config.yaml          the run's config; manifest.json: size and sha256 of every file (checkpoint.py)

The same atomic protocol as `checkpoint.py`: everything is written into a hidden temp folder, fsync'ed, renamed
into place by rank 0, and only then is `latest` replaced. A resume must use the same number of ranks: the data
shares and RNG streams of the ranks depend on it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from logitless.trainer import checkpoint as ckpt
from logitless.trainer.policy.modeling import is_peft_model
from logitless.trainer.distributed.parallel import World
from logitless.trainer.config.files import current_config

DCP_DIR = "dcp"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def rank_state_file(rank: int) -> str:
    return f"state-rank{rank}.json"


def saved_world_size(path: Path) -> int:
    """The number of ranks that wrote checkpoint folder `path` (1 for a single-process checkpoint)."""
    return int(json.loads((path / "trainer_state.json").read_text()).get("world_size", 1))


def check_world_size(path: Path, world: World) -> None:
    """Refuse a resume whose number of ranks differs from the checkpoint's."""
    saved = saved_world_size(path)
    if saved != world.size:
        how = "one process (no torchrun)" if saved == 1 else f"{saved} ranks (torchrun --nproc-per-node {saved} on one node)"
        raise ckpt.CheckpointError(
            f"--resume {path}: the checkpoint was written by {saved} rank(s) but this run has {world.size}; resume "
            f"it with {how}. (Its model/ folder is a one-process export, which `logitless eval --checkpoint` reads.)"
        )


def check_layout(path: Path, world: World) -> None:
    """Refuse a resume whose checkpoint is sharded (DCP) while this run's model is not, or the other way round:
    one process with train.fsdp_offload=true writes and reads sharded checkpoints."""
    sharded = (path / DCP_DIR).is_dir()
    if sharded == world.sharded or world.distributed:  # (several ranks: check_world_size names the fix)
        return
    if sharded:
        raise ckpt.CheckpointError(
            f"--resume {path}: the checkpoint is sharded (written with train.fsdp_offload=true) but this run trains "
            "an unsharded model; resume it with train.fsdp_offload=true. (Its model/ folder is a one-process "
            "export, which `logitless eval --checkpoint` reads.)"
        )
    raise ckpt.CheckpointError(
        f"--resume {path}: the checkpoint holds one process's unsharded state (written with train.fsdp_offload="
        "false) but this run shards the model (train.fsdp_offload=true); resume it with train.fsdp_offload=false"
    )


def _agree_ok(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def _export(model: torch.nn.Module, folder: Path, main: bool) -> None:
    """save_pretrained of the full (gathered) adapter or model into `folder`, on rank 0; a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    peft = is_peft_model(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=peft)
    full = get_model_state_dict(model, options=options)
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    full = {k: v for k, v in full.items() if k in names}  # a tied lm_head is saved once, as save_pretrained does
    if main:
        extra = {"save_embedding_layers": False} if peft else {}
        model.save_pretrained(str(folder), state_dict=full, safe_serialization=True, **extra)


def save_sharded(
    root: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    world: World,
    device: torch.device,
    keep: int | None = None,
    rank_state: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `step` of every rank atomically under `root`; a collective. Returns the step folder.
    `rank_state`: this rank's own JSON state beside the shared `trainer_state` (written where not empty)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    final = root / ckpt.step_dirname(step)
    tmp = root / f"{ckpt.TMP_PREFIX}{ckpt.step_dirname(step)}-ranks{world.size}"
    error: Exception | None = None
    try:
        if world.main:
            root.mkdir(parents=True, exist_ok=True)
            ckpt.clean_temporaries(root)
            tmp.mkdir()
    except OSError as e:
        error = e
    if _agree_ok(error is None, device):
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
            _export(model, tmp / "model", world.main)
            py_rng, torch_rng = ckpt.rng_state()
            rng = ckpt._serialized({"py": py_rng, "torch": torch_rng})
            ckpt._write_file(tmp / rng_file(world.rank), lambda f: f.write(rng))
            if rank_state:
                own = json.dumps(rank_state).encode()
                ckpt._write_file(tmp / rank_state_file(world.rank), lambda f: f.write(own))
        except Exception as e:  # safetensors' errors too: every rank must reach the agreement below
            error = e
    if _agree_ok(error is None, device) and world.main:
        try:
            _finish(root, tmp, final, step, scheduler, trainer_state, world)
        except Exception as e:
            error = e
    if not _agree_ok(error is None, device):
        if world.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ckpt.CheckpointError(
            f"could not write checkpoint {final.name} in {root}"
            + (f": {ckpt.failure_reason(error)}" if error else " (another rank failed; see its error)")
            + ". The previous checkpoint is still the latest."
        )
    if keep is not None and world.main:
        ckpt.prune(root, keep)
    return final


def _finish(
    root: Path, tmp: Path, final: Path, step: int, scheduler: Any, trainer_state: dict[str, Any], world: World
) -> None:
    """Rank 0: the files every rank shares, fsync, rename into place, point `latest` at it."""
    opt = ckpt._serialized({"optimizer": None, "scheduler": scheduler.state_dict() if scheduler is not None else None})
    ckpt._write_file(tmp / "optimizer.pt", lambda f: f.write(opt))
    state = {"step": step, "world_size": world.size, **trainer_state}
    text = json.dumps(state, indent=1).encode()
    ckpt._write_file(tmp / "trainer_state.json", lambda f: f.write(text))
    run_config = current_config(root.parent)
    if run_config is not None:
        config = run_config.read_bytes()
        ckpt._write_file(tmp / ckpt.RUN_CONFIG, lambda f: f.write(config))
    manifest = json.dumps(ckpt._manifest(tmp), indent=1).encode()  # every rank's files, checked before a resume
    ckpt._write_file(tmp / ckpt.MANIFEST, lambda f: f.write(manifest))
    ckpt._fsync_tree(tmp)
    old = None
    if final.exists():
        old = root / f"{ckpt.OLD_PREFIX}{final.name}-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    ckpt._fsync_dir(root)
    pointer_tmp = root / (ckpt.LATEST + ".tmp")
    ckpt._write_file(pointer_tmp, lambda f: f.write(final.name.encode()))
    os.replace(pointer_tmp, root / ckpt.LATEST)
    ckpt._fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_sharded(
    path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, world: World
) -> dict[str, Any]:
    """Load this rank's shards, the schedule and this rank's RNG from a checkpoint of `save_sharded`; return the
    trainer state. Refuses a checkpoint written by another number of ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = ckpt.resolve_checkpoint(path)
    check_world_size(path, world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    opt = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if scheduler is not None and opt["scheduler"] is not None:
        scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(path / rng_file(world.rank), weights_only=True)
    ckpt.set_rng_state(rng["py"], rng["torch"])
    state = json.loads((path / "trainer_state.json").read_text())
    own = path / rank_state_file(world.rank)
    return {**state, **json.loads(own.read_text())} if own.is_file() else state
