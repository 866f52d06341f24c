"""Tool-call parsers of each format, well-formed and malformed."""

from __future__ import annotations

from logitless.agents.parsing import parse_hermes, parse_llama3_json, parse_mistral, parse_raw


def _calls(parsed):
    return [(c.name, c.arguments, c.error is None) for c in parsed.calls]


# ---------------------------------------------------------------------------------------------- hermes


def test_hermes_several_calls_and_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"query": "é", "tags": ["a"]}}\n</tool_call>')
    p = parse_hermes(text)
    assert p.content == "Let me compute."
    assert _calls(p) == [("calculator", {"expression": "2+3"}, True),
                         ("search", {"query": "é", "tags": ["a"]}, True)]


def test_hermes_plain_answer_has_no_calls():
    p = parse_hermes("The answer is 5.")
    assert p.content == "The answer is 5." and p.calls == []


def test_hermes_lenient_on_string_arguments_and_missing_arguments():
    p = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                     '<tool_call>{"name": "now"}</tool_call>'
                     '<tool_call>{"name": "g", "parameters": {"y": 2}}</tool_call>')
    assert _calls(p) == [("f", {"x": 1}, True), ("now", {}, True), ("g", {"y": 2}, True)]


def test_hermes_malformed_calls_are_reported_not_dropped():
    p = parse_hermes('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>'  # missing brace
                     '<tool_call>["f"]</tool_call>'
                     '<tool_call>{"arguments": {}}</tool_call>'
                     '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'
                     'tail <tool_call>{"name": "g", "argu')
    errors = [c.error for c in p.calls]
    assert len(errors) == 5 and all(errors)
    assert "not valid JSON" in errors[0] and '<tool_call>\n{"name": <tool name>' in errors[0]
    assert "must be a JSON object, got list" in errors[1]
    assert 'has no "name"' in errors[2]
    assert p.calls[3].name == "f" and 'must be a JSON object {"argument": value}' in errors[3]
    assert "not closed with </tool_call>" in errors[4]
    assert p.content == "tail"


# ---------------------------------------------------------------------------------------------- llama 3


def test_llama3_bare_json_call():
    p = parse_llama3_json('{"name": "calculator", "parameters": {"expression": "7*6"}}')
    assert p.content == "" and _calls(p) == [("calculator", {"expression": "7*6"}, True)]
    p = parse_llama3_json('<|python_tag|>{"name": "f", "arguments": {"a": 1}}')
    assert _calls(p) == [("f", {"a": 1}, True)]


def test_llama3_several_objects_and_lists():
    p = parse_llama3_json('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 2}}')
    assert _calls(p) == [("f", {}, True), ("g", {"x": 2}, True)]
    p = parse_llama3_json('[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]')
    assert [c.name for c in p.calls] == ["f", "g"]


def test_llama3_text_is_an_answer_and_bad_json_is_an_error():
    p = parse_llama3_json("The answer is {42}.")
    assert p.content == "The answer is {42}." and p.calls == []
    p = parse_llama3_json('{"name": "f", "parameters": {"x": }}')
    assert len(p.calls) == 1 and "not valid JSON" in p.calls[0].error and '"parameters"' in p.calls[0].error
    p = parse_llama3_json("<|python_tag|>calculator.call(x=1)")
    assert p.calls[0].error and "after <|python_tag|>" in p.calls[0].error


# ---------------------------------------------------------------------------------------------- mistral


def test_mistral_list_form_with_ids():
    p = parse_mistral('Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "abc123XYZ"}, '
                      '{"name": "g", "arguments": {}}]')
    assert p.content == "Sure." and _calls(p) == [("f", {"x": 1}, True), ("g", {}, True)]
    assert p.calls[0].id == "abc123XYZ" and p.calls[1].id is None


def test_mistral_args_form():
    p = parse_mistral('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{"y": "z"}')
    assert _calls(p) == [("f", {"x": 1}, True), ("g", {"y": "z"}, True)] and p.calls[1].id == "a1b2c3d4e"


def test_mistral_plain_and_malformed():
    assert parse_mistral("No calls here.").calls == []
    p = parse_mistral('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}')
    assert len(p.calls) == 1 and "not valid JSON" in p.calls[0].error


# ---------------------------------------------------------------------------------------------- raw


def test_raw_call_keyword_and_positional_literals():
    p = parse_raw('I will compute. <call>calculator(expression="12*34")</call>')
    assert p.content == "I will compute." and _calls(p) == [("calculator", {"expression": "12*34"}, True)]
    p = parse_raw("<call>f(1, 'a', xs=[1, 2.5], d={'k': None}, b=True)</call> trailing")
    c = p.calls[0]
    assert c.name == "f" and c.positional == [1, "a"] and c.arguments == {"xs": [1, 2.5], "d": {"k": None}, "b": True}


def test_raw_only_the_first_call_counts():
    p = parse_raw("<call>f(1)</call><call>g(2)</call>")
    assert [c.name for c in p.calls] == ["f"]


def test_raw_malformed():
    cases = {
        "<call>f(1</call>": "cannot read the call",
        "<call>1 + 2</call>": "is not a call",
        "<call>os.system('ls')</call>": "is not a call",
        "<call>f(x=y)</call>": "must be literal values",
        "<call>f(x=__import__('os'))</call>": "must be literal values",
        "<call>f(**{'a': 1})</call>": "must be literal values",
        "<call>f(x=1)": "not closed with </call>",
    }
    for text, why in cases.items():
        p = parse_raw(text)
        assert len(p.calls) == 1 and p.calls[0].error and why in p.calls[0].error, (text, p.calls)
        assert "<call>tool_name(argument=value, ...)</call>" in p.calls[0].error
    assert parse_raw("Just text.").calls == []
