"""Where the model and the dataset come from, checked before anything is loaded.

A local folder must hold a saved model; a hub name must be in the local cache or reachable. One request with a
short timeout decides reachability, so an offline machine gets one line (what could not be reached, how to use a
local path instead) in seconds, instead of a long traceback after minutes of retries.
"""

from __future__ import annotations

import os
from pathlib import Path

from logitless.trainer.config.schema import DataConfig, ModelConfig, TrainerConfig

PROBE_TIMEOUT_S = 10.0


class SourceError(RuntimeError):
    """A model or dataset that cannot be found or reached."""


def _offline() -> bool:
    from huggingface_hub import constants

    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return constants.is_offline_mode() or any(os.environ.get(f, "").lower() in ("1", "true", "yes") for f in flags)


def _cached(repo_id: str, filename: str, revision: str | None, repo_type: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision, repo_type=repo_type), str)
    except Exception:  # an id the hub would refuse (HFValidationError) is reported by the probe
        return False


def _probe(repo_id: str, revision: str | None, repo_type: str, what: str, local_fix: str) -> None:
    """One short request to the hub for `repo_id`; SourceError (one line) when it is unreachable or unknown."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HFValidationError, OfflineModeIsEnabled, RepositoryNotFoundError

    api = HfApi()
    info = api.model_info if repo_type == "model" else api.dataset_info
    try:
        info(repo_id, revision=revision, timeout=PROBE_TIMEOUT_S)
    except (httpx.TransportError, OfflineModeIsEnabled, OSError) as e:
        raise SourceError(
            f"{what} {repo_id!r} is not in the local cache and the Hugging Face hub ({api.endpoint}) cannot be "
            f"reached ({type(e).__name__}). Offline? {local_fix}"
        ) from None
    except GatedRepoError:
        raise SourceError(f"{what} {repo_id!r} is gated: accept its terms on the hub and log in (`hf auth login`), "
                          f"or {local_fix[0].lower()}{local_fix[1:]}") from None
    except (RepositoryNotFoundError, HFValidationError):
        raise SourceError(f"{what} {repo_id!r} is neither a local path nor a repository on the hub (private ones need "
                          f"`hf auth login`). {local_fix}") from None


def model_cached(cfg: ModelConfig) -> bool:
    """True when model.name_or_path is a hub name whose files are in the local cache (read them from there)."""
    name = cfg.name_or_path
    if not name or Path(name).expanduser().exists():
        return False
    return _cached(name, cfg.gguf_file or "config.json", cfg.revision, "model")


def check_model_source(cfg: ModelConfig) -> None:
    """model.name_or_path is a folder holding a saved model, a .gguf file, or a cached / reachable hub model."""
    name = cfg.name_or_path
    if not name:
        return  # the embedded demo GGUF (its absence is reported by modeling.demo_gguf)
    path = Path(name).expanduser()
    fix = "Download it once with network access, or set model.name_or_path=<a local folder holding config.json>"
    if path.suffix == ".gguf" or path.is_dir():
        if path.is_dir() and not cfg.gguf_file and not (path / "config.json").is_file():
            raise SourceError(
                f"model.name_or_path={name!r} is a folder without config.json (empty or a partial download?); "
                "give the folder of a saved model (save_pretrained output), or a hub name"
            )
        return
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise SourceError(f"model.name_or_path={name!r}: no such folder; give an existing folder or a hub name")
    if _cached(name, cfg.gguf_file or "config.json", cfg.revision, "model"):
        return
    if _offline():
        raise SourceError(f"model {name!r} is not in the local Hugging Face cache and offline mode is on. {fix}")
    _probe(name, cfg.revision, "model", "model", fix)


def _hub_dataset(cfg: DataConfig, split: str, eval: bool) -> str | None:
    """The hub dataset split `split` of `cfg` loads from, or None when its rows come from a file or are generated."""
    options = {**cfg.options, **(cfg.eval_options if eval else {})}
    if cfg.task == "hub":
        name = options.get("name")
        return None if not isinstance(name, str) or Path(name).expanduser().exists() else name
    if cfg.task == "gsm8k" and options.get("path") is None and split != "sample":
        return "openai/gsm8k"
    return None


def check_data_source(cfg: DataConfig, *, eval: bool = False, split: str | None = None) -> None:
    """The hub dataset of the train (or eval) split is cached or reachable (local files are checked when read)."""
    name = _hub_dataset(cfg, split or (cfg.eval_split if eval else cfg.split), eval)
    if name is None or _cached(name, "README.md", None, "dataset"):
        return
    fix = ("Download it once with network access, or use a local file: data.task=jsonl data.options.path=<file.jsonl>"
           + (" (or data.options.path=<gsm8k .jsonl> / data.split=sample for gsm8k)" if cfg.task == "gsm8k" else ""))
    if _offline():
        raise SourceError(f"dataset {name!r} is not in the local Hugging Face cache and offline mode is on. {fix}")
    _probe(name, None, "dataset", "dataset", fix)


def check_reward_sources(cfg: TrainerConfig) -> None:
    """The reward models and judges of reward.reward_funcs (`model:NAME`, `judge:NAME`), as model.name_or_path."""
    for spec in cfg.reward.reward_funcs:
        kind, _, name = spec.partition(":")
        if kind not in ("model", "judge") or not name:
            continue
        options = cfg.reward.reward_options.get(spec, {})
        try:
            check_model_source(ModelConfig(name_or_path=name, revision=options.get("revision")))
        except SourceError as e:
            raise SourceError(f"reward.reward_funcs {spec!r}: {str(e).replace('model.name_or_path=', '')}") from None


def check_sources(cfg: TrainerConfig, *, eval: bool = False) -> None:
    """Model and dataset (train split, or the eval split with `eval`) sources of `cfg`, and its reward models;
    one-line SourceError."""
    check_model_source(cfg.model)
    check_data_source(cfg.data, eval=eval, split=cfg.eval.split if eval else None)
    check_reward_sources(cfg)
