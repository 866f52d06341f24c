"""Multi-turn agents: tools and environments answering the model between turns (docs/agents.md).

    from logitless.agents import Agent, AgentOptions
    agent = Agent(tokenizer, AgentOptions(tools=["calculator"]))
    driver = agent.driver(rows, num_generations=8)   # a logitless.rollout.episodes.EpisodeDriver
"""

from logitless.agents.calculator import Calculator, CalculatorError
from logitless.agents.agent import Agent
from logitless.agents.driver import AgentDriver
from logitless.agents.environment import Environment
from logitless.agents.options import AgentOptions
from logitless.agents.parsing import PARSERS, ParsedTurn, ToolCall
from logitless.agents.templates import ChatBridge
from logitless.agents.tools import AgentFatalError, Tool, ToolInputError, ToolResult

__all__ = [
    "Agent",
    "AgentFatalError",
    "AgentDriver",
    "AgentOptions",
    "Calculator",
    "CalculatorError",
    "ChatBridge",
    "Environment",
    "PARSERS",
    "ParsedTurn",
    "Tool",
    "ToolCall",
    "ToolInputError",
    "ToolResult",
]
