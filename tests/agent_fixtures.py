"""Tokenizers, chat templates, tools and environments of the agent tests, built here (no files needed).

`byte_tokenizer` is a byte-level BPE without merges (one token per byte) plus the given special tokens: every
text has one encoding, so it tests the bridge's logic; the real Qwen2.5 tokenizer (shared/) tests BPE seams.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]
MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

# Plain ChatML without tools, as the shared Qwen2.5 tokenizer's template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\n"
    "You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1 style: "Environment: ipython" system header, tools in the first user message, a call as bare JSON
# with "parameters" (one per turn), results in an `ipython` turn, <|eot_id|> ending every turn.
LLAMA_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
    {{- 'Environment: ipython\\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools is not none %}
    {%- set first_user = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '
        + 'that best answers the given prompt.\\n\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
        + 'Do not use variables.\\n\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
    {{- first_user + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
        {%- if message['tool_calls'] | length != 1 %}
            {{- raise_exception('This model only supports single tool-calls at once!') }}
        {%- endif %}
        {%- set call = message['tool_calls'][0]['function'] %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call['name'] + '", "parameters": ' + (call['arguments'] | tojson) + '}' }}
        {{- '<|eot_id|>' }}
    {%- elif message['role'] == 'tool' or message['role'] == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral v3 style: tools up front, calls as a JSON list after [TOOL_CALLS], results in [TOOL_RESULTS], </s>
# ending assistant turns, no generation prompt.
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- if tools %}
    {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
        {{- '[TOOL_CALLS]['}}
        {%- for call in message['tool_calls'] %}
            {{- '{"name": "' + call['function']['name'] + '", "arguments": ' + (call['function']['arguments'] | tojson) }}
            {{- ', "id": "' + call['id'] + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']</s>' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + '</s>' }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]{"content": ' + (message['content'] | tojson) + ', "call_id": "' + message['tool_call_id'] }}
        {{- '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

# Not append-only: the system turn counts the messages, so every new message changes it.
COUNTING_TEMPLATE = (
    "{{- '<|im_start|>system\\nMessages: ' + (messages | length | string) + '<|im_end|>\\n' }}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Not append-only once a user message follows: earlier reasoning is dropped (as Qwen3's template does).
DROPS_REASONING_TEMPLATE = (
    "{%- set last_user = namespace(i=0) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set last_user.i = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < last_user.i and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def byte_tokenizer(specials: list[str], template: str | None = None, bos: str | None = None,
                   eos: str | None = None) -> Any:
    """A byte-level tokenizer (one token per byte) with these special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if bos:
        tok.bos_token = bos
    if eos:
        tok.eos_token = eos
    tok.chat_template = template
    return tok


