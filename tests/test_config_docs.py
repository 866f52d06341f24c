"""docs/configuration.md is what `python -m logitless.trainer.config.docs` prints: every section and key of the
config dataclasses with its type, default and the comments at its definition."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from logitless.configlib import valid_keys
from logitless.trainer.config import docs as config_docs
from logitless.trainer.config.schema import TrainerConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_reference_is_up_to_date():
    assert DOC.read_text() == config_docs.render(), (
        f"docs/configuration.md is out of date with the config dataclasses; regenerate it: {config_docs.COMMAND}")


def test_every_key_has_a_row_with_type_default_and_description():
    text = config_docs.render()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    sections = {f.name for f in dataclasses.fields(TrainerConfig)}
    leaves = [k for k in valid_keys(TrainerConfig) if k not in sections]
    assert sorted(rows) == sorted(leaves)
    undocumented = [k for k, line in rows.items() if not line.rstrip(" |").split("|")[-1].strip()]
    assert not undocumented, f"config keys without a comment at their definition: {undocumented}"
    assert "| `model.gradient_checkpointing` | `bool \\| \"auto\"` | `auto` | Recompute" in text


@dataclass
class _Inner:
    depth: int = 2  # how deep


@dataclass
class _Section:
    """A section's own docstring."""

    # two lines
    # above
    mode: Literal["a", "b"] = "a"  # and one after
    names: list[str] = field(default_factory=lambda: ["x"])
    limit: float | None = None

    # a comment after a blank line belongs to the next field only
    inner: _Inner = field(default_factory=_Inner)


def test_comments_types_and_defaults_of_any_section():
    """A new section (nested too) is read the same way: the generator walks whatever dataclasses there are."""
    lines = config_docs.section_doc("new", _Section)
    text = "\n".join(lines)
    assert lines[0] == "## new" and "A section's own docstring." in text
    assert '| `new.mode` | `"a" \\| "b"` | `a` | two lines above and one after |' in text
    assert "| `new.names` | `list[str]` | `[x]` |  |" in text
    assert "| `new.limit` | `float \\| null` | `null` |  |" in text
    assert "## new.inner" in text and "| `new.inner.depth` | `int` | `2` | how deep |" in text
