"""`AgentOptions`: the `agent` config section (tools, an environment, the tool-call format and the budgets).

Cheap checks (types, ranges) run when the section is built; everything that needs the tokenizer or imports
user code (tools, the environment class, the chat template) is checked by `Agent(tokenizer, options)`, before
anything slow. Every error names the key as `agent.<key>` and says how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["auto", "hermes", "llama3_json", "mistral", "harmony", "raw"]
FORMATS = ("auto", "hermes", "llama3_json", "mistral", "harmony", "raw")
History = Literal["as_sampled", "append_only"]
BUILTIN_TOOLS = ("calculator", "python")


@dataclass
class AgentOptions:
    """Multi-turn episodes: the model may call tools and/or act in an environment over several turns.

    Nothing here is on unless `tools`, `environment`, `mcp_servers` or `driver` is set (`enabled`).
    """

    # Tools the model may call: the built-ins "calculator" (exact arithmetic) and "python" (runs code in the
    # code sandbox), or "module:function" for your own (the current folder is importable). A function needs type
    # hints and a Google-style docstring with an `Args:` section (its JSON schema is what the chat template
    # shows the model). [] = no tools. From Python you may also pass the functions themselves.
    tools: list[str] = field(default_factory=list)
    # An environment class "module:Class" for tasks that are not tool calls (docs/agents.md, "Environments"):
    # one instance per episode, `reset(row) -> first observation`, `step(text) -> (observation, reward, done)`.
    # Or a server's URL "http://host:port" that speaks reset/step over HTTP (docs/agents.md, "HTTP environments"),
    # whose client options are agent.env_options.
    # None = no environment: an episode ends at the first model turn without a tool call.
    environment: str | None = None
    env_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's constructor
    # Options of each tool, by tool name. "python": timeout_seconds (default tool_timeout_s), memory_mb (512),
    # output_kb (64), num_workers (null = CPU count). "calculator": max_digits (1000). A function tool: values of
    # its parameters, bound and hidden from the model (e.g. an API key or a data folder).
    tool_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # How tool calls are written. auto: from the tokenizer's chat template (Qwen/Hermes `<tool_call>` JSON,
    # Llama 3.1/3.2 bare JSON, Mistral `[TOOL_CALLS]`, GPT-OSS harmony `to=functions.f ... <|call|>`), and the
    # raw-text protocol for raw-text prompts. hermes | llama3_json | mistral | harmony: that chat format.
    # raw: `<call>name(arg=value)</call>` answered by `<result>...</result>`, for base models and raw prompts
    # (docs/agents.md, "The raw protocol").
    format: ToolFormat = "auto"
    # A chat template that replaces the tokenizer's: a path to a jinja file or a shipped name ("qwen2.5": the
    # Qwen2.5 tool template). None: the tokenizer's, or "qwen2.5" when the format is hermes and the tokenizer's
    # ChatML template cannot render tools. Checked when the agent is built (see agent.history).
    chat_template: str | None = None
    # What is trained when the chat template re-renders earlier turns once later messages are added (Qwen3 drops
    # earlier reasoning, GPT-OSS earlier analysis; docs/agents.md "Templates that re-render history").
    # as_sampled: each turn as the model was given it and sampled it (every model token, the reasoning of earlier
    # turns included, and each observation as the template renders it right after the model's latest turn);
    # a warning says what a re-render would change. append_only: refuse such templates.
    history: History = "as_sampled"
    # The system message of chat prompts that have none (a prompt's own, e.g. from data.options.system_prompt,
    # stays). None: what the chat template writes without one; the shipped qwen2.5 template (substituted for a ChatML
    # template that cannot render tools, or named in agent.chat_template) writes the model's own template's default
    # system message (Qwen's for Qwen2.5, SmolLM2's for SmolLM2), else "You are a helpful assistant.".
    system_prompt: str | None = None
    # A row field naming, per row, which of the configured tools (agent.tools, the environment's tools, MCP tools)
    # that row's episodes may use: a list of tool names ([] = none). The chat template shows the model only those;
    # a call to another is answered as one to an unknown tool. Every row must have it; a name that is not a
    # configured tool is refused before the weights load, naming the row. None: every row gets every tool.
    tools_field: str | None = None
    max_turns: int = 8  # model turns per episode; an episode still calling tools after this many is truncated
    max_turn_tokens: int | None = None  # most tokens of one model turn (None: only the episode budget)
    tool_timeout_s: float = 10.0  # wall time of one tool call (a hung call is abandoned and answered by an error)
    max_tool_output_chars: int = 4000  # longer tool results are cut in the middle (marked) before the model sees them
    max_parallel_tools: int = 8  # tool calls and environment steps of the rollout run in this many threads at most
    # Weight of the episode's own reward (EpisodeRecord.reward: the environment's, or agent.driver's) in the total
    # reward, beside the reward functions of `reward.reward_funcs`.
    environment_reward_weight: float = 1.0
    # MCP servers whose tools the model may call (docs/agents.md, "MCP tools"; needs the agents-mcp extra): a list
    # of {name, command: [program, args...], env: {VAR: value}, cwd, tools: [names] (default all),
    # startup_timeout_s (60)}. Each is started over stdio when the agent is built and stopped with the run.
    mcp_servers: list[dict[str, Any]] = field(default_factory=list)

    # Your own episode driver "module:Class" in place of the built-in one (docs/agents.md, "Your own driver"): a
    # class implementing logitless.rollout.episodes.EpisodeDriver (begin, respond, finish; turn_end_ids,
    # turn_stops, max_turn_tokens), built for each rollout as Class(tokenizer=, rows=, num_generations=,
    # **driver_options). Token in, token out: it reads the model's sampled ids and returns the ids to append.
    # None = the built-in driver of agent.tools / agent.environment (which agent.driver replaces: set one of them).
    driver: str | None = None
    driver_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the driver's constructor
    # Episodes per step written to episodes.jsonl in the run folder (the whole conversation with its tool calls and
    # results, the rewards, the step; docs/agents.md "Traces"); `logitless eval --output F.json` writes a sample
    # of its episodes to F.episodes.jsonl. 0 = no traces.
    trace_episodes: int = 4

    def __post_init__(self) -> None:
        def bad(key: str, fix: str) -> ValueError:
            return ValueError(f"agent.{key}={getattr(self, key)!r} is invalid: {fix}")

        if isinstance(self.tools, (str, bytes)) or not isinstance(self.tools, (list, tuple)):
            raise bad("tools", 'give a list, e.g. agent.tools=[calculator] or ["mytools:search"]')
        for t in self.tools:
            if not (callable(t) or (isinstance(t, str) and t.strip())):
                raise bad("tools", f"{t!r} is neither a built-in name {list(BUILTIN_TOOLS)}, 'module:function' "
                                   "nor a function")
        names = [t for t in self.tools if isinstance(t, str)]
        dupes = sorted({t for t in names if names.count(t) > 1})
        if dupes:
            raise bad("tools", f"{dupes} listed twice; list each tool once")
        if self.environment is not None and not (
            isinstance(self.environment, type) or (isinstance(self.environment, str) and ":" in self.environment)
        ):
            raise bad("environment", "give the class as 'module:Class' (e.g. 'mygame:GuessEnv'), or null for none")
        if not isinstance(self.env_options, dict):
            raise bad("env_options", "give a mapping of constructor keyword arguments, e.g. {size: 5}")
        if self.env_options and self.environment is None:
            raise bad("env_options", "options for an environment, but agent.environment is null: set "
                                     "agent.environment='module:Class' or remove agent.env_options")
        if not isinstance(self.tool_options, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in self.tool_options.items()
        ):
            raise bad("tool_options", "give {tool name: {option: value}}, e.g. {python: {timeout_seconds: 5}}")
        if self.format not in FORMATS:
            raise bad("format", f"use one of {list(FORMATS)}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise bad("chat_template", "give a path to a jinja file, a shipped name ('qwen2.5'), or null")
        if self.history not in ("as_sampled", "append_only"):
            raise bad("history", "use as_sampled (train each turn as the model sampled it) or append_only (refuse "
                                 "chat templates that re-render earlier turns)")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise bad("system_prompt", "give the system message as text, or null for the chat template's default")
        if self.tools_field is not None and (not isinstance(self.tools_field, str) or not self.tools_field):
            raise bad("tools_field", "give the name of the row field that lists each row's tools (e.g. tools), or "
                                     "null for every tool on every row")
        if not _int(self.max_turns) or self.max_turns < 1:
            raise bad("max_turns", "use an int >= 1 (model turns per episode)")
        if self.max_turn_tokens is not None and (not _int(self.max_turn_tokens) or self.max_turn_tokens < 1):
            raise bad("max_turn_tokens", "use an int >= 1, or null for the episode budget alone")
        if not _number(self.tool_timeout_s) or not 0 < self.tool_timeout_s <= 3600:
            raise bad("tool_timeout_s", "use seconds in (0, 3600]")
        if not _int(self.max_tool_output_chars) or self.max_tool_output_chars < 64:
            raise bad("max_tool_output_chars", "use an int >= 64 (characters of a tool result the model sees)")
        if not _int(self.max_parallel_tools) or self.max_parallel_tools < 1:
            raise bad("max_parallel_tools", "use an int >= 1 (threads running tool calls)")
        if not _number(self.environment_reward_weight):
            raise bad("environment_reward_weight", "use a finite number (1.0 = as much as one reward function)")
        from logitless.agents.mcp_tools import parse_servers

        parse_servers(self.mcp_servers)
        self._check_driver_and_traces(bad)

    def _check_driver_and_traces(self, bad: Any) -> None:
        """The checks of agent.driver, agent.driver_options and agent.trace_episodes that need no import."""
        if self.driver is not None and not (
            isinstance(self.driver, type) or (isinstance(self.driver, str) and ":" in self.driver)
        ):
            raise bad("driver", "give the class as 'module:Class' (e.g. 'mydriver:ShellDriver'), or null for the "
                                "built-in driver")
        if self.driver is not None and (self.tools or self.environment is not None or self.mcp_servers):
            raise bad("driver", "your driver replaces the built-in one that runs agent.tools, agent.mcp_servers and "
                                "agent.environment; set agent.tools=[], agent.mcp_servers=[] and "
                                "agent.environment=null (run tools inside your driver), or agent.driver=null")
        if self.driver is not None and self.tools_field is not None:
            raise bad("tools_field", "per-row tool sets choose among the built-in driver's tools, which agent.driver "
                                     "replaces: set agent.tools_field=null (read the row's fields in your driver)")
        if not isinstance(self.driver_options, dict):
            raise bad("driver_options", "give a mapping of constructor keyword arguments, e.g. {max_rounds: 3}")
        if self.driver_options and self.driver is None:
            raise bad("driver_options", "options for a driver, but agent.driver is null: set "
                                        "agent.driver='module:Class' or remove agent.driver_options")
        if not _int(self.trace_episodes) or self.trace_episodes < 0:
            raise bad("trace_episodes", "use an int >= 0 (episodes per step written to episodes.jsonl; 0 = none)")

    @property
    def enabled(self) -> bool:
        """Whether episodes are multi-turn: tools, MCP servers, an environment or your own driver is configured."""
        return bool(self.tools) or bool(self.mcp_servers) or self.environment is not None or self.driver is not None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
