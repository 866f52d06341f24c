"""Read back what an experiment tracker wrote, offline: W&B's run file, Trackio's local store, TensorBoard events."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def wandb_records(path: str | Path) -> list[Any]:
    """The `wandb_internal_pb2.Record`s of an offline run's `run-ID.wandb` file: a W&B header (":W&B", magic,
    version; 7 bytes), then LevelDB log blocks of 32 KiB, each chunk a 7-byte header (crc32, length, type: 1 full,
    2 first, 3 middle, 4 last) and its data; a block's tail shorter than a header is zero padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
        elif kind not in (2, 3):
            raise ValueError(f"{path}: chunk type {kind} at byte {pos}")
    return out


def wandb_history(path: str | Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """({step: {metric: value}} of the history records, the run's config) of a W&B run file."""
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            step = row.pop("_step")
            history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            config.update({i.key: json.loads(i.value_json) for i in items if i.key != "_wandb"})
    return history, config


def tensorboard_scalars(folder: str | Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the scalar events in a TensorBoard log folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_text(folder: str | Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
