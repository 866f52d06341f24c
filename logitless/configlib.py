"""Typed dataclass configs from an optional YAML file plus `section.key=value` overrides.

The schema is a dataclass whose fields are dataclass *sections* (nested to any depth) and plain fields:

    @dataclass
    class Optim:
        lr: float = 1e-5
        betas: list[float] = field(default_factory=lambda: [0.9, 0.999])

    @dataclass
    class Config:
        optim: Optim = field(default_factory=Optim)
        seed: int = 0

    cfg = load_config(Config, "run.yaml", ["optim.lr=1e-4", "seed=3"])

Values of overrides are parsed with `yaml.safe_load` (`x=null`, `xs=[a,b]`, `flag=true`). A key given twice in one
mapping (a section twice, or a key twice in a section), which YAML would resolve by keeping the last, is refused
naming the key and both lines. Unknown keys and
values of the wrong type are refused with a `ConfigError` that names the key, the expected type and the
nearest valid key. Supported field types: int, float (int accepted; strings such as "1e-4" accepted; nan and inf refused), bool,
str, Any, Optional/unions, Literal, list[...], tuple[..., ...], dict[str, ...] and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")
_MISSING = object()


class ConfigError(ValueError):
    """A config file or override that does not match the config schema."""


class NonFiniteError(ConfigError):
    """A float config value that is nan or infinite (refused for every float key)."""


# ----------------------------------------------------------------------------------------------------------
# Schema helpers


def _hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields (handles `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _section_type(tp: Any) -> type | None:
    """The dataclass type of a section field (also through Optional[Section]), else None."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return _section_type(arms[0])
    return None


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"section {tp.__name__}"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        args = ", ".join("..." if a is Ellipsis else _type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """All dotted keys of a config schema: sections and leaves, e.g. ['optim', 'optim.lr', 'seed']."""
    keys: list[str] = []
    for name, tp in _hints(cls).items():
        key = f"{prefix}{name}"
        keys.append(key)
        sub = _section_type(tp)
        if sub is not None:
            keys.extend(valid_keys(sub, key + "."))
    return keys


def _nearest_key(bad: str, siblings: list[str]) -> list[str]:
    """The sibling whose last name is closest to `bad`'s, or whose initials it spells ('lr' -> 'learning_rate')."""
    leaf = bad.rpartition(".")[2]
    leaves = {k.rpartition(".")[2]: k for k in siblings}
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
    if not close:
        close = [name for name in leaves if "_" in name and "".join(w[0] for w in name.split("_") if w) == leaf][:1]
    return [leaves[c] for c in close]


def _unknown_key(key: str, root: type, where: str, bad: str | None = None) -> ConfigError:
    """Error for unknown `key`; `bad` is its first unknown dotted prefix (default: the key itself)."""
    bad = bad or key
    candidates = valid_keys(root)
    parent = bad.rpartition(".")[0]
    siblings = [k for k in candidates if k.rpartition(".")[0] == parent]
    close = _nearest_key(bad, siblings)
    if close and close[0] + key[len(bad):] in candidates:  # 'optm.lr' -> 'optim.lr', not just 'optim'
        close = [close[0] + key[len(bad):]]
    if not close:
        close = difflib.get_close_matches(key, [k for k in candidates if not key.startswith(k + ".")], n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    detail = f"{where}, no key '{bad}'" if bad != key else where
    return ConfigError(
        f"unknown config key '{key}' ({detail}){hint} Valid keys "
        f"{'of ' + repr(parent) if parent else 'at top level'}: {', '.join(siblings)}"
    )


# ----------------------------------------------------------------------------------------------------------
# Value checking


def _check(value: Any, tp: Any, key: str, root: type) -> Any:
    """Return `value` converted to `tp` (int -> float, list -> tuple, dict -> dataclass) or raise ConfigError."""
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _type_error(key, tp, value)
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        section = _section_type(tp)
        if section is not None and isinstance(value, dict):  # Optional[Section]: report errors inside it
            return _build(section, value, key + ".", root)
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _check(value, arm, key, root)
            except NonFiniteError as e:
                raise NonFiniteError(f"{e} (or null)" if type(None) in args else str(e)) from None
            except ConfigError:
                pass
        raise _type_error(key, tp, value)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if value == allowed and type(value) is type(allowed):
                return value
        raise _type_error(key, tp, value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _type_error(key, tp, value)
        return _build(tp, value, key + ".", root)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, tp, value)
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise _type_error(key, tp, value)
        if not math.isfinite(number):  # nan and inf pass every "> 0" and "< x" check; no setting means either
            raise NonFiniteError(f"config key '{key}' expects a finite number, got {value!r}; give a finite value")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, tp, value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, tp, value)
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"config key '{key}' expects {_type_name(tp)} ({len(args)} items), got {value!r}")
            return tuple(_check(v, a, f"{key}[{i}]", root) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_check(v, item, f"{key}[{i}]", root) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(key, tp, value)
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_check(k, kt, f"{key} (key)", root): _check(v, vt, f"{key}.{k}", root) for k, v in value.items()}
    if tp is Path and isinstance(value, str):
        return Path(value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _type_error(key, tp, value)
    raise ConfigError(f"config key '{key}' has an unsupported annotation {tp!r} in the schema")


def _type_error(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(
        f"config key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}"
        + (" (quote it to pass a string)" if tp is str or (_is_union(tp) and str in typing.get_args(tp)) else "")
    )


def _build(cls: type[T], data: dict[str, Any], prefix: str, root: type) -> T:
    """Construct dataclass `cls` from a nested dict, checking every key and value."""
    hints = _hints(cls)
    for k in data:
        if k not in hints:
            raise _unknown_key(f"{prefix}{k}", root, "in config")
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.name in data:
            kwargs[f.name] = _check(data[f.name], hints[f.name], key, root)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{key}' ({_type_name(hints[f.name])})")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a __post_init__ validation of the section
        raise ConfigError(f"invalid config section '{prefix.rstrip('.') or cls.__name__}': {e}") from e


# ----------------------------------------------------------------------------------------------------------
# YAML


def _duplicate_key(node: yaml.Node, path: str = "", seen: set[int] | None = None) -> tuple[str, int, int] | None:
    """(dotted key, line, line of its first occurrence) of the first key given twice in one mapping of the
    composed YAML `node` (1-based lines), else None. Merge keys (`<<`) are YAML's own overriding, not duplicates."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already walked
        return None
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            dotted = f"{path}.{name}" if path else str(name)
            if name is not None:
                if (key.tag, name) in first:
                    return dotted, key.start_mark.line + 1, first[(key.tag, name)]
                first[(key.tag, name)] = key.start_mark.line + 1
            found = _duplicate_key(value, dotted, seen)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_key(item, f"{path}[{i}]", seen)
            if found:
                return found
    return None


def load_yaml(text: str, where: str, key: str = "") -> Any:
    """`yaml.safe_load(text)`, refusing a key given twice in one mapping (ConfigError naming it, its line and
    `where`, e.g. "config file 'run.yaml'"; `key`: the dotted key the text is the value of)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        dup = _duplicate_key(node, key) if node is not None else None
        if dup is not None:
            key, line, first = dup
            raise ConfigError(
                f"{where}: line {line} gives '{key}' again (first at line {first}); YAML would silently keep only "
                "the last one. Merge them into one"
            )
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from e


# ----------------------------------------------------------------------------------------------------------
# Public API


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build config `cls` from a nested dict (as read from YAML), refusing unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__} {data!r}")
    return _build(cls, data, "", cls)


def _leaf_type(cls: type, parts: list[str], key: str) -> Any:
    """The annotation at dotted path `parts` of the schema (dict fields may be indexed further)."""
    tp: Any = cls
    for i, part in enumerate(parts):
        section = _section_type(tp)
        if section is not None:
            hints = _hints(section)
            if part not in hints:
                raise _unknown_key(key, cls, "in override", bad=".".join(parts[: i + 1]))
            tp = hints[part]
        elif typing.get_origin(tp) is dict or tp is dict:
            tp = (typing.get_args(tp) or (Any, Any))[1]
        elif tp is Any:
            return Any
        else:
            raise ConfigError(
                f"config key '{'.'.join(parts[:i])}' is a value of type {_type_name(tp)}, not a section; "
                f"cannot set '{key}'"
            )
    return tp


def apply_overrides(cls: type, data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Merge `section.key=value` overrides into a nested dict (in place; also returned)."""
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"config override {item!r} must be a string 'section.key=value'")
        if "=" not in item:
            raise ConfigError(
                f"config override {item!r} has no '=': write it as {item.strip() or 'section.key'}=VALUE, one word with "
                "no spaces around '=' (e.g. rollout.temperature=0.7)"
            )
        key, _, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ConfigError(f"config override {item!r} has an empty key; use 'section.key=value'")
        tp = _leaf_type(cls, parts, key)
        try:
            value = load_yaml(raw, f"config override '{key}'", key) if raw.strip() else ""
        except ConfigError as e:
            if not isinstance(e.__cause__, yaml.YAMLError):
                raise
            raise ConfigError(f"config override '{key}': cannot parse value {raw!r} as YAML: {e.__cause__}") from e
        if _section_type(tp) is None:
            try:
                value = _check(value, tp, key, cls)
            except ConfigError:
                # `name=007` or `name=true` for a str field: keep the text as written.
                if not isinstance(value, str) and (tp is str or (_is_union(tp) and str in typing.get_args(tp))):
                    value = raw.strip()
                else:
                    raise
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif dataclasses.is_dataclass(child):
                child = node[part] = to_dict(child)
            elif not isinstance(child, dict):
                raise ConfigError(f"config key '{part}' holds {child!r}; cannot set '{key}' inside it")
            node = child
        node[parts[-1]] = value
    return data


STDIN = "-"  # the config path that reads standard input


def read_config_text(path: str | Path) -> tuple[str, str]:
    """(text, name for messages) of a config file: a regular file, or what a pipe, `/dev/stdin` or `-` (standard
    input) delivers; read once."""
    if str(path) in (STDIN, "/dev/stdin"):
        if sys.stdin is None or sys.stdin.isatty():
            raise ConfigError(
                f"config '{path}' reads standard input, but nothing is piped in (it is a terminal); pipe the file in "
                "(logitless train --config - < cfg.yaml) or give its path"
            )
        if str(path) == STDIN:
            return sys.stdin.read(), "<stdin>"
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"config file '{p}' does not exist")
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a folder, not a YAML file")
    try:
        return p.read_text(encoding="utf-8"), str(p)  # a regular file, or a pipe (/dev/fd/N, a FIFO)
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file '{p}' cannot be read ({type(e).__name__}: {e.strerror or e})") from None


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Config `cls` from defaults, then the YAML file at `path` (optional; `-` reads standard input), then
    `section.key=value` overrides."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    data: dict[str, Any] = {}
    if path is not None:
        text, p = read_config_text(path)
        loaded = load_yaml(text, f"config file '{p}'")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    apply_overrides(cls, data, list(overrides))
    return from_dict(cls, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), suitable for YAML/JSON."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v

    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"to_dict needs a dataclass instance, got {type(cfg).__name__}")
    return plain(cfg)


def to_yaml(cfg: Any) -> str:
    """YAML text of a config; `load_config(type(cfg), <file with this text>)` gives back an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def positive(section: str, **values: float) -> None:
    """Refuse a value that is not a finite number > 0 (None: unset, accepted), naming `section`.name."""
    for name, v in values.items():
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{section}.{name} must be > 0, got {v!r}" + ("" if math.isfinite(v) else "; give a finite number"))
