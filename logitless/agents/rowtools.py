"""Per-row tool sets (agent.tools_field): which of the agent's tools each row's episodes may use.

A row's field `agent.tools_field` lists tool names ([] = none) among the configured ones (agent.tools, the
environment's tools, MCP tools). The model is shown only those (one chat bridge per distinct set, made and
checked once), and a call to any other tool is answered exactly as a call to an unknown tool. A row that lacks
the field, gives something that is not a list of names, or names a tool that is not configured is refused with
the row, the field and the fix (`check_rows`, run on the whole dataset before the weights load).
"""

from __future__ import annotations

import difflib
from typing import Any, Sequence

from logitless.agents.templates import ChatBridge
from logitless.agents.tools import ToolSet


def unknown_tool(name: str | None, allowed: Sequence[str]) -> str:
    """What the model reads after calling a tool it does not have (`allowed`: the tools of its conversation)."""
    have = f"the tools are: {', '.join(allowed)}" if allowed else "this conversation has no tools"
    return f"unknown tool '{name}'; {have}"


class RowTools:
    """The tool set of each row, and the chat bridge that shows the model exactly that set.

    `field`: agent.tools_field (None: every row gets every tool); `toolset`: the agent's tools; `bridge`: the
    agent's bridge with every tool (None: raw-text prompts only); `user_turns`: an environment answers with user
    messages (for the probe a new bridge is checked with)."""

    def __init__(self, field: str | None, toolset: ToolSet, bridge: ChatBridge | None, user_turns: bool) -> None:
        if field is not None and not toolset:
            raise ValueError(f"agent.tools_field={field!r} chooses each row's tools among the configured ones, but no "
                             "tool is configured: set agent.tools, agent.mcp_servers or an environment with tools, or "
                             "agent.tools_field=null")
        self.field, self.toolset, self.user_turns, self.full = field, toolset, user_turns, bridge
        self._bridges: dict[tuple[str, ...], ChatBridge] = {}

    @property
    def all(self) -> tuple[str, ...]:
        """Every configured tool's name, in the order the chat template shows them."""
        return tuple(self.toolset.tools)

    def names(self, row: Any, where: str) -> tuple[str, ...]:
        """The tools `row` (a PromptRow) may use, in the order of the configured tools; `where` names the row in an
        error (e.g. "row 17 of data.task='jsonl' split 'train'")."""
        if self.field is None:
            return self.all
        key = f"agent.tools_field={self.field!r}"
        fields = getattr(row, "fields", None) or {}
        if self.field not in fields:
            raise ValueError(f"{key}: {where} has no field '{self.field}' (its fields: "
                             f"{', '.join(sorted(map(str, fields))) or 'none'}); give every row a list of tool names "
                             f"([] for none), or set agent.tools_field=null to give every row every tool")
        value = fields[self.field]
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
                not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key}: {where} has {self.field}={value!r:.200}; give a list of tool names, e.g. "
                             f"{list(self.all[:2])} ([] for none)")
        for name in value:
            if name not in self.toolset:
                close = difflib.get_close_matches(name, self.all, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"{key}: {where} names the tool '{name}', which is not configured{hint}; the tools "
                                 f"are: {', '.join(self.all)}. Configure it (agent.tools, agent.mcp_servers or the "
                                 f"environment's tools) or fix the row's '{self.field}'")
        chosen = set(value)
        return tuple(n for n in self.all if n in chosen)

    def bridge(self, names: tuple[str, ...]) -> ChatBridge | None:
        """The chat bridge showing these tools (made and checked once per set); None for raw-text prompts."""
        if self.full is None or names == self.all:
            return self.full
        if names not in self._bridges:
            bridge = self.full.with_tools([self.toolset[n].schema for n in names])
            bridge.check(tools=bool(names), user_turns=self.user_turns)
            self._bridges[names] = bridge
        return self._bridges[names]

    def check_rows(self, rows: Sequence[Any], where: str) -> int:
        """Check every row's tool set (`where`: the rows' source, e.g. "data.task='jsonl' split 'train'") and make
        the bridge of each distinct set; returns how many distinct sets there are."""
        sets = {self.names(row, f"row {i} of {where}") for i, row in enumerate(rows)}
        for names in sets:
            self.bridge(names)
        return len(sets)
