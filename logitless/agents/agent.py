"""`Agent`: a run's agent section checked and built once (tools, MCP servers, the environment or your own driver,
the chat format); `Agent.driver(rows, G)` gives the `AgentDriver` of one rollout (`driver.py`).

    agent = Agent(tokenizer, AgentOptions(tools=["calculator"]))      # every bad option refused here
    driver = agent.driver(rows, num_generations=8)                     # one per rollout
    batch = engine.generate(driver.prompt_ids, sampling, episodes=driver)
"""

from __future__ import annotations

from typing import Any, Sequence

from logitless.agents.custom import ConfiguredDriver, load_driver
from logitless.agents.driver import AgentDriver
from logitless.agents.environment import load_environment
from logitless.agents.http_env import http_environment, is_url
from logitless.agents.mcp_tools import McpServers, parse_servers
from logitless.agents.options import AgentOptions
from logitless.agents.python_tool import python_tool
from logitless.agents.rowtools import RowTools
from logitless.agents.templates import CHAT_FORMATS, chat_side
from logitless.agents.tools import Tool, ToolSet, calculator_tool, function_tool, load_function


class Agent:
    """Tools, an environment class, a parser and a chat-template bridge, loaded and checked once."""

    def __init__(self, tokenizer: Any, options: AgentOptions, template_kwargs: dict[str, Any] | None = None,
                 processor: Any = None) -> None:
        """`template_kwargs`: the chat template's own variables (data.chat_template_kwargs, e.g. enable_thinking).
        `processor`: a vision-language model's processor (its chat template renders images, and it expands the
        images of prompts and observations); None for a text model, whose observations cannot hold images."""
        if not isinstance(options, AgentOptions):
            raise TypeError(f"Agent options must be an AgentOptions, got {type(options).__name__}")
        self.tokenizer, self.options, self.processor = tokenizer, options, processor
        self.toolset = ToolSet()
        self.custom = None  # agent.driver: your own driver, which replaces the tools, environment and template
        self.env, self.mcp, self.chat_format, self.bridge, self.row_tools = None, None, None, None, None
        if options.driver is not None:
            self.custom = load_driver(options.driver, options.driver_options)
            return
        for spec in options.tools:
            if spec not in ("calculator", "python"):
                spec = load_function(spec, "agent.tools")
            name = spec if isinstance(spec, str) else getattr(spec, "__name__", "")
            opts = dict(options.tool_options.get(name, {}))
            if spec == "calculator":
                try:
                    tool = calculator_tool(opts, options.tool_timeout_s)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"agent.tool_options.calculator: {e}") from None
            elif spec == "python":
                tool = python_tool(opts, options.tool_timeout_s)
            else:
                tool = function_tool(spec, opts, options.tool_timeout_s)
            self.toolset.add(tool, "agent.tools")
        try:  # what is started here (an HTTP environment's connection, MCP servers) is closed on any error
            if options.environment is not None:
                load = http_environment if is_url(options.environment) else load_environment
                self.env = load(options.environment, options.env_options, options.tool_timeout_s)
                for tool in self.env.tools:
                    self.toolset.add(tool, f"agent.environment ({self.env.name}.tools)")
            for key in options.tool_options:
                if key not in self.toolset:
                    raise ValueError(f"agent.tool_options.{key}: no tool is named '{key}'; the tools are "
                                     f"{list(self.toolset.tools) or 'none'}")
            if options.mcp_servers:  # started last: every cheaper check above has passed
                self.mcp = McpServers(parse_servers(options.mcp_servers), options.tool_timeout_s)
                for tool in self.mcp.tools:
                    self.toolset.add(tool, f"agent.mcp_servers (the tool '{tool.name}')")
            own = getattr(processor, "chat_template", None) if processor is not None else None
            self.chat_format, self.bridge = chat_side(tokenizer, options, self.toolset, self.env is not None,
                                                      template_kwargs, own if isinstance(own, str) else None)
            self.row_tools = RowTools(options.tools_field, self.toolset, self.bridge, self.env is not None)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the MCP servers and close the environment server's connection (idempotent)."""
        if self.mcp is not None:
            self.mcp.close()
        if self.env is not None:
            self.env.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tools(self) -> dict[str, Tool]:
        return self.toolset.tools

    def driver(self, rows: Sequence[Any], num_generations: int) -> AgentDriver | ConfiguredDriver:
        """A driver for one rollout of `rows` (PromptRow) with `num_generations` episodes each (agent.driver's
        class when one is set)."""
        if not rows:
            raise ValueError("Agent.driver: no rows")
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"Agent.driver: num_generations must be an int >= 1, got {num_generations!r}")
        if self.custom is not None:
            return self.custom.make(self.tokenizer, rows, num_generations)
        chat = [isinstance(r.prompt, list) for r in rows]
        if all(chat):
            if self.bridge is None:
                why = ("agent.format=raw" if self.options.format == "raw" else "the tokenizer has no chat template")
                raise ValueError(f"the prompts are chat messages but {why}: use raw-text prompts (data chat=false) or "
                                 "set agent.format/agent.chat_template for a chat format")
            return AgentDriver(self, rows, num_generations, self.chat_format)
        if not any(chat):
            if self.options.system_prompt is not None:
                raise ValueError("agent.system_prompt is the system message of chat prompts, but the prompts are raw "
                                 "text: write it into the prompts (data.options.system_prompt), or set data chat=true")
            if self.options.format in CHAT_FORMATS:
                raise ValueError(f"agent.format={self.options.format} needs chat prompts but the prompts are raw "
                                 "text: set data chat=true, or agent.format=raw (or auto) for the raw protocol")
            return AgentDriver(self, rows, num_generations, "raw")
        raise ValueError("the prompts mix raw text and chat messages; give one kind per run")
