"""Agent tools: schemas, argument checks, the exact calculator, results as text, concurrency and timeouts."""

from __future__ import annotations

import threading
import time
from fractions import Fraction
from typing import Literal, Optional

import pytest

from logitless.agents.calculator import Calculator, CalculatorError, format_number
from logitless.agents.runner import run_tasks
from logitless.agents.tools import (Tool, ToolInputError, check_arguments, cut_middle, function_schema,
                                    function_tool, run_call, to_text)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def search(query: str, tags: list[str], mode: Literal["fast", "exact"] = "fast", limit: Optional[int] = None,
           weights: dict[str, float] | None = None) -> dict:
    """Search the notes.

    Args:
        query: Words to look for.
        tags: Tags that must all be present.
        mode: How to match.
        limit: Most results (None: all).
        weights: Weight of each tag.
    """
    return {"query": query, "tags": tags, "mode": mode, "limit": limit, "weights": weights}


# ---------------------------------------------------------------------------------------------- schemas


def test_schema_from_signature_and_docstring():
    schema = function_schema(search, "agent.tools")
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "Words to look for."}
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert props["mode"]["enum"] == ["fast", "exact"]
    assert props["limit"]["nullable"] is True
    assert fn["parameters"]["required"] == ["query", "tags"]


def test_schema_refuses_undescribable_functions_naming_them_and_the_fix():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x) -> int:
        """Doc.

        Args:
            x: A value.
        """
        return x

    def undocumented_arg(x: int, y: int) -> int:
        """Doc.

        Args:
            x: A value.
        """
        return x

    with pytest.raises(ValueError, match=r"agent.tools.*'no_doc'.*Google-style docstring"):
        function_schema(no_doc, "agent.tools")
    with pytest.raises(ValueError, match=r"'no_hint'.*type hint"):
        function_schema(no_hint, "agent.tools")
    with pytest.raises(ValueError, match=r"'undocumented_arg'.*'y'.*Args:"):
        function_schema(undocumented_arg, "agent.tools")


def test_tool_options_bind_parameters_and_hide_them_from_the_model():
    tool = function_tool(add, {"b": 10}, 1.0)
    assert "b" not in tool.parameters["properties"] and tool.parameters["required"] == ["a"]
    assert run_call(tool, {"a": 5}, None).text == "15"
    with pytest.raises(ValueError, match=r"agent.tool_options.add: 'c' is not a parameter of add\(\)"):
        function_tool(add, {"c": 1}, 1.0)


def lookup(key: str, table: dict) -> str:
    """Look up a key.

    Args:
        key: the key to look up
    """
    return str(table.get(key))


def test_a_bound_parameter_needs_no_docstring_line():
    """agent.tool_options binds `table`, so the model never sees it and the docstring need not describe it."""
    with pytest.raises(ValueError, match=r"'lookup'.*Args:"):
        function_schema(lookup, "agent.tools")  # unbound, `table` is a parameter the model would have to fill
    tool = function_tool(lookup, {"table": {"x": 1}}, 1.0)
    assert tool.parameters["properties"].keys() == {"key"} and tool.parameters["required"] == ["key"]
    assert run_call(tool, {"key": "x"}, None).text == "1"
    hidden = function_tool(lookup, {"table": {"x": 1}, "key": "x"}, 1.0)  # every parameter bound
    assert hidden.parameters["properties"] == {} and "required" not in hidden.parameters


def test_function_tool_from_a_module_path_and_bad_paths():
    tool = function_tool("tests.test_agents_tools:add", {}, 1.0)
    assert tool.name == "add"
    with pytest.raises(ValueError, match=r"has no attribute 'ad'; did you mean 'tests.test_agents_tools:add'"):
        function_tool("tests.test_agents_tools:ad", {}, 1.0)
    with pytest.raises(ValueError, match=r"no module 'no_such_module_xyz' in the current folder"):
        function_tool("no_such_module_xyz:f", {}, 1.0)
    with pytest.raises(ValueError, match="neither a built-in tool"):
        function_tool("calculater", {}, 1.0)


