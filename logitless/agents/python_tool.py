"""The built-in `python` tool: run the model's code in the code sandbox and answer with what it printed.

All `python` calls of one batch of turns run together through `SandboxPool.execute` (the sandbox's workers run
them in parallel; each program has its own wall-clock, memory and output limits and is killed at its timeout).
The model reads the program's standard output; a program that raises, times out or exceeds a limit is answered
by its output so far followed by `Error: ...` and counts as a tool error.
"""

from __future__ import annotations

from typing import Any

from logitless.agents.tools import Tool, ToolResult, error_text, function_schema

OPTIONS = ("timeout_seconds", "memory_mb", "output_kb", "num_workers")


def python(code: str) -> str:
    """Run Python code in a fresh interpreter and return what it prints (use print() to see values).

    Args:
        code: A complete Python program, e.g. "print(sum(i * i for i in range(10)))". The standard library is
            available; there is no network or file access outside a temporary folder.
    """
    raise RuntimeError("the python tool runs through PythonTool.batch")  # the schema's source only


class PythonTool:
    """Runs batches of programs through a process-wide `SandboxPool` with these limits."""

    def __init__(self, options: dict[str, Any], default_timeout: float) -> None:
        from logitless.rewards.sandbox import SandboxOptions, SandboxPool

        unknown = [k for k in options if k not in OPTIONS]
        if unknown:
            raise ValueError(f"agent.tool_options.python: unknown option '{unknown[0]}'; the options are "
                             f"{list(OPTIONS)}")
        if not callable(getattr(SandboxPool, "execute", None)):
            raise ValueError("agent.tools: the python tool needs SandboxPool.execute (logitless.rewards.sandbox), "
                             "which this installation lacks; update logitless or remove 'python' from agent.tools")
        num_workers = options.get("num_workers")
        if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int)
                                        or num_workers < 1):
            raise ValueError(f"agent.tool_options.python.num_workers must be a positive int or null (= CPU count), "
                             f"got {num_workers!r}")
        try:
            self.sandbox = SandboxOptions(timeout_seconds=options.get("timeout_seconds", default_timeout),
                                          memory_mb=options.get("memory_mb", 512),
                                          output_kb=options.get("output_kb", 64))
        except ValueError as e:
            raise ValueError(f"agent.tool_options.python: {e}") from None
        self.num_workers = num_workers

    @property
    def pool(self) -> Any:
        from logitless.rewards.code import sandbox_pool

        return sandbox_pool(self.sandbox, self.num_workers)

    def batch_timeout(self, n: int) -> float:
        """Wall time `n` programs may take together: rounds of `num_workers` programs, each round bounded by
        the sandbox's own timeout plus the time to start or replace a worker."""
        import os

        workers = self.num_workers or os.cpu_count() or 1
        rounds = -(-n // workers)
        return rounds * (self.sandbox.timeout_seconds + 5.0) + 30.0

    def batch(self, calls: list[dict[str, Any]]) -> list[ToolResult]:
        results = self.pool.execute([c["code"] for c in calls])
        return [program_result(r, self.sandbox) for r in results]


def program_result(r: Any, limits: Any) -> ToolResult:
    """What the model reads of one `ExecResult(status, stdout, error)` run under `limits` (SandboxOptions): the
    output, and for a program that did not end well its output so far then `Error: <why>`."""
    out = r.stdout or ""
    if r.status == "ok":
        return ToolResult(out if out else "(the program printed nothing; use print() to show a value)")
    why = {
        "error": (r.error or "the program failed").rstrip(),
        "timeout": f"the program ran longer than {limits.timeout_seconds:g} s and was stopped",
        "memory": f"the program used more than {limits.memory_mb} MB of memory and was stopped",
        "output_limit": f"the program printed more than {limits.output_kb} KB and was stopped",
        "crashed": "the sandbox running the program crashed",
    }.get(r.status, f"the program ended with status {r.status!r}")
    text = (out.rstrip("\n") + "\n" if out else "") + error_text(why)
    return ToolResult(text, error=True, timed_out=r.status == "timeout")


def python_tool(options: dict[str, Any], default_timeout: float) -> Tool:
    runner = PythonTool(options, default_timeout)
    return Tool("python", function_schema(python, "agent.tools"), batch=runner.batch,
                batch_timeout=runner.batch_timeout, timeout_s=runner.sandbox.timeout_seconds + 35.0)
