"""The chat-template bridge: prompts and observations as token ids, exactly as the chat template writes them.

Token in, token out. The model's sampled ids are never decoded and re-encoded into the sequence; what the
driver appends after a model turn is the *suffix* the chat template adds after that turn: the tool (or user)
messages and the next generation prompt. It is computed as TRL's `_get_tool_suffix_ids` and verl's continuous
tokens do: render a short conversation ending with an assistant turn, render it again with the new messages and
the generation prompt, and keep what the second adds after the assistant turn's end-of-turn token. The
separator the template writes after that token (ChatML's "\\n" after `<|im_end|>`) belongs to the suffix, since
the model's turn ends at the token itself.

An *append-only* template (adding messages never changes how earlier ones render) then gives exactly the
template's rendering of the whole conversation. Some templates re-render earlier turns once later messages come
(Qwen3 drops the reasoning of turns before the last user message and the empty think block of a turn that is no
longer the last; GPT-OSS drops earlier analysis and writes `<|end|>` for an earlier `<|return|>`; Hermes 3 adds a
newline inside an earlier tool turn). With agent.history=as_sampled (the default) the trained sequence is the one
the model was given and sampled turn by turn: each turn as sampled, each observation as the template renders it
right after the model's latest turn (what a chat server would show the model at that turn); agent.history=
append_only refuses such templates. `ChatBridge.check` renders a probe conversation turn by turn and checks, in
text and in tokens, that the observation ids do not depend on the earlier conversation (and, for append_only,
that nothing earlier changes); `ChatBridge.rewrites` says what a re-render would change.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

TEMPLATE_DIR = Path(__file__).with_name("chat_templates")
SHIPPED = {"qwen2.5": "qwen2.5.jinja"}
# The system message the shipped template writes for a prompt without one, when the model's own template writes
# none: neutral, since the shipped template also serves ChatML models that are not Qwen (SmolLM2, ...).
NEUTRAL_SYSTEM = "You are a helpful assistant."
CHAT_FORMATS = ("hermes", "llama3_json", "mistral", "harmony")
HISTORY_MODES = ("as_sampled", "append_only")
_SENTINEL = "SENTINEL_ANSWER_7f3a"


def load_template(spec: str) -> str:
    """A chat template from a shipped name ("qwen2.5") or a path to a jinja file."""
    if spec in SHIPPED:
        return (TEMPLATE_DIR / SHIPPED[spec]).read_text(encoding="utf-8")
    path = Path(spec)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(f"agent.chat_template={spec!r} is neither a shipped template ({sorted(SHIPPED)}) nor an "
                     "existing jinja file; give the path of a .jinja file or a shipped name")


def detect_format(template: str | None, tokenizer: Any) -> str | None:
    """The tool-call format a chat template (else the tokenizer's vocabulary) points to, or None."""
    text = template or ""
    if "<|channel|>" in text and "<|start|>assistant" in text:
        return "harmony"  # GPT-OSS
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if "<|start_header_id|>" in text or "<|eot_id|>" in text:
        return "llama3_json"
    if "<|im_start|>" in text:
        return "hermes"  # ChatML: the Qwen2.5 tool template if this one cannot render tools
    if not text:
        return None
    vocab = tokenizer.get_vocab()
    if "<|channel|>" in vocab and "<|call|>" in vocab:
        return "harmony"
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return "hermes"
    if "<|eot_id|>" in vocab:
        return "llama3_json"
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    return None


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens (added tokens marked special, and bos/eos/pad/...)."""
    ids = {int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids | {int(i) for i in tokenizer.all_special_ids}


def chatml_default_system(tokenizer: Any, template: str | None) -> str | None:
    """The system message a ChatML chat template writes for a conversation that has none (Qwen2.5's "You are Qwen,
    created by Alibaba Cloud. ...", SmolLM2's "... named SmolLM, trained by Hugging Face"); None when it writes
    none, is not ChatML or cannot render a user message."""
    if not template:
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], chat_template=template,
                                             tokenize=False)
    except Exception:  # noqa: BLE001 (a template that cannot render this has no default to read)
        return None
    head, user = "<|im_start|>system\n", text.find(_SENTINEL)
    at = text.find(head)
    end = text.find("<|im_end|>", at + 1) if at >= 0 else -1
    return text[at + len(head):end] if 0 <= at < end < user else None


def chat_side(tokenizer: Any, options: Any, toolset: Any, user_turns: bool,
              template_kwargs: dict[str, Any] | None = None, own_template: str | None = None
              ) -> tuple[str | None, ChatBridge | None]:
    """The chat format and bridge of an agent (`options`: its AgentOptions) for chat prompts, checked with a probe
    conversation (`user_turns`: an environment answers with user messages); (None, None): raw-text prompts only.
    `template_kwargs`: the template's own variables (data.chat_template_kwargs, e.g. enable_thinking).
    The shipped template, substituted or named, gets the model's own default system message as its default (or
    NEUTRAL_SYSTEM), never Qwen's on a model that is not Qwen. `own_template`: the model's own template where the
    tokenizer's is not it (a vision-language model's processor's, which renders image blocks)."""
    opts, tok = options, tokenizer
    if opts.format == "raw":
        return None, None
    own = own_template or getattr(tok, "chat_template", None)
    if isinstance(own, dict):  # named templates: the tool-use one when there are tools
        own = (toolset and own.get("tool_use")) or own.get("default")
    own = own if isinstance(own, str) and own else None
    template = load_template(opts.chat_template) if opts.chat_template else own
    shipped = opts.chat_template in SHIPPED
    if template is None:
        if opts.format == "auto":
            return None, None
        raise ValueError(f"agent.format={opts.format} needs a chat template, but the tokenizer has none: set "
                         "agent.chat_template (a jinja file or 'qwen2.5'), or agent.format=raw for raw prompts")
    tools = bool(toolset)
    fmt = opts.format if opts.format != "auto" else detect_format(template, tok)
    if fmt is None:
        if tools:
            where = "agent.chat_template" if opts.chat_template else "the tokenizer's chat template"
            if (missing := renders_tools(tok, template, template_kwargs)) is not None:  # Gemma 3: both to set
                raise ValueError(f"agent.format=auto cannot tell the tool-call format from {where}, and it cannot "
                                 f"render tools ({missing}); set, in order: agent.chat_template to a tool-capable "
                                 "jinja file, then (where auto cannot tell it from that template) agent.format to "
                                 f"the tool-call format it writes, one of {list(CHAT_FORMATS)}; or agent.format=raw "
                                 "for raw-text prompts")
            raise ValueError(f"agent.format=auto cannot tell the tool-call format from {where}; set agent.format "
                             f"to one of {list(CHAT_FORMATS)} (or raw)")
        fmt = "hermes"  # no tools: the format only names the parser, which never runs
    if tools and (missing := renders_tools(tok, template, template_kwargs)) is not None:
        vocab = tok.get_vocab()
        if fmt == "hermes" and opts.chat_template is None and "<|im_start|>" in vocab and "<|im_end|>" in vocab:
            template, shipped = load_template("qwen2.5"), True
        else:
            where = "agent.chat_template" if opts.chat_template else "the tokenizer's chat template"
            raise ValueError(f"{where} cannot render tools ({missing}); set agent.chat_template to a "
                             "tool-capable jinja file (for ChatML/Qwen models: qwen2.5), or agent.format=raw "
                             "for raw-text prompts")
    kwargs = dict(template_kwargs or {})
    if shipped:
        kwargs.setdefault("default_system_prompt", chatml_default_system(tok, own) or NEUTRAL_SYSTEM)
    try:
        bridge = ChatBridge(tok, template, toolset.schemas, fmt, kwargs, opts.history)
        bridge.check(tools=tools, user_turns=user_turns)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (jinja errors of a template that cannot render the probe)
        raise ValueError(f"agent.chat_template: rendering a probe conversation failed ({type(e).__name__}: "
                         f"{e}); give a template that renders user, assistant (with tool_calls) and tool "
                         "messages") from e
    if bridge.system_rewrite:
        warnings.warn(f"agent.chat_template re-renders a system message once later messages are added "
                      f"({bridge.system_rewrite}); a prompt's system message (agent.system_prompt or the data's) is "
                      "trained where the model was given it, in its first turn's prompt, whereas a chat server "
                      "re-rendering the conversation would no longer show it there (docs/agents.md, \"Templates that "
                      "re-render history\")", stacklevel=2)
    if bridge.rewrites:
        warnings.warn(f"agent.chat_template re-renders earlier turns once later messages are added ({bridge.rewrites}"
                      "); each turn is trained as the model was given it and sampled it (agent.history=as_sampled; "
                      "docs/agents.md, \"Templates that re-render history\"); agent.history=append_only refuses "
                      "such a template", stacklevel=2)
    return fmt, bridge


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """`messages` with `system` (agent.system_prompt) as a first system message, unless it has one or `system` is
    None."""
    if system is None or (messages and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


class ChatBridge:
    """Renders prompts and observations of one chat template with one set of tool schemas, as token ids.
    `template_kwargs`: the template's own variables (the shipped template's `default_system_prompt`,
    data.chat_template_kwargs). `history`: agent.history (as_sampled | append_only)."""

    def __init__(self, tokenizer: Any, template: str, tools: list[dict[str, Any]] | None, fmt: str,
                 template_kwargs: dict[str, Any] | None = None, history: str = "as_sampled") -> None:
        self.tokenizer = tokenizer
        self.history = history
        self.rewrites: str | None = None  # set by `check`: what re-rendering the conversation changes, if anything
        self.system_rewrite: str | None = None  # set by `check`: what a re-render does to a system message, if any
        self.template = template
        self.tools = tools or None  # None, not []: some templates print tool instructions for an empty list
        self.format = fmt
        self.template_kwargs = dict(template_kwargs or {})
        self.turn_end_texts: list[str] = []
        self.turn_end_ids: list[int] = []
        self._find_turn_ends()

    # -- rendering -------------------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except TypeError:  # a template that iterates its tools whatever they are (Hermes 3's tool_use): an empty list
            if self.tools is not None:
                raise
            self.tools = []
            return self.render(messages, add_generation_prompt)

    def with_tools(self, tools: list[dict[str, Any]]) -> ChatBridge:
        """A bridge of the same template, format and variables showing only these tool schemas (a row's tool set,
        agent.tools_field); not yet `check`ed."""
        bridge = ChatBridge(self.tokenizer, self.template, tools, self.format, self.template_kwargs, self.history)
        bridge.rewrites, bridge.system_rewrite = self.rewrites, self.system_rewrite
        return bridge

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def renders_several_calls(self) -> bool:
        """Whether the template renders an assistant turn with two tool calls (Llama 3.1's raises "This model only
        supports single tool-calls at once!")."""
        calls = [tool_call_message("f", {}, f"call0000{i}") for i in (1, 2)]
        try:
            self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls}],
                        add_generation_prompt=False)
        except Exception:  # noqa: BLE001 (jinja's TemplateError, or whatever the template's own check raises)
            return False
        return True

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt with the tool schemas and the generation prompt (what the engine is given)."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def suffix_ids(self, assistant: dict[str, Any], new: list[dict[str, Any]]) -> list[int]:
        """The ids the template adds after the end-of-turn token of `assistant` for the messages `new`, with the
        next generation prompt."""
        return self.encode(self.suffix_text(assistant, new))

    def suffix_text(self, assistant: dict[str, Any], new: list[dict[str, Any]]) -> str:
        """The text the template adds after the end-of-turn token of `assistant` for the messages `new`, with the
        next generation prompt (`suffix_ids` before tokenizing)."""
        base = [{"role": "user", "content": "Hi"}, assistant]
        before = self.render(base, add_generation_prompt=False)
        after = self.render(base + new, add_generation_prompt=True)
        if after.startswith(before):
            return after[self._cut(before):]
        if self.history == "append_only":
            raise ValueError(self._not_append_only(f"adding {[m['role'] for m in new]} messages after an "
                                                   "assistant turn changed how the earlier turns render"))
        return after[self._turn_end_in(before, after):]

    def tool_suffix(self, calls: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[int]:
        """Observation ids of one turn's tool messages (`results`, answering the `calls` in transformers'
        `tool_calls` format)."""
        return self.suffix_ids({"role": "assistant", "content": "", "tool_calls": calls}, results)

    def user_suffix(self, content: str) -> list[int]:
        """Observation ids of a user message (an environment's observation) after a plain assistant turn."""
        return self.encode(self.user_suffix_text(content))

    def user_suffix_text(self, content: str | list[dict[str, Any]]) -> str:
        """`user_suffix` before tokenizing; `content` may be content blocks (text and images)."""
        return self.suffix_text({"role": "assistant", "content": "All done, nothing more to add."},
                                [{"role": "user", "content": content}])

    # -- checks ----------------------------------------------------------------------------------------------

    def _cut(self, rendered: str) -> int:
        """Where the last assistant turn of `rendered` ends: right after its last end-of-turn token."""
        ends = [rendered.rfind(t) + len(t) for t in self.turn_end_texts if t in rendered]
        if not ends:
            raise ValueError(self._not_append_only("an assistant turn renders without its end-of-turn token"))
        return max(ends)

    def _turn_end_in(self, before: str, after: str) -> int:
        """Where, in `after` (a conversation whose earlier turns the template re-renders), the assistant turn that
        ends `before` ends: after the special token that follows that turn's last characters (its end-of-turn
        token, or what the template writes for it in history, e.g. GPT-OSS's <|end|> for <|return|>)."""
        cut = self._cut(before)
        end = cut - max(len(t) for t in self.turn_end_texts if before[:cut].endswith(t))
        payload = before[max(0, end - 12):end]
        common = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        specials = self._special_texts()
        at = after.find(payload, min(common, end - len(payload))) if payload else -1
        while at >= 0:  # the first occurrence of the turn's last characters that a special token follows
            rest = after[at + len(payload):]
            token = max((t for t in specials if rest.startswith(t)), key=len, default=None)
            if token is not None:
                return at + len(payload) + len(token)
            at = after.find(payload, at + 1)
        raise ValueError(self._not_append_only("adding messages after an assistant turn re-renders that turn so "
                                               "that its end cannot be found"))

    def _special_texts(self) -> list[str]:
        return [t for t in self.tokenizer.convert_ids_to_tokens(sorted(special_ids(self.tokenizer))) if t]

    def _find_turn_ends(self) -> None:
        """The special token(s) that end an assistant turn: the last special token the template writes after a
        plain answer, and after a tool call."""
        convs = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]]
        if self.tools:
            call = tool_call_message(_SENTINEL, {"x": 1}, "a1b2c3d4e")
            convs.append([{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "", "tool_calls": [call]}])
        special = special_ids(self.tokenizer)
        for conv in convs:
            what = "tool call" if conv[-1].get("tool_calls") else "answer"
            text = self.render(conv, add_generation_prompt=False)
            at = text.rfind(_SENTINEL)
            if at < 0:
                raise ValueError(f"agent.chat_template: the template drops the assistant's {what}; give a template "
                                 "that renders assistant messages and their tool_calls")
            tail = text[at + len(_SENTINEL):]
            end = next((i for i in reversed(self.encode(tail)) if i in special), None)
            if end is None:
                raise ValueError(
                    f"agent.chat_template: an assistant {what} ends with {tail[:60]!r}, which holds no special "
                    "token, so a turn's end cannot be told from its tokens; use a chat template whose assistant "
                    "turns end with an end-of-turn token (e.g. <|im_end|>, <|eot_id|>)")
            if end not in self.turn_end_ids:
                self.turn_end_ids.append(int(end))
                self.turn_end_texts.append(self.tokenizer.convert_ids_to_tokens(int(end)))
        if self.format == "llama3_json":  # Llama 3.1 ends a tool-call turn with <|eom_id|> after <|python_tag|>
            eom = self.tokenizer.convert_tokens_to_ids("<|eom_id|>")
            if isinstance(eom, int) and eom != self.tokenizer.unk_token_id and eom not in self.turn_end_ids:
                self.turn_end_ids.append(eom)
                self.turn_end_texts.append("<|eom_id|>")

    def _not_append_only(self, what: str) -> str:
        return (f"agent.chat_template: the chat template is not append-only ({what}), so the tokens appended "
                "after a model turn would differ from what the template renders for the whole conversation; give "
                "an append-only template (agent.chat_template=<file.jinja>; for ChatML models the shipped "
                "'qwen2.5'), or set agent.history=as_sampled to train each turn as the model was given it")

    def _rewritten(self, given: str, rendered: str) -> None:
        """The template re-renders the conversation the model was given (`given`) as `rendered`: refused with
        agent.history=append_only, else remembered in `rewrites`."""
        i = next((k for k, (a, b) in enumerate(zip(given, rendered)) if a != b), min(len(given), len(rendered)))
        what = (f"at character {i} the model was given {given[i:i + 40]!r}, a re-render of the conversation writes "
                f"{rendered[i:i + 40]!r}")
        if self.history == "append_only":
            raise ValueError(self._not_append_only(f"the earlier turns render differently once later messages are "
                                                   f"added: {what}"))
        self.rewrites = self.rewrites or what

    def _turn_start(self, msgs: list[dict[str, Any]], full: str) -> str | None:
        """The part of `full` (`msgs` and a model turn after them, rendered) before the model's turn: the rendering
        of `msgs` with the generation prompt, or (agent.history=as_sampled, when the template re-renders `msgs`
        once a turn follows) `full` up to the template's generation prompt; None: the turn does not render after
        the generation prompt."""
        head = self.render(msgs, add_generation_prompt=True)
        if full.startswith(head):
            return head
        bare = self.render(msgs, add_generation_prompt=False)
        if self.history == "append_only" or not head.startswith(bare) or len(head) == len(bare):
            return None
        k = full.rfind(head[len(bare):])
        return full[:k + len(head) - len(bare)] if k >= 0 else None

    def check(self, tools: bool, user_turns: bool, first_user: str = "What is 2 + 3?") -> None:
        """Render a probe conversation turn by turn (prompt, a tool call, its result, an answer with reasoning, a
        user message, an answer) as the driver assembles it, and check in text and in tokens that each model turn
        renders after the generation prompt and ends with an end-of-turn token, and that the observation ids the
        driver computes from a short conversation are what the template renders for them after the model's latest
        turn. Where re-rendering the conversation changes earlier turns, agent.history=append_only refuses the
        template and as_sampled records it in `rewrites`. Raises ValueError naming agent.chat_template."""
        msgs: list[dict[str, Any]] = [{"role": "user", "content": first_user}]
        steps: list[tuple[list[list[dict[str, Any]]], str]] = []  # (alternatives of the new messages, who)
        if tools and self.tools:
            name = self.tools[0]["function"]["name"]
            call = {"type": "function", "function": {"name": name, "arguments": {"x": "2 + 3"}}, "id": "call00001"}
            steps.append(([[{"role": "assistant", "content": "", "tool_calls": [call]}]], "model"))
            steps.append(([[{"role": "tool", "name": name, "content": "5", "tool_call_id": "call00001"}]], "driver"))
        # reasoning in the answer (templates that drop earlier reasoning re-render it), or none where the generation
        # prompt closes the reasoning already (Qwen3 with enable_thinking=false)
        steps.append(([[{"role": "assistant", "content": "<think>\n2 + 3 = 5\n</think>\n\nThe answer is 5."}],
                       [{"role": "assistant", "content": "The answer is 5."}]], "model"))
        if user_turns:
            steps.append(([[{"role": "user", "content": "Correct. Now 4 + 4?"}]], "driver"))
            steps.append(([[{"role": "assistant", "content": "8"}]], "model"))
        text = self.render(msgs, add_generation_prompt=True)
        ids = self.encode(text)
        for alternatives, who in steps:
            if who == "model":  # the model's turn: everything up to and including its end-of-turn token
                for new in alternatives:
                    full = self.render(msgs + new, add_generation_prompt=False)
                    full = full[: self._cut(full)]
                    at = self._turn_start(msgs, full)
                    if at is not None:
                        break
                else:
                    raise ValueError(self._not_append_only("an assistant turn does not render after the "
                                                           "template's generation prompt"))
            else:
                new = alternatives[0]
                before = self.render(msgs, add_generation_prompt=False)
                full = self.render(msgs + new, add_generation_prompt=True)
                cut = self._cut(before)
                cut = cut if full.startswith(before[:cut]) else self._turn_end_in(before, full)
                at = full[:cut]
            if at != text:
                self._rewritten(text, at)
            piece_text = full[len(at):]
            piece = self.encode(piece_text)
            if who == "driver":  # what the driver computes from a short conversation must be this same piece
                alone = (self.tool_suffix(steps[0][0][0][0]["tool_calls"], new) if new[0]["role"] == "tool"
                         else self.user_suffix(new[0]["content"]))
                if alone != piece:
                    raise ValueError(self._not_append_only(
                        f"the tokens added for a {new[0]['role']} message depend on the earlier conversation"))
            if self.encode(full) != self.encode(at) + piece:
                raise ValueError(self._not_append_only(f"the tokens before a {new[0]['role']} message change "
                                                       "when it is added (a BPE merge across the seam)"))
            msgs, text, ids = msgs + new, text + piece_text, ids + piece
            if who == "model" and ids[-1] not in self.turn_end_ids:
                raise ValueError(self._not_append_only("an assistant turn does not end with its end-of-turn "
                                                       "token"))
        self.system_rewrite = self._system_rewrite(msgs)

    def _system_rewrite(self, msgs: list[dict[str, Any]]) -> str | None:
        """What re-rendering the probe conversation `msgs` does to a system message the prompt was given: None
        when the prompt's text up to the system message stays as it was (or the template renders no system
        message); else where the prompt wrote it and whether the re-render drops or moves it (Mistral Nemo writes it
        into the last user message only)."""
        system = [{"role": "system", "content": _SENTINEL}]
        try:
            given = self.render(system + msgs[:1], add_generation_prompt=True)
            rendered = self.render(system + msgs, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 (a template that refuses a system message renders none to move)
            return None
        at = given.find(_SENTINEL)
        if at < 0 or rendered[:at + len(_SENTINEL)] == given[:at + len(_SENTINEL)]:
            return None
        after = "a " + " and a ".join(dict.fromkeys(m["role"] for m in msgs[1:] if m["role"] != "assistant"))
        done = "moves it" if _SENTINEL in rendered else "drops it"
        return (f"the prompt writes the system message at character {at}; once a model turn and {after} message "
                f"follow, a re-render of the conversation {done}")


def tool_call_message(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    """One entry of an assistant message's `tool_calls` (transformers' format, arguments as a dict)."""
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


def renders_tools(tokenizer: Any, template: str, template_kwargs: dict[str, Any] | None = None) -> str | None:
    """None when the template renders tool schemas, calls (name and arguments) and tool results; else what it
    drops (as TRL's `supports_tool_calling`). `template_kwargs`: the template's own variables."""
    schema = {"type": "function", "function": {"name": "probe_tool_name_71", "description": "Probe.",
                                               "parameters": {"type": "object", "properties": {
                                                   "value": {"type": "string", "description": "A value."}}}}}
    call = tool_call_message("probe_call_name_72", {"value": "probe_argument_73"}, "a1b2c3d4e")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "probe_call_name_72", "content": "probe_result_74", "tool_call_id": "a1b2c3d4e"}]
    try:
        text = tokenizer.apply_chat_template(msgs, tools=[schema], chat_template=template, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 (a template that raises on tools cannot render them)
        return f"it raises on tool messages ({type(e).__name__}: {e})"
    missing = [what for what, s in (("the tool schemas", "probe_tool_name_71"), ("the call's name", "probe_call_name_72"),
                                    ("the call's arguments", "probe_argument_73"), ("the tool result", "probe_result_74"))
               if s not in text]
    return f"it drops {', '.join(missing)}" if missing else None


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
