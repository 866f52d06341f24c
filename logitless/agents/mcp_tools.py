"""MCP tools: the tools of stdio MCP servers (`agent.mcp_servers`), called like local tools.

Each server is a command started when the agent is built (`Agent`, before the model's weights load) and stopped
by `Agent.close()` (at the run's end, also after an error or a stop; at interpreter exit at the latest). A
server's process runs in its own session, so a Ctrl-C in the terminal reaches logitless, which stops it; a server
whose parent dies reads the end of its stdin and exits. The servers' tools are listed at build: each becomes a
`Tool` whose schema is the MCP tool's `inputSchema`, checked, timed out and answered like any other tool
(`Error: ...` for a result flagged `isError`). A server that exits during the run fails it (`AgentFatalError`).

The official `mcp` SDK (the `agents-mcp` extra) runs in one event loop on a daemon thread; the tool threads of
the rollout submit their calls to it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

from logitless.agents.tools import AgentFatalError, Tool, ToolInputError

INSTALL = "pip install 'logitless[agents-mcp]' (or pip install mcp)"
SPEC_KEYS = ("name", "command", "env", "cwd", "tools", "startup_timeout_s")


@dataclass
class McpServerSpec:
    """One entry of agent.mcp_servers."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the few variables a server inherits (PATH, HOME..)
    cwd: str | None = None
    tools: list[str] | None = None  # the server's tools the model gets (None: all)
    startup_timeout_s: float = 60.0  # start, initialize and list the tools within this


