"""Experiment trackers of a run (`logging.report_to`): TensorBoard, Weights & Biases, Trackio.

Every tracker receives the same scalars under the same names as `metrics.jsonl` (one record per logged step;
non-finite values, which the JSONL writes as null, are left out) and the run's config. Only rank 0 opens
trackers (ranks > 0 hold a `QuietLogger`).

    report_to       TRL / transformers                       where it writes
    tensorboard     report_to="tensorboard"                  <run_dir>/tensorboard/ (config as a text summary)
    wandb           report_to="wandb"                        <run_dir>/wandb/ and the W&B server (WANDB_MODE=offline:
                                                             local only, `wandb sync` uploads it later)
    trackio         report_to="trackio"                      Trackio's local store (TRACKIO_DIR, default
                                                             ~/.cache/huggingface/trackio), or a Space (space_id)

`logging.project` and `logging.run_name` (transformers' `project` and `run_name`) name the W&B / Trackio project
and run (default run name: the run folder's name); `logging.tracker_options.<tracker>` passes further keyword
arguments to `wandb.init` (entity, tags, group, mode, ...) or `trackio.init` (space_id, group, ...). The W&B run
id and the Trackio run name are kept in `<run_dir>/trackers.json`, so `--resume` continues the same tracked run.
A resumed run re-logs the steps after its checkpoint with the same values (resume is exact): TensorBoard drops
its later events (purge_step), W&B ignores steps below the last one it has, Trackio keeps both copies.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

import yaml

TRACKERS = ("tensorboard", "wandb", "trackio")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
STATE_FILE = "trackers.json"  # in the run folder: the W&B run id, the Trackio run name


class Tracker(Protocol):
    """One experiment tracker: scalars by step, closed at the end of the run."""

    name: str

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def installed(name: str) -> bool:
    return importlib.util.find_spec(PACKAGES[name]) is not None


def resolve_report_to(report_to: list[str] | None, tensorboard: bool | None) -> tuple[list[str], bool]:
    """(trackers to open, whether a missing package is an error). `logging.report_to` unset keeps the behaviour of
    `logging.tensorboard` (default true): TensorBoard when the package is installed, silently skipped otherwise.
    Trackers named in `report_to` must be installed; as in TRL, ["none"] is none and ["all"] every installed one."""
    if report_to is None:
        return (["tensorboard"] if tensorboard is not False else []), False
    if report_to == ["none"]:
        return [], True
    if report_to == ["all"]:
        return [t for t in TRACKERS if installed(t)], False
    return list(dict.fromkeys(report_to)), True


def check_report_to(report_to: list[str] | None, tensorboard: bool | None) -> None:
    """Refuse an unknown tracker, a contradiction with `logging.tensorboard`, or a named tracker whose package is
    missing, naming the key and the install command (before the model loads)."""
    if report_to is None or report_to in (["none"], ["all"]):
        if tensorboard is not None and report_to is not None:
            raise ValueError(f"logging.tensorboard={str(tensorboard).lower()} is set beside logging.report_to="
                             f"{report_to}: logging.report_to names every tracker now; unset logging.tensorboard")
        return
    import difflib

    for name in report_to:
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, TRACKERS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"logging.report_to: unknown tracker {name!r}{hint} Use any of {list(TRACKERS)}, [all] "
                             "for every installed one, or [] / [none] for none")
    if tensorboard is not None and tensorboard != ("tensorboard" in report_to):
        raise ValueError(
            f"logging.tensorboard={str(tensorboard).lower()} contradicts logging.report_to={report_to}: "
            "logging.report_to names every tracker now; unset logging.tensorboard (or make them agree)")
    for name in report_to:
        if not installed(name):
            raise ValueError(f"logging.report_to names {name!r}, but the {PACKAGES[name]} package is not installed: "
                             f"pip install 'logitless[{name}]' (or drop it from logging.report_to)")


def wandb_credentials(options: dict[str, Any]) -> str | None:
    """Why wandb.init would fail for want of credentials, or None: it runs offline or disabled (WANDB_MODE,
    WANDB_DISABLED, or logging.tracker_options.wandb.mode), or an API key is set (WANDB_API_KEY, or `wandb login`'s
    entry in ~/.netrc for the W&B host)."""
    import netrc
    from urllib.parse import urlparse

    mode = str(options.get("mode") or os.environ.get("WANDB_MODE") or "").lower()
    if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return None
    if os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        if netrc.netrc().authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return f"no W&B API key is set (WANDB_API_KEY, or an entry for {host} in ~/.netrc from `wandb login`)"


def check_tracker_credentials(report_to: list[str] | None, tensorboard: bool | None,
                              options: dict[str, dict[str, Any]]) -> None:
    """Refuse, before the model loads, a tracker that would fail when the run opens it: wandb without an API key
    and not offline. Names the key and the fixes."""
    names, _ = resolve_report_to(report_to, tensorboard)
    if "wandb" in names and installed("wandb") and (why := wandb_credentials(options.get("wandb", {}))) is not None:
        raise ValueError(f"logging.report_to includes wandb, but {why}, so wandb.init would fail once the model has "
                         "loaded. Run `wandb login` (or set WANDB_API_KEY), log offline with WANDB_MODE=offline (or "
                         "logging.tracker_options={wandb: {mode: offline}}; `wandb sync` uploads it later), or drop "
                         "wandb from logging.report_to")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record that trackers log: ints and floats (not bools), finite, without `step`."""
    return {k: float(v) if isinstance(v, float) else v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def _save_state(run_dir: Path, name: str, value: dict[str, Any]) -> None:
    state = _state(run_dir)
    state[name] = value
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=1))


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        if config and not resume_step:
            self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, run_name: str, options: dict[str, Any],
                 resume_step: int):
        import wandb

        saved = _state(run_dir).get("wandb", {})
        kwargs: dict[str, Any] = {"project": project, "name": run_name, "config": config, "dir": str(run_dir)}
        if resume_step and saved.get("id"):
            kwargs.update(id=saved["id"], resume="allow")
        kwargs.update(options)
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:  # noqa: BLE001 (wandb's errors have no common base class): one line, not its traceback
            raise RuntimeError(f"logging.report_to=wandb: wandb.init failed ({type(e).__name__}: {e}); fix that, "
                               "log offline with WANDB_MODE=offline, or drop wandb from logging.report_to") from None
        _save_state(run_dir, "wandb", {"id": self.run.id, "project": self.run.project})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    name = "trackio"

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, run_name: str, options: dict[str, Any],
                 resume_step: int):
        import trackio

        self.trackio = trackio
        kwargs: dict[str, Any] = {"project": project, "name": run_name, "config": config,
                                  "resume": "allow" if resume_step else "never"}
        kwargs.update(options)
        self.run = trackio.init(**kwargs)
        _save_state(run_dir, "trackio", {"project": project, "name": self.run.name})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        current = self.trackio.context_vars.current_run
        try:
            self.run.finish()
        finally:
            if current.get() is self.run:
                current.set(None)


def open_trackers(names: list[str], run_dir: Path, *, config: dict[str, Any], project: str, run_name: str | None,
                  options: dict[str, dict[str, Any]], resume_step: int = 0, required: bool = True) -> list[Tracker]:
    """The named trackers, opened for this run folder. `required=False`: a tracker whose package is missing is
    skipped (the default TensorBoard)."""
    name = run_name or run_dir.name
    out: list[Tracker] = []
    try:
        for tracker in names:
            if not installed(tracker):
                if required:
                    raise ValueError(f"logging.report_to names {tracker!r}, but the {PACKAGES[tracker]} package is "
                                     f"not installed: pip install 'logitless[{tracker}]'")
                continue
            opts = dict(options.get(tracker, {}))
            if tracker == "tensorboard":
                out.append(TensorBoardTracker(run_dir, config, resume_step))
            elif tracker == "wandb":
                out.append(WandbTracker(run_dir, config, project, name, opts, resume_step))
            else:
                out.append(TrackioTracker(run_dir, config, project, name, opts, resume_step))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out
