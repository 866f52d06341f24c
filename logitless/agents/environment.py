"""Environments: tasks where the model acts over several turns and something other than a tool call answers.

An environment is a class, given as `agent.environment: module:Class`; each episode gets its own instance,
built with `agent.env_options` as keyword arguments, so episodes never share state:

    class GuessNumber:
        tools = ["hint"]                       # optional: methods the model may call as tools

        def __init__(self, high: int = 100): ...
        def reset(self, row: dict) -> str | None:
            '''Start the episode for a dataset row (its fields, and "prompt"); the first observation, appended
            to the prompt (None: nothing).'''
        def step(self, text: str) -> tuple[str | None, float | None, bool]:
            '''After each model turn that makes no tool call: (observation, reward, done).'''
        def hint(self, guess: int) -> str:     # a tool: typed, with a Google-style docstring
            '''...'''
        def reward(self) -> float | None:      # optional: a final reward when the episode ends
        def close(self) -> None:               # optional: release resources after reward()

The episode's reward (`EpisodeRecord.reward`) is the sum of the rewards `step` returned plus `reward()`,
None when none of them gave a number. All `num_generations` episodes of one prompt must get the same first
observation from `reset` (GRPO compares samples of one state): seed any randomness from the row.
"""

from __future__ import annotations

import difflib
from logitless.rewards.builtin import import_user_module
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from logitless.agents.tools import Tool, function_schema


@runtime_checkable
class Environment(Protocol):
    """The protocol an environment class implements (see the module docstring); `tools`, `reward` and `close`
    are optional."""

    def reset(self, row: dict[str, Any]) -> str | None: ...

    def step(self, text: str) -> tuple[str | None, float | None, bool]: ...


@dataclass
class EnvironmentClass:
    """A checked environment class: how to build an instance, and its methods exposed as tools."""

    cls: type
    options: dict[str, Any]
    tools: list[Tool] = field(default_factory=list)
    has_reward: bool = False
    has_close: bool = False
    label: str | None = None  # the name in messages (default: the class's)
    resource: Any = None  # something with close() shared by the episodes (an HTTP environment's connection)

    @property
    def name(self) -> str:
        return self.label or self.cls.__name__

    def close(self) -> None:
        """Release what the episodes share (at the agent's close)."""
        if self.resource is not None:
            self.resource.close()

    def make(self) -> Any:
        """A fresh instance for one episode."""
        return self.cls(**self.options)


def load_environment(spec: str | type, options: dict[str, Any], timeout_s: float) -> EnvironmentClass:
    """Import and check an environment class; refuses, naming agent.environment / agent.env_options and the fix,
    a class that does not implement the protocol or cannot be built with the options. (A URL is an environment
    server: logitless.agents.http_env.http_environment.)"""
    cls = _import_class(spec)
    name = cls.__name__
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"agent.environment: {name} has no method {method}(); an environment implements "
                             "reset(row) -> first observation and step(text) -> (observation, reward, done)")
    for method, count in (("reset", 1), ("step", 1)):
        params = [p for p in inspect.signature(getattr(cls, method)).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # after self
        if len(params) < count and not any(p.kind is p.VAR_POSITIONAL
                                           for p in inspect.signature(getattr(cls, method)).parameters.values()):
            raise ValueError(f"agent.environment: {name}.{method}() must take one argument "
                             f"({'the row: dict' if method == 'reset' else 'the model turn text: str'})")
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(f"agent.env_options: {name}({', '.join(f'{k}=...' for k in options)}) cannot be called "
                         f"({e}); its constructor takes {inspect.signature(cls)}") from None
    names = getattr(cls, "tools", None) or []
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"agent.environment: {name}.tools must be a list of method names, got {names!r}")
    tools = []
    for tool_name in names:
        fn = getattr(cls, tool_name, None)
        if not callable(fn) or tool_name.startswith("_") or tool_name in ("reset", "step", "reward", "close"):
            methods = [m for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m))]
            close = difflib.get_close_matches(tool_name, methods, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"agent.environment: {name}.tools names '{tool_name}', which is not a public method "
                             f"of {name} other than reset/step/reward/close{hint}")
        schema = function_schema(fn, f"agent.environment ({name}.tools)")
        tools.append(Tool(tool_name, schema, fn=fn, method=True, timeout_s=timeout_s))
    return EnvironmentClass(cls, dict(options), tools, callable(getattr(cls, "reward", None)),
                            callable(getattr(cls, "close", None)))


def _import_class(spec: str | type, key: str = "agent.environment",
                  what: str = "an environment is a class whose instances hold one episode's state") -> type:
    """The class `spec` names ("module:Class", or the class itself); refuses, naming `key`, a module that does not
    import, a missing name (with the closest class of the module) and a name that is not a class (`what` says
    what it should be)."""
    if isinstance(spec, type):
        return spec
    module_name, _, attr = spec.partition(":")
    module = import_user_module(module_name, f"{key} '{spec}'")
    cls = getattr(module, attr, None)
    if cls is None:
        public = [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n), type)]
        close = difflib.get_close_matches(attr, public, n=1)
        hint = f"; did you mean '{module_name}:{close[0]}'?" if close else ""
        raise ValueError(f"{key}: module '{module_name}' has no class '{attr}'{hint}")
    if not isinstance(cls, type):
        raise ValueError(f"{key}: '{spec}' is a {type(cls).__name__}, not a class; {what}")
    return cls


def check_step(env_name: str, value: Any) -> tuple[str | list[dict[str, Any]] | None, float | None, bool]:
    """A `step` return value as (observation, reward, done); a wrong shape is a bug in the environment and
    raises TypeError naming it. An observation is a str, None, or holds images (a vision-language model): a PIL
    image, or content blocks ({"type": "text", "text": ...} and {"type": "image", "image": a PIL image or a
    file path}), returned as content blocks."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"{env_name}.step() must return (observation: str | None, reward: float | None, "
                        f"done: bool), got {value!r:.100}")
    obs, reward, done = value
    if obs is not None and not isinstance(obs, str):
        obs = observation_blocks(obs, f"{env_name}.step()")
    return obs, check_reward(f"{env_name}.step()", reward), bool(done)


def observation_blocks(obs: Any, where: str) -> list[dict[str, Any]]:
    """An observation with images as chat content blocks: a PIL image is one image block; a list of blocks is
    checked (each {"type": "text", "text": str} or {"type": "image", "image": PIL image or path}). TypeError naming
    `where` for anything else."""
    from PIL import Image

    if isinstance(obs, Image.Image):
        return [{"type": "image", "image": obs}]
    fix = ("return a str, None, a PIL image, or a list of content blocks ({'type': 'text', 'text': ...} / "
           "{'type': 'image', 'image': a PIL image or a file path})")
    if not isinstance(obs, list) or not obs:
        raise TypeError(f"{where} returned an observation of type {type(obs).__name__}; {fix}")
    for block in obs:
        kind = block.get("type") if isinstance(block, dict) else None
        ok = (kind == "text" and isinstance(block.get("text"), str)) or (
            kind == "image" and isinstance(block.get("image"), (str, Image.Image)))
        if not ok:
            raise TypeError(f"{where} returned the content block {block!r:.80}; {fix}")
    return [dict(b) for b in obs]


def has_image(obs: Any) -> bool:
    """Whether an observation (`check_step`'s) holds an image."""
    return isinstance(obs, list) and any(b["type"] == "image" for b in obs)


def check_reward(where: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{where} returned the reward {value!r}; return a finite number or None")
    return float(value)


def check_first(env_name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{env_name}.reset() returned {type(value).__name__}; return the first observation (a "
                        "str) or None")
    return value
