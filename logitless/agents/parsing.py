"""Tool calls in a model turn's text, for each supported format.

    hermes       Qwen2.5/Qwen3, Hermes:  text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ... (several)
    llama3_json  Llama 3.1/3.2:          {"name": "f", "parameters": {...}}   (the whole turn; `<|python_tag|>` allowed)
    mistral      Mistral v3+:            text[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "..."}]
                                         (also the newer  [TOOL_CALLS]f[ARGS]{...}  form)
    harmony      GPT-OSS:                <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>commentary
                                         to=functions.f <|constrain|>json<|message|>{...}   (the turn ends at <|call|>)
    raw          base models:            text <call>f(x=1, y="a")</call>   (one call; the turn stops at </call>)

The parsers get the turn's text with special tokens written out and the turn-ending token removed. A call that
cannot be read (bad JSON, no name, arguments that are not an object, an unclosed tag) is returned with an
`error` and answered by an error message, never dropped silently. transformers' `parse_response` needs a
per-model response schema, which transformers 5.17 does not ship; these small parsers cover the formats the
chat templates of the supported families write.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ToolCall:
    """One call the model wrote."""

    name: str | None  # None: the call is malformed and names no tool
    arguments: dict[str, Any] = field(default_factory=dict)  # keyword arguments (JSON values)
    positional: list[Any] = field(default_factory=list)  # raw protocol f(1, 2): mapped by the schema's order
    id: str | None = None  # the model's call id (Mistral), if it wrote one
    error: str | None = None  # why the call cannot be run as written (then name/arguments may be partial)


@dataclass
class ParsedTurn:
    content: str  # the turn's text outside its calls, stripped
    calls: list[ToolCall]


# how each format's calls are written, for error messages that teach the model the right form
CALL_FORMS = {
    "hermes": '<tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>, ...}}\n</tool_call>',
    "llama3_json": '{"name": <tool name>, "parameters": {<argument>: <value>, ...}}',
    "mistral": '[TOOL_CALLS][{"name": <tool name>, "arguments": {<argument>: <value>, ...}}]',
    "harmony": '<|channel|>commentary to=functions.<tool name> <|constrain|>json<|message|>{<argument>: <value>, ...}'
               '<|call|>',
    "raw": '<call>tool_name(argument=value, ...)</call>',
}


def _call_from_json(obj: Any, fmt: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """A call from a decoded JSON object {"name": ..., "arguments" | "parameters": {...}, "id"?}."""
    form = CALL_FORMS[fmt]
    if not isinstance(obj, dict):
        return ToolCall(None, error=f"a tool call must be a JSON object, got {type(obj).__name__}; write {form}")
    name = obj.get("name")
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    if not isinstance(name, str) or not name:
        return ToolCall(None, id=call_id, error=f'the tool call has no "name"; write {form}')
    key = next((k for k in keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, id=call_id, error=f'the "{key}" of the call to {name} must be a JSON object '
                                                f'{{"argument": value}}, got {json.dumps(args)[:60]}')
    return ToolCall(name, dict(args), id=call_id)


def _json_error(e: json.JSONDecodeError, fmt: str) -> str:
    return f"the tool call is not valid JSON ({e.msg} at character {e.pos}); write {CALL_FORMS[fmt]}"


_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks (any number); an unclosed last block is a malformed call."""
    calls, outside, pos = [], [], 0
    for m in _HERMES_RE.finditer(text):
        outside.append(text[pos:m.start()])
        pos = m.end()
        body = m.group(1).strip()
        try:
            calls.append(_call_from_json(json.loads(body), "hermes"))
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=_json_error(e, "hermes")))
    rest = text[pos:]
    if "<tool_call>" in rest:
        before, _, body = rest.partition("<tool_call>")
        outside.append(before)
        calls.append(ToolCall(None, error="the <tool_call> is not closed with </tool_call>; write "
                                          + CALL_FORMS["hermes"]))
    else:
        outside.append(rest)
    return ParsedTurn("".join(outside).strip(), calls)


