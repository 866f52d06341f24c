"""Tools the model may call: functions described by a JSON schema, arguments checked against it, results as text.

A tool is a Python function with type hints and a Google-style docstring; `transformers.utils.get_json_schema`
turns it into the schema the chat template shows the model. A call's arguments are checked against that schema
(required parameters, no unknown ones, JSON types) before the function runs; anything wrong, a function that
raises, hangs or returns megabytes becomes a result starting with `Error: ` (or a cut result), never an exception
in the trainer. Results are text: strings as they are, dicts and lists as JSON, anything else `str()`'d.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from logitless.agents.calculator import Calculator, CalculatorError
from logitless.rewards.builtin import import_user_module, missing_attribute

ERROR_PREFIX = "Error: "


@dataclass
class ToolResult:
    """What one call returned, as the model will read it."""

    text: str
    error: bool = False  # the call failed (bad call, unknown tool, raised, timed out, program error)
    timed_out: bool = False
    cut: bool = False  # the text was longer than max_tool_output_chars and was cut in the middle


@dataclass
class Tool:
    """A tool as the agent runs it.

    `fn(**arguments)` computes the result of one call. A batch tool (the python tool) instead has
    `batch(list of arguments) -> list[ToolResult]`, which runs all its calls of one turn batch at once.
    An environment method (`method=True`) is called on the episode's environment instance.
    """

    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable[..., Any] | None = None
    batch: Callable[[list[dict[str, Any]]], list[ToolResult]] | None = None
    batch_timeout: Callable[[int], float] | None = None  # seconds a batch of n calls may take
    method: bool = False
    timeout_s: float = 10.0

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def error_text(message: str) -> str:
    """The one format of every error the model sees: `Error: <what went wrong and how to call it right>`."""
    return ERROR_PREFIX + message


def to_text(value: Any) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def cut_middle(text: str, limit: int) -> tuple[str, bool]:
    """`text` cut to at most about `limit` characters by removing its middle, marked `[... N characters cut ...]`."""
    if len(text) <= limit:
        return text, False
    marker = f"\n[... {len(text) - limit:,} characters cut ...]\n"
    head = (limit + 1) // 2
    return text[:head] + marker + text[len(text) - (limit - head):], True


# ----------------------------------------------------------------------------------------------------------
# Schemas


def function_schema(fn: Callable[..., Any], where: str, hidden: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a tool function (transformers' `get_json_schema`), without the `hidden` parameters
    (those bound from agent.tool_options). Refuses, naming the function and the fix, what it cannot describe."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(_without(fn, hidden) if hidden else fn)
    except DocstringParsingException as e:
        raise ValueError(
            f"{where}: cannot describe the tool '{name}' to the model ({e}). Give it a Google-style docstring: "
            "a summary line, then 'Args:' with one 'name: description' line per parameter"
        ) from None
    except TypeHintParsingException as e:
        raise ValueError(
            f"{where}: cannot describe the tool '{name}' to the model ({e}). Give every parameter a JSON-like "
            "type hint (str, int, float, bool, list[...], dict[str, ...], Literal[...], Optional[...])"
        ) from None
    return schema


def _without(fn: Callable[..., Any], hidden: tuple[str, ...]) -> Callable[..., Any]:
    """`fn` as the model sees it: the `hidden` parameters (bound from agent.tool_options) gone from its signature
    and type hints, so its docstring need not describe them."""
    @functools.wraps(fn)
    def visible(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    visible.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in hidden])
    visible.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k not in hidden}
    return visible


# ----------------------------------------------------------------------------------------------------------
# Argument checks

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool)
    or (isinstance(v, float) and math.isfinite(v) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _describe(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False, default=str) if not isinstance(v, str) else json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_value(value: Any, schema: dict[str, Any], where: str) -> tuple[Any, str | None]:
    """(value, None) when `value` fits the schema (integers given as 3.0 become 3), else (value, the reason);
    `where` names the value in the reason (e.g. "tags[0]")."""
    if value is None and schema.get("nullable"):
        return None, None
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            v, err = check_value(value, option, where)
            if err is None:
                return v, None
        return value, f"'{where}' must match one of {[o.get('type', 'any') for o in schema['anyOf']]}, got {_describe(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return value, f"'{where}' must be one of {schema['enum']}, got {_describe(value)}"
    kinds = schema.get("type")
    if kinds is None:
        return value, None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    kind = next((k for k in kinds if _JSON_TYPES.get(k, lambda v: False)(value)), None)
    if kind is None:
        return value, f"'{where}' must be {' or '.join(kinds)}, got {_describe(value)}"
    if kind == "integer" and isinstance(value, float):
        value = int(value)
    if kind == "array":
        items, prefix = schema.get("items"), schema.get("prefixItems")
        if prefix is not None and len(value) != len(prefix):
            return value, f"'{where}' must have {len(prefix)} items, got {len(value)}"
        out = []
        for i, item in enumerate(value):
            sub = prefix[i] if prefix is not None else items
            if sub is not None:
                item, err = check_value(item, sub, f"{where}[{i}]")
                if err:
                    return value, err
            out.append(item)
        value = out
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        out_d = {}
        for k, item in value.items():
            item, err = check_value(item, schema["additionalProperties"], f"{where}[{k!r}]")
            if err:
                return value, err
            out_d[k] = item
        value = out_d
    return value, None


def check_arguments(tool: Tool, arguments: dict[str, Any], positional: list[Any] | None = None
                    ) -> tuple[dict[str, Any], str | None]:
    """The call's arguments checked against the tool's schema: (arguments, None) or (_, what is wrong)."""
    params = tool.parameters
    props: dict[str, Any] = params.get("properties", {})
    args = dict(arguments)
    if positional:
        if len(positional) > len(props):
            return args, f"{tool.name}() takes {len(props)} argument(s), got {len(positional) + len(args)}"
        for name, value in zip(props, positional):
            if name in args:
                return args, f"{tool.name}() got two values for the argument '{name}'"
            args[name] = value
    unknown = [k for k in args if k not in props]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(props), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return args, (f"{tool.name}() got an unexpected argument '{unknown[0]}'{hint}; its arguments are "
                      f"{list(props) or 'none'}")
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return args, f"{tool.name}() is missing the required argument '{missing[0]}'"
    for k in list(args):
        args[k], err = check_value(args[k], props[k], k)
        if err:
            return args, f"{tool.name}(): argument {err}"
    return args, None


def call_function(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """Call a sync or `async def` tool function (the latter in its own event loop, in this thread)."""
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**arguments))
    result = fn(**arguments)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result
        return asyncio.run(wait())
    return result


# ----------------------------------------------------------------------------------------------------------
# Built-ins and loading


class ToolInputError(ValueError):
    """Raised by a tool for a bad input; the model reads `Error: <message>` (without the exception's type)."""


class AgentFatalError(RuntimeError):
    """Raised by a tool or an environment when the run cannot go on (a server that is gone, a protocol the server
    does not speak): the rollout stops and the run fails with this message, instead of the model reading it."""


def calculator_tool(options: dict[str, Any], timeout_s: float) -> Tool:
    calc = Calculator(**options)

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly (big integers, exact decimals and fractions).

        Args:
            expression: The expression, using numbers, + - * / // % ** and parentheses, e.g. "123 * (45 + 6)".
                Functions: abs, min, max, round, floor, ceil, sqrt.
        """
        try:
            return calc(expression)
        except CalculatorError as e:
            raise ToolInputError(str(e)) from None

    return Tool("calculator", function_schema(calculator, "agent.tools"), fn=calculator, timeout_s=timeout_s)


def load_function(spec: str | Callable[..., Any], where: str) -> Callable[..., Any]:
    """A tool function from "module:function" (or the function itself)."""
    if callable(spec):
        return spec
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{where}: '{spec}' is neither a built-in tool ('calculator', 'python') nor "
                         "'module:function'; write e.g. 'mytools:search' (the current folder is importable)")
    module = import_user_module(module_name, f"{where} '{spec}'")
    if not hasattr(module, attr):
        raise missing_attribute(module, module_name, attr, where)
    fn = getattr(module, attr)
    if not callable(fn) or isinstance(fn, type):
        raise ValueError(f"{where}: '{spec}' is a {type(fn).__name__}, not a function")
    return fn


def function_tool(spec: str | Callable[..., Any], options: dict[str, Any], timeout_s: float) -> Tool:
    """A user function as a tool; `options` bind some of its parameters (hidden from the model)."""
    fn = load_function(spec, "agent.tools")
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise ValueError(f"agent.tools: {spec!r} has no name; define the tool with `def name(...)`")
    params = inspect.signature(fn).parameters
    for opt in options:
        if opt not in params:
            raise ValueError(f"agent.tool_options.{name}: '{opt}' is not a parameter of {name}(); its parameters "
                             f"are {list(params)}")
    schema = function_schema(fn, "agent.tools", hidden=tuple(options))
    bound = fn if not options else _bind(fn, options)
    return Tool(name, schema, fn=bound, timeout_s=timeout_s)


def _bind(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        async def bound_async(**kw: Any) -> Any:
            return await fn(**options, **kw)
        return bound_async

    def bound(**kw: Any) -> Any:
        return fn(**options, **kw)
    return bound


@dataclass
class ToolSet:
    """The tools of an agent by name, with their schemas in the order the template shows them."""

    tools: dict[str, Tool] = field(default_factory=dict)

    def add(self, tool: Tool, where: str) -> None:
        if tool.name in self.tools:
            raise ValueError(f"{where}: two tools are named '{tool.name}'; tool names must be unique")
        self.tools[tool.name] = tool

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def __len__(self) -> int:
        return len(self.tools)


def run_call(tool: Tool, arguments: dict[str, Any], instance: Any) -> ToolResult:
    """Run one checked call (an environment method on `instance`); what the tool raises becomes the error
    result (`ToolInputError`'s message alone, else the exception's type and message)."""
    fn = getattr(instance, tool.name) if tool.method else tool.fn
    try:
        value = call_function(fn, arguments)  # type: ignore[arg-type]
    except ToolInputError as e:
        return ToolResult(error_text(str(e)), error=True)
    except AgentFatalError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure of a tool is an answer to the model)
        return ToolResult(error_text(f"{tool.name} raised {type(e).__name__}: {e}"), error=True)
    if _is_image(value) or (isinstance(value, list) and any(_is_image(v) or (isinstance(v, dict) and v.get("type")
                                                                               == "image") for v in value)):
        raise AgentFatalError(f"the tool '{tool.name}' returned an image; tool results are text (an image reaches "
                              "the model only as an environment's observation: agent.environment's step() on a "
                              "vision-language model). Return text from the tool")
    return ToolResult(to_text(value))


def _is_image(value: Any) -> bool:
    """Whether `value` is a PIL image (without importing PIL where no tool uses it)."""
    return type(value).__module__.startswith("PIL.") and hasattr(value, "size") and hasattr(value, "mode")
