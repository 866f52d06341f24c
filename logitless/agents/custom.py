"""Your own episode driver, named in the config (`agent.driver: module:Class`, docs/agents.md "Your own driver").

The class implements `logitless.rollout.episodes.EpisodeDriver` (token in, token out) and is built for each
rollout with the rollout's rows:

    class MyDriver:
        def __init__(self, tokenizer, rows, num_generations, **driver_options): ...
        turn_end_ids: list[int]          # ids that end a model turn besides EOS
        turn_stops: list[str]            # strings that end a model turn
        max_turn_tokens: int | None      # most tokens of one model turn
        prompt_ids: list[list[int]]      # optional: the prompts' token ids (default: the rows' prompts, rendered
                                         # as a single-turn rollout renders them)
        def begin(self, num_rows, num_generations): ...
        def respond(self, turns): ...    # per TurnEnd: the ids to append, or None to end the episode
        def finish(self): ...            # one EpisodeRecord per row

`load_driver` imports and checks the class before anything slow (the checks made before the weights load, and
`--dry-run`); `DriverClass.make` builds one per rollout and checks what the engines read from it. The trainer
treats the driver's episodes as the built-in driver's: its tokens are out of the loss (`env_mask`), its records'
`reward` is the `environment` reward column, their `metrics` are logged as `episode/<name>`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

from logitless.agents.environment import _import_class
from logitless.rollout.episodes import EpisodeRecord, TurnEnd

METHODS = {
    "begin": "begin(num_rows, num_generations)",
    "respond": "respond(turns) -> token ids or None per turn",
    "finish": "finish() -> one EpisodeRecord per row",
}
BUILT_WITH = ("tokenizer", "rows", "num_generations")  # the keywords every driver is built with


@dataclass
class DriverClass:
    """An imported and checked `agent.driver` class with its `agent.driver_options`."""

    cls: type
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.cls.__name__

    def make(self, tokenizer: Any, rows: Sequence[Any], num_generations: int) -> ConfiguredDriver:
        """The driver of one rollout of `rows` with `num_generations` episodes each, its attributes checked."""
        inner = self.cls(tokenizer=tokenizer, rows=list(rows), num_generations=num_generations, **self.options)
        return ConfiguredDriver(inner, self.name, rows)


def load_driver(spec: str | type, options: dict[str, Any]) -> DriverClass:
    """Import and check the class of `agent.driver`: it has the protocol's methods and its constructor takes
    tokenizer=, rows=, num_generations= and `agent.driver_options`. Refuses naming the key and the fix."""
    what = ("an episode driver is a class built for each rollout, implementing "
            "logitless.rollout.episodes.EpisodeDriver")
    cls = _import_class(spec, "agent.driver", what)
    name = cls.__name__
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"agent.driver: {name} has no method {', '.join(m + '()' for m in missing)}; an episode "
                         f"driver implements {', '.join(METHODS.values())} (logitless.rollout.episodes."
                         "EpisodeDriver, docs/agents.md 'Your own driver')")
    taken = [k for k in BUILT_WITH if k in options]
    if taken:
        raise ValueError(f"agent.driver_options: {taken} are given to every driver by the trainer; remove them "
                         "from agent.driver_options")
    try:
        inspect.signature(cls).bind(**dict.fromkeys(BUILT_WITH), **options)
    except TypeError as e:
        given = ", ".join(f"{k}=..." for k in (*BUILT_WITH, *options))
        raise ValueError(f"agent.driver_options: {name}({given}) cannot be called ({e}); its constructor takes "
                         f"{inspect.signature(cls)}: it must accept tokenizer, rows and num_generations, and a "
                         "keyword for each of agent.driver_options") from None
    return DriverClass(cls, dict(options))


class ConfiguredDriver:
    """One rollout's `agent.driver` instance, as the engines and the trainer use it: the protocol's attributes
    read from the instance and checked, `prompt_ids` its own or the rows' prompts (rendered by the engine as a
    single-turn rollout's: the chat template with the generation prompt, or the raw text)."""

    def __init__(self, inner: Any, name: str, rows: Sequence[Any]) -> None:
        self.inner, self.name = inner, name
        self.turn_end_ids = self._ids("turn_end_ids")
        stops = getattr(inner, "turn_stops", None)
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence) or not all(
                isinstance(s, str) and s for s in stops):
            raise TypeError(self._bad("turn_stops", stops, "a list of non-empty strings ([] for none)"))
        self.turn_stops = list(stops)
        cap = getattr(inner, "max_turn_tokens", None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise TypeError(self._bad("max_turn_tokens", cap, "an int >= 1, or None for the episode budget alone"))
        self.max_turn_tokens = cap
        given = getattr(inner, "prompt_ids", None)
        if given is None:
            self.prompt_ids: list[Any] = [r.prompt for r in rows]
        else:
            if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or len(given) != len(rows) or not all(
                    _int_list(p) and p for p in given):
                raise TypeError(self._bad("prompt_ids", given, f"one non-empty list of token ids per row ({len(rows)})"))
            self.prompt_ids = [list(p) for p in given]

    def _ids(self, key: str) -> list[int]:
        value = getattr(self.inner, key, None)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not _int_list(value):
            raise TypeError(self._bad(key, value, "a list of token ids ([] for none)"))
        return list(value)

    def _bad(self, key: str, value: Any, want: str) -> str:
        return (f"agent.driver: {self.name}.{key} must be {want}, got {value!r:.80}; set it in {self.name}.__init__ "
                "(logitless.rollout.episodes.EpisodeDriver)")

    def begin(self, num_rows: int, num_generations: int) -> None:
        self.inner.begin(num_rows, num_generations)

    def respond(self, turns: list[TurnEnd]) -> list[list[int] | None]:
        return self.inner.respond(turns)

    def finish(self) -> list[EpisodeRecord]:
        return self.inner.finish()


def _int_list(values: Any) -> bool:
    return isinstance(values, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in values)