def parse_servers(value: Any) -> list[McpServerSpec]:
    """agent.mcp_servers checked and read (no import of the SDK); raises ValueError naming the entry and the fix."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"agent.mcp_servers={value!r} is invalid: give a list of servers, e.g. "
                         "[{name: files, command: [npx, -y, '@modelcontextprotocol/server-filesystem', /data]}]")
    specs: list[McpServerSpec] = []
    for i, entry in enumerate(value):
        where = f"agent.mcp_servers[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}={entry!r} is invalid: give {{name: ..., command: [program, args...]}}")
        unknown = [k for k in entry if k not in SPEC_KEYS]
        if unknown:
            raise ValueError(f"{where}: {unknown} are not server options; they are {list(SPEC_KEYS)}")
        name, command = entry.get("name"), entry.get("command")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.name={name!r} is invalid: give the server a name (used in messages)")
        if isinstance(command, str):
            command = command.split()
        if not isinstance(command, (list, tuple)) or not command or not all(isinstance(c, str) and c for c in command):
            raise ValueError(f"{where}.command={command!r} is invalid: give the program and its arguments as a list, "
                             "e.g. [python, my_server.py]")
        env = entry.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                for k, v in env.items()):
            raise ValueError(f"{where}.env={env!r} is invalid: give {{VARIABLE: value}}")
        cwd, tools = entry.get("cwd"), entry.get("tools")
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError(f"{where}.cwd={cwd!r} is invalid: give a folder, or leave it out")
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, str) for t in tools)):
            raise ValueError(f"{where}.tools={tools!r} is invalid: give a list of the server's tool names, or leave "
                             "it out for all of them")
        timeout = entry.get("startup_timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError(f"{where}.startup_timeout_s={timeout!r} is invalid: give seconds in (0, 3600]")
        if any(s.name == name for s in specs):
            raise ValueError(f"{where}.name={name!r}: two servers are named so; give each its own name")
        specs.append(McpServerSpec(name, list(command), {k: str(v) for k, v in env.items()}, cwd,
                                   None if tools is None else list(tools), float(timeout)))
    return specs


def result_text(result: Any) -> str:
    """The text the model reads of an MCP CallToolResult: its text contents joined by newlines, other contents
    named (an image by its type), or the structured content as JSON when there is no content."""
    parts = []
    for item in result.content or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and hasattr(getattr(item, "resource", None), "text"):
            parts.append(item.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
        else:
            parts.append(f"[{kind} content: {getattr(item, 'mime_type', None) or 'not text'}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False, default=str)
    return "\n".join(parts)


class McpServers:
    """The running servers of agent.mcp_servers and their tools (`tools`), until `close()`."""

    def __init__(self, specs: list[McpServerSpec], timeout_s: float) -> None:
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError(f"agent.mcp_servers needs the MCP SDK, which is not installed: {INSTALL}") from None
        self.specs, self.timeout_s = specs, timeout_s
        self.tools: list[Tool] = []
        self._sessions: dict[str, Any] = {}
        self._ready = threading.Event()
        self._failure: str | None = None  # why the servers did not start
        self._stop: asyncio.Event | None = None
        self._closed = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="logitless-mcp", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        self._main = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        bound = sum(s.startup_timeout_s for s in self.specs) + 10.0
        if not self._ready.wait(bound):
            raise ValueError(f"agent.mcp_servers: the servers did not start within {bound:g} s")
        if self._failure is not None:
            raise ValueError(self._failure) from None

    async def _serve(self) -> None:
        """Start every server (its process, the session, the tool listing), then hold them until close()."""
        import anyio
        from mcp import ClientSession, StdioServerParameters, stdio_client

        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as stack:
            for i, spec in enumerate(self.specs):
                where = f"agent.mcp_servers[{i}] '{spec.name}' ({' '.join(spec.command)})"
                errlog = stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
                try:
                    params = StdioServerParameters(command=spec.command[0], args=spec.command[1:],
                                                   env=spec.env or None, cwd=spec.cwd)
                    # (the contexts enter outside the deadline's scope: their task groups outlive it)
                    read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
                    session = await stack.enter_async_context(ClientSession(read, write))
                    with anyio.fail_after(spec.startup_timeout_s):
                        await session.initialize()
                        listed = await _list_tools(session)
                except BaseException as e:  # noqa: BLE001 (reported to the main thread, which raises)
                    self._fail(_start_failure(where, spec, errlog, e))
                    return  # the exit stack stops the servers started so far
                try:
                    self.tools += self._tools(spec, session, listed)
                except ValueError as e:
                    self._fail(f"{where}: {e}")
                    return
                self._sessions[spec.name] = session
            self._ready.set()
            await self._stop.wait()

    def _fail(self, message: str) -> None:
        self._failure = message
        self._ready.set()

    def _tools(self, spec: McpServerSpec, session: Any, listed: list[Any]) -> list[Tool]:
        by_name = {t.name: t for t in listed}
        wanted = spec.tools if spec.tools is not None else list(by_name)
        missing = [n for n in wanted if n not in by_name]
        if missing:
            raise ValueError(f"names {missing} in tools, which the server does not serve; it serves {list(by_name)}")
        tools = []
        for name in wanted:
            t = by_name[name]
            schema = {"type": "function", "function": {"name": name, "description": (t.description or "").strip(),
                                                       "parameters": t.input_schema or {"type": "object"}}}
            tools.append(Tool(name, schema, fn=self._caller(spec.name, session, name), timeout_s=self.timeout_s))
        return tools

    def _caller(self, server: str, session: Any, name: str) -> Any:
        def call(**arguments: Any) -> str:
            from mcp import MCPError
            from mcp_types import CONNECTION_CLOSED

            if self._closed:
                raise AgentFatalError(f"agent.mcp_servers: the server '{server}' was stopped (the agent is closed)")
            future = asyncio.run_coroutine_threadsafe(session.call_tool(name, arguments), self.loop)
            try:  # the rollout abandons the call at its timeout; this thread then stops waiting and cancels it
                result = future.result(timeout=self.timeout_s + 1.0)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise TimeoutError(f"no answer within {self.timeout_s:g} s") from None
            except MCPError as e:
                if e.code == CONNECTION_CLOSED:
                    raise AgentFatalError(f"agent.mcp_servers: the server '{server}' closed the connection (it exited "
                                          f"or crashed) while {name} was called; fix the server and resume the run") from None
                raise ToolInputError(e.error.message) from None
            text = result_text(result)
            if result.is_error:
                raise ToolInputError(text or f"{name} failed")
            return text

        return call

    def close(self) -> None:
        """Stop the servers (each: stdin closed, then SIGTERM and SIGKILL to its process group if it lingers) and
        the event loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        with contextlib.suppress(Exception):
            self._main.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


async def _list_tools(session: Any) -> list[Any]:
    tools, cursor = [], None
    while True:
        if cursor is None:
            page = await session.list_tools()
        else:
            from mcp_types import PaginatedRequestParams

            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor))
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _start_failure(where: str, spec: McpServerSpec, errlog: Any, e: BaseException) -> str:
    """Why a server did not start, with the end of what it wrote to stderr, and what to check."""
    if isinstance(e, TimeoutError):
        why = f"did not start and list its tools within startup_timeout_s={spec.startup_timeout_s:g}"
    else:
        why = f"failed to start ({type(e).__name__}: {e})"
    tail = ""
    with contextlib.suppress(Exception):
        errlog.seek(0)
        tail = errlog.read()[-1500:].strip()
    tail = f"; its stderr ends:\n{tail}\n" if tail else ""
    return (f"{where} {why}{tail}; check its command, cwd and env (a server inherits only PATH, HOME, SHELL, TERM, "
            "USER and LOGNAME, plus its env)")