def parse_llama3_json(text: str) -> ParsedTurn:
    """A turn that is a bare JSON call (optionally after `<|python_tag|>`): one object, a list of objects, or
    objects separated by ';' or newlines. A turn that starts with anything else is plain text."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith(("{", "[")):
        if tagged:
            return ParsedTurn("", [ToolCall(None, error="after <|python_tag|> write a JSON call: "
                                                          + CALL_FORMS["llama3_json"])])
        return ParsedTurn(body, [])
    decoder, objs, i = json.JSONDecoder(), [], 0
    try:
        while i < len(body):
            obj, i = decoder.raw_decode(body, i)
            objs.extend(obj if isinstance(obj, list) else [obj])
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
    except json.JSONDecodeError as e:
        return ParsedTurn("", [ToolCall(None, error=_json_error(e, "llama3_json"))])
    return ParsedTurn("", [_call_from_json(o, "llama3_json", ("parameters", "arguments")) for o in objs])


_MISTRAL_ARGS_RE = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]", re.DOTALL)


def parse_mistral(text: str) -> ParsedTurn:
    """`[TOOL_CALLS]` then a JSON list of calls, or one or more `[TOOL_CALLS]name[ARGS]{json}` (newer form)."""
    if "[TOOL_CALLS]" not in text:
        return ParsedTurn(text.strip(), [])
    content, _, rest = text.partition("[TOOL_CALLS]")
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    for part in rest.split("[TOOL_CALLS]"):
        part = part.strip()
        m = _MISTRAL_ARGS_RE.match(part)
        try:
            if m:
                obj, _ = decoder.raw_decode(part, m.end())
                calls.append(_call_from_json({"name": m.group(1), "arguments": obj, "id": m.group(2)}, "mistral"))
            else:
                obj, _ = decoder.raw_decode(part)
                for o in obj if isinstance(obj, list) else [obj]:
                    calls.append(_call_from_json(o, "mistral"))
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=_json_error(e, "mistral")))
    return ParsedTurn(content.strip(), calls)


_HARMONY_END = re.compile(r"<\|(?:end|call|return)\|>")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_HARMONY_TO = re.compile(r"\bto=([^\s<]+)")


def parse_harmony(text: str) -> ParsedTurn:
    """GPT-OSS harmony messages (`<|start|>` header `<|message|>` body `<|end|>`): a message with a recipient
    `to=functions.f` (in its header, before or after the channel) is a call whose body is the JSON arguments; the
    content is the `final` channel's text (else that of messages without a channel or recipient). Analysis is
    neither content nor a call."""
    calls: list[ToolCall] = []
    final: list[str] = []
    plain: list[str] = []
    for chunk in text.split("<|start|>"):
        head, sep, body = chunk.partition("<|message|>")
        if not sep:  # no header: text outside the harmony structure
            plain.append(_HARMONY_END.split(chunk)[0])
            continue
        body = _HARMONY_END.split(body)[0]
        to = _HARMONY_TO.search(head)
        channel = _HARMONY_CHANNEL.search(head)
        if to:
            name = to.group(1).removeprefix("functions.")
            try:
                args = json.loads(body) if body.strip() else {}
            except json.JSONDecodeError as e:
                calls.append(ToolCall(None, error=_json_error(e, "harmony")))
                continue
            calls.append(_call_from_json({"name": name, "arguments": args}, "harmony"))
        elif channel and channel.group(1) == "final":
            final.append(body)
        elif not channel:
            plain.append(body)
    return ParsedTurn("\n".join(final or plain).strip(), calls)


def parse_raw(text: str) -> ParsedTurn:
    """The first `<call>name(args)</call>`: a Python-style call whose arguments are literals (numbers, strings,
    lists, dicts, True/False/None), keyword or positional."""
    if "<call>" not in text:
        return ParsedTurn(text.strip(), [])
    content, _, rest = text.partition("<call>")
    if "</call>" not in rest:
        return ParsedTurn(content.strip(), [ToolCall(None, error="the <call> is not closed with </call>; write "
                                                                  + CALL_FORMS["raw"])])
    body = rest.partition("</call>")[0].strip()
    form = CALL_FORMS["raw"]
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as e:
        return ParsedTurn(content.strip(), [ToolCall(None, error=f"cannot read the call {body[:60]!r} ({e.msg}); "
                                                                  f"write {form}")])
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        return ParsedTurn(content.strip(), [ToolCall(None, error=f"{body[:60]!r} is not a call; write {form}")])
    name = tree.func.id
    try:
        positional = [ast.literal_eval(a) for a in tree.args]
        keywords = {}
        for kw in tree.keywords:
            if kw.arg is None:
                raise ValueError("**arguments")
            keywords[kw.arg] = ast.literal_eval(kw.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        return ParsedTurn(content.strip(), [ToolCall(name, error=f"the arguments of {name} must be literal values "
                                                                  f"(numbers, \"strings\", lists) ({e}); write {form}")])
    return ParsedTurn(content.strip(), [ToolCall(name, keywords, positional)])


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "harmony": parse_harmony,
    "raw": parse_raw,
}