# ---------------------------------------------------------------------------------------------- arguments


def test_arguments_are_checked_against_the_schema():
    tool = function_tool(search, {}, 1.0)
    ok, err = check_arguments(tool, {"query": "x", "tags": ["a"], "limit": 3.0, "weights": {"a": 1}})
    assert err is None and ok["limit"] == 3 and isinstance(ok["limit"], int)  # JSON 3.0 is an integer
    cases = [
        ({"tags": []}, "missing the required argument 'query'"),
        ({"query": "x", "tags": [], "qury": 1}, "unexpected argument 'qury'"),
        ({"query": 5, "tags": []}, "search\\(\\): argument 'query' must be string, got 5"),
        ({"query": "x", "tags": "a"}, "argument 'tags' must be array"),
        ({"query": "x", "tags": [1]}, "argument 'tags\\[0\\]' must be string"),
        ({"query": "x", "tags": [], "mode": "slow"}, "must be one of \\['fast', 'exact'\\]"),
        ({"query": "x", "tags": [], "limit": 2.5}, "must be integer"),
        ({"query": "x", "tags": [], "limit": True}, "must be integer"),
        ({"query": "x", "tags": [], "weights": {"a": "heavy"}}, "argument 'weights\\['a'\\]' must be number"),
    ]
    for args, pattern in cases:
        _, err = check_arguments(tool, args)
        assert err is not None, args
        assert __import__("re").search(pattern, err), (args, err)
    _, err = check_arguments(tool, {"query": "x", "tags": [], "limit": None})
    assert err is None  # Optional -> nullable


def test_positional_arguments_map_in_schema_order():
    tool = function_tool(add, {}, 1.0)
    args, err = check_arguments(tool, {}, [2, 3])
    assert err is None and args == {"a": 2, "b": 3}
    _, err = check_arguments(tool, {"a": 1}, [2])
    assert "two values for the argument 'a'" in err
    _, err = check_arguments(tool, {}, [1, 2, 3])
    assert "takes 2 argument(s), got 3" in err


# ---------------------------------------------------------------------------------------------- results


def test_results_become_text():
    assert to_text("x") == "x" and to_text(3) == "3" and to_text(None) == ""
    assert to_text({"a": [1, "é"]}) == '{"a": [1, "é"]}'
    assert to_text(Fraction(1, 2)) == "1/2"


def test_cut_middle_keeps_both_ends_and_marks_the_cut():
    text = "A" * 500 + "B" * 500
    out, cut = cut_middle(text, 100)
    assert cut and out.startswith("A" * 50) and out.endswith("B" * 50)
    assert "[... 900 characters cut ...]" in out
    assert cut_middle("short", 100) == ("short", False)


def test_a_raising_tool_is_an_error_result_not_an_exception():
    def boom(x: int) -> int:
        """Explode.

        Args:
            x: Anything.
        """
        raise KeyError("nope")

    def refuse(x: int) -> int:
        """Refuse.

        Args:
            x: Anything.
        """
        raise ToolInputError("x must be positive")

    r = run_call(function_tool(boom, {}, 1.0), {"x": 1}, None)
    assert r.error and r.text == "Error: boom raised KeyError: 'nope'"
    r = run_call(function_tool(refuse, {}, 1.0), {"x": 1}, None)
    assert r.error and r.text == "Error: x must be positive"


def test_async_tools_run():
    async def double(x: int) -> int:
        """Double.

        Args:
            x: A number.
        """
        return 2 * x

    assert run_call(function_tool(double, {}, 1.0), {"x": 21}, None).text == "42"