def llama_tokenizer() -> Any:
    return byte_tokenizer(LLAMA_SPECIALS, LLAMA_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>")


def mistral_tokenizer() -> Any:
    return byte_tokenizer(MISTRAL_SPECIALS, MISTRAL_TEMPLATE, bos="<s>", eos="</s>")


def chatml_tokenizer(template: str = CHATML_TEMPLATE) -> Any:
    return byte_tokenizer(CHATML_SPECIALS, template, eos="<|endoftext|>")


def ids(tok: Any, text: str) -> list[int]:
    """`text` as the model would sample it (special tokens written out become their ids)."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def make_agent(tok: Any = None, **kw: Any) -> Any:
    """An Agent with these AgentOptions (default tokenizer: byte-level ChatML)."""
    from logitless.agents import Agent, AgentOptions

    return Agent(tok or chatml_tokenizer(), AgentOptions(**kw))


def call_text(name: str | None, args: dict | None = None, raw: str | None = None) -> str:
    """A sampled Hermes turn calling `name` with `args` (or the call body `raw`), ending with <|im_end|>."""
    body = raw if raw is not None else '{"name": "%s", "arguments": %s}' % (name, json.dumps(args or {}))
    return f"<tool_call>\n{body}\n</tool_call><|im_end|>"


def run_turns(driver: Any, tok: Any, texts: list, room: int = 100_000, ended: str = "eos") -> list:
    """One respond() for all rows at once: texts[row] is the sampled text of that row's turn."""
    from logitless.rollout.episodes import TurnEnd

    turns = [TurnEnd(r, ids(tok, t), ended, room) for r, t in enumerate(texts) if t is not None]
    return driver.respond(turns)


def tool_text(driver: Any, row: int = 0, k: int = -1) -> str:
    """The content of a row's k-th tool message."""
    return [m for m in driver.episodes[row].record.messages if m["role"] == "tool"][k]["content"]


# ---------------------------------------------------------------------------------------------- tools and environments

HANG = threading.Event()  # never set while a test runs: a tool waiting on it hangs


class CountDown:
    """Say the numbers from `start` down to 1, one per turn; +1 per right number, 0.5 at the end."""

    def __init__(self, start: int = 3) -> None:
        self.start = start
        self.closed = False

    def reset(self, row: dict) -> str:
        self.next = self.start
        return f"Start at {self.start}."

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        if text.strip() != str(self.next):
            return "Wrong.", -1.0, True
        self.next -= 1
        return (None, 1.0, True) if self.next == 0 else (f"Now {self.next}.", 1.0, False)

    def reward(self) -> float:
        return 0.5


class Turns:
    """Answers every turn with the turns left, whatever the model wrote; done after `turns` steps (a random model's
    episodes run several turns). Step reward: the turn's length mod 3."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, row: dict) -> str:
        self.left = self.turns
        return f" ({self.left} turns)"

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        self.left -= 1
        return f" [{self.left} left]", float(len(text) % 3), self.left <= 0


class Vault:
    """A per-episode secret the model finds with a tool; `step` ends the episode, rewarding the right guess."""

    tools = ["peek"]

    def __init__(self, secret: int = 7) -> None:
        self.secret, self.peeks = secret, 0

    def reset(self, row: dict) -> None:
        self.secret = int(row.get("secret", self.secret))
        return None

    def peek(self, digit: int) -> str:
        """Whether the secret is above a number.

        Args:
            digit: The number to compare with.
        """
        self.peeks += 1
        return "above" if self.secret > digit else "not above"

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        return None, float(text.strip() == str(self.secret)), True


def slow(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    HANG.wait(seconds)
    return "done"


def huge(n: int) -> str:
    """A long text.

    Args:
        n: Its length.
    """
    return "x" * n


def boom(x: int) -> int:
    """Fail.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no {x}")


class NoStep:
    def reset(self, row):
        return None


class BadTools(Vault):
    tools = ["peak"]


class UndocumentedTool(Vault):
    def peek(self, digit):  # no hints, no docstring
        return "?"


class Random:
    def __init__(self) -> None:
        import random

        self.first = str(random.random())

    def reset(self, row):
        return self.first

    def step(self, text):
        return None, None, True


class RaisingReset(CountDown):
    def reset(self, row):
        raise KeyError("id")


class BadStep(CountDown):
    def step(self, text):
        return "only an observation"


class RaisingStep(CountDown):
    def step(self, text):
        raise KeyError("broken")


class HangingStep(CountDown):
    def step(self, text):
        HANG.wait(60)
        return None, None, True


class SpinningStep(CountDown):
    """A step() in a busy loop (until HANG): Python cannot stop its thread."""

    def step(self, text):
        while not HANG.is_set():
            pass
        return None, None, True


class HangingReset(CountDown):
    def reset(self, row):
        HANG.wait(60)
        return "late"


class SignalledReset(CountDown):
    """Sends this process SIGTERM from reset(), then hangs in it: a stop while the rollout waits on reset."""

    def reset(self, row):
        os.kill(os.getpid(), signal.SIGTERM)
        HANG.wait(60)
        return "late"


class Quiet(CountDown):
    def step(self, text):
        return None, None, True

    def reward(self):
        return None

    def close(self):
        self.closed = True


class FailingClose(CountDown):
    """Ends at once with reward 1.0, and its close() raises."""

    def step(self, text):
        return None, None, True

    def reward(self):
        return 1.0

    def close(self):
        raise OSError("cannot release the board")
