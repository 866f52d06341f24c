"""docs/configuration.md, generated from the config dataclasses: every section of `TrainerConfig` and every key
with its type, its default and the comments written at its definition (above it and at the end of its line).

    python -m logitless.trainer.config.docs > docs/configuration.md

tests/test_config_docs.py fails when the file differs from what this prints, so a key added anywhere (a new
section included) is documented by running the command again.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from typing import Any, Literal

import yaml

from logitless.configlib import _hints, _is_union, _section_type
from logitless.trainer.config import schema as config_module
from logitless.trainer.config.schema import TrainerConfig

COMMAND = "python -m logitless.trainer.config.docs > docs/configuration.md"


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment}: the comment lines right above the field in the class body (up to a blank or code
    line) and the comment at the end of its definition, joined into one paragraph."""
    lines, first = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}  # line (1-based in `source`) -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, line = [], node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        inline = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                  if n in comments and n in code_lines]
        out[node.target.id] = " ".join(above + inline).strip()
    return out


def type_name(tp: Any) -> str:
    """A field's type as a reader writes it in YAML terms: `int`, `float | null`, `"auto" | "fp32"`, `list[str]`."""
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a).lower() for a in typing.get_args(tp))
    if _is_union(tp):
        args = typing.get_args(tp)
        return " | ".join(type_name(a) for a in args if a is not type(None)) + (" | null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def default_text(f: dataclasses.Field) -> str:
    """The field's default as YAML (flow style): `auto`, `null`, `[numeric_answer]`, `{}`."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix(" ...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_doc(name: str, cls: type, prefix: str = "") -> list[str]:
    """The markdown of one section: its docstring (where it has its own) and a table of its keys; nested
    sections follow as sections of their own."""
    out = [f"## {prefix}{name}", ""]
    doc = cls.__dict__.get("__doc__")
    if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses write a signature where there is no docstring
        out += [inspect.cleandoc(doc), ""]
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    comments, hints = field_comments(cls), _hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        sub = _section_type(hints[f.name])
        if sub is not None:
            nested.append((f.name, sub))
            continue
        key = f"{prefix}{name}.{f.name}"
        out.append(f"| `{key}` | `{_cell(type_name(hints[f.name]))}` | `{_cell(default_text(f))}` | "
                   f"{_cell(comments.get(f.name, ''))} |")
    out.append("")
    for sub_name, sub in nested:
        out += section_doc(sub_name, sub, f"{prefix}{name}.")
    return out


def render() -> str:
    """docs/configuration.md."""
    intro = inspect.getdoc(config_module) or ""
    trl = intro[intro.index("Names follow TRL"):] if "Names follow TRL" in intro else ""
    lines = [
        "# Configuration reference", "",
        f"Generated from the config dataclasses by `{COMMAND}`; do not edit it by hand "
        "(`tests/test_config_docs.py` fails when it is out of date).", "",
        "A run's settings come from the defaults below, then an optional YAML file (`section: {key: value}`), then "
        "`section.key=value` overrides on the command line (`logitless train CONFIG.yaml train.max_steps=10`). "
        "Unknown keys and values of the wrong type are refused, naming the nearest valid key. Settings whose "
        "default is `auto` are decided per run (device, model, memory plan); `logitless train --dry-run` prints "
        "what they become, and every run prints them at its start and saves them in its folder as `resolved.json`.",
        "",
    ]
    sections = [(f.name, _section_type(h)) for f, h in zip(dataclasses.fields(TrainerConfig),
                                                            _hints(TrainerConfig).values())]
    lines += ["Sections: " + ", ".join(f"[`{n}`](#{n})" for n, s in sections if s is not None) + ".", ""]
    for name, cls in sections:
        if cls is not None:
            lines += section_doc(name, cls)
    if trl:
        lines += ["## Names shared with TRL", "", trl, ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