# ---------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expr,want", [
    ("123456789 * 987654321", "121932631112635269"),
    ("2 ** 200", str(2**200)),
    ("0.1 + 0.2", "0.3"),
    ("10 / 4", "2.5"),
    ("1 / 3", "0.33333333333333333333"),
    ("-7 // 2", "-4"),
    ("-7 % 3", "2"),
    ("-3 ** 2", "-9"),
    ("(-3) ** 2", "9"),
    ("2 ** -3", "0.125"),
    ("1e-3 * 3", "0.003"),
    ("1.10 * 3", "3.3"),
    ("12 × 34 − 8 ÷ 2", "404"),
    ("1_000 + 1", "1001"),
    ("sqrt(144) + sqrt(2.25)", "13.5"),
    ("sqrt(2)", "1.4142135623730950488"),
    ("sqrt(2) ** 2", "2"),
    ("4 ** 1.5", "8"),
    ("abs(-2) + min(3, 1, 2) + max(1, 5) + round(2.675, 2) + floor(-1.5) + ceil(1.2)", "10.68"),
    ("99999999999999999999 + 1", "100000000000000000000"),
])
def test_calculator_is_exact(expr, want):
    assert Calculator()(expr) == want


@pytest.mark.parametrize("expr,why", [
    ("2 ^ 10", "write 2 \\*\\* 10"),
    ("1,234 * 5", "thousands separators"),
    ("x + 1", "unknown name 'x'"),
    ("__import__('os').system('ls')", "unknown function|not allowed"),
    ("(1).real", "not allowed"),
    ("'a' * 3", "not a number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("9 ** 9 ** 9", "more than 1000 digits"),
    ("(2/3) ** 1000000000", "more than 1000 digits"),
    ("10 ** 1e5", "more than 1000 digits"),
    ("sqrt(-1)", "negative"),
    ("(-8) ** (1/3)", "negative"),
    ("1 < 2", "Compare is not allowed"),
    ("[1, 2]", "not allowed"),
    ("abs(1, 2)", "takes 1 argument"),
    ("round(1.5, 0.5)", "whole number of digits"),
    ("1e400", "too large"),
    ("", "empty expression"),
    ("1 +", "cannot parse"),
    ("1+" * 600 + "1", "more than 1000"),
])
def test_calculator_refuses_with_a_reason(expr, why):
    with pytest.raises(CalculatorError, match=why):
        Calculator()(expr)


def test_calculator_refusals_reach_the_model_as_errors_and_its_options_are_checked():
    from logitless.agents.tools import calculator_tool

    tool = calculator_tool({}, 1.0)
    r = run_call(tool, {"expression": "1/0"}, None)
    assert r.error and r.text == "Error: division by zero"
    assert run_call(calculator_tool({"max_digits": 5}, 1.0), {"expression": "10**6"}, None).text.startswith("Error:")
    with pytest.raises(ValueError, match="max_digits"):
        calculator_tool({"max_digits": 0}, 1.0)


def test_format_number():
    assert format_number(Fraction(-5, 4)) == "-1.25" and format_number(Fraction(1, 8)) == "0.125"
    assert format_number(Fraction(2, 3)) == "0.66666666666666666667"
    assert format_number(Fraction(1, 3 * 10**9)) == "3.3333333333333333333e-10"


# ---------------------------------------------------------------------------------------------- runner


def test_tasks_run_concurrently_up_to_max_parallel():
    barrier = threading.Barrier(3, timeout=5)  # only passes when 3 tasks run at the same time
    out = run_tasks([lambda: barrier.wait() >= 0] * 3, [5.0] * 3, max_parallel=3)
    assert [o.value for o in out] == [True] * 3 and not any(o.timed_out for o in out)

    live, peak, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def task() -> int:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        release.wait(0.05)
        with lock:
            live[0] -= 1
        return 1

    out = run_tasks([task] * 7, [5.0] * 7, max_parallel=2)
    assert sum(o.value for o in out) == 7 and peak[0] == 2


def test_a_pool_runs_its_queued_tasks_without_being_polled_and_hands_back_each_as_it_ends():
    """TaskPool: one slot, three tasks; a task that ends starts the next one itself (the last sets `done` with no
    poll between), and poll hands back the outcomes with their tags, a hung one abandoned at its deadline."""
    from logitless.agents.runner import TaskPool

    pool, order, done, never = TaskPool(1), [], threading.Event(), threading.Event()
    pool.submit(lambda: order.append("a") or "a", 5.0, "a", tag=1)
    pool.submit(lambda: order.append("b") or "b", 5.0, "b", tag=2)
    pool.submit(lambda: order.append("c") or done.set() or "c", 5.0, "c", tag=3)
    assert done.wait(5) and order == ["a", "b", "c"] and pool.pending == 3
    got = pool.poll()
    while pool.pending:  # (c's outcome is queued just after it set `done`)
        got += pool.poll(wait=True)
    assert [(tag, out.value) for tag, out in got] == [(1, "a"), (2, "b"), (3, "c")] and pool.pending == 0
    assert pool.poll(wait=True) == []  # nothing in flight: returns at once
    pool.submit(lambda: never.wait(5), 0.2, "hung", tag="h")
    pool.submit(lambda: "after", 5.0, "after", tag="x")  # waits for the slot the hung task frees when abandoned
    outs = []
    while pool.pending:
        outs += pool.poll(wait=True)
    assert [(tag, out.timed_out, out.value) for tag, out in outs] == [("h", True, None), ("x", False, "after")]
    never.set()


def test_a_hung_task_is_abandoned_at_its_timeout_and_frees_its_slot():
    never = threading.Event()
    t0 = time.monotonic()
    out = run_tasks([lambda: never.wait(), lambda: "fast", lambda: 1 / 0], [0.2, 5.0, 5.0], max_parallel=1)
    elapsed = time.monotonic() - t0
    assert out[0].timed_out and 0.2 <= out[0].seconds < 2.0
    assert out[1].value == "fast" and isinstance(out[2].error, ZeroDivisionError)
    assert elapsed < 3.0  # the hung one did not keep its slot
    never.set()


def test_a_task_still_running_at_twice_its_timeout_fails_the_run_naming_it():
    """Python cannot stop a thread: an abandoned task gets its timeout once more to end, then the run fails naming
    it and where it runs, rather than let busy threads pile up from step to step (the rollout slowed 9 -> 28 -> 82 s)."""
    from logitless.agents.runner import TaskStuck, _abandoned

    release = threading.Event()

    def spin() -> None:
        while not release.is_set():
            pass

    t0 = time.monotonic()
    try:
        out = run_tasks([spin], [0.2], 1, ["the tool 'spin'"])  # abandoned, as before
        assert out[0].timed_out
        with pytest.raises(TaskStuck) as e:  # a later call's wait finds it still running at 0.4 s
            run_tasks([lambda: release.wait(5)], [5.0], 1, ["the tool 'wait'"])
        elapsed = time.monotonic() - t0
    finally:
        release.set()
    msg = str(e.value)
    assert msg.startswith("the tool 'spin' did not return within 0.2 s (agent.tool_timeout_s) and was still running "
                          "0.2 s after it was abandoned") and "raise agent.tool_timeout_s" in msg
    assert "in spin\n" in msg  # its stack
    assert 0.4 <= elapsed < 3.0
    for a in list(_abandoned):
        a.thread.join(timeout=5)
    assert run_tasks([lambda: 1], [1.0], 1)[0].value == 1  # the ended thread is forgotten


def test_an_abandoned_task_that_ends_within_its_grace_is_forgotten():
    from logitless.agents.runner import _abandoned

    release = threading.Event()
    out = run_tasks([lambda: release.wait(5)], [0.2], 1, ["the tool 'late'"])
    assert out[0].timed_out and len(_abandoned) == 1
    release.set()
    _abandoned[0].thread.join(timeout=5)
    assert run_tasks([lambda: 2], [1.0], 1)[0].value == 2 and not _abandoned


def test_a_task_that_exits_does_not_end_the_process():
    import sys

    out = run_tasks([lambda: sys.exit(3)], [1.0], 1)
    assert isinstance(out[0].error, SystemExit)


def test_tool_dataclass_defaults():
    t = Tool("t", {"type": "function", "function": {"name": "t", "description": ""}})
    assert t.parameters == {"type": "object", "properties": {}}
