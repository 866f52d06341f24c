"""`AgentDriver` (built by `Agent.driver`, `agent.py`): what answers the model between turns
(logitless.rollout.episodes).

Per model turn the driver decodes the turn's ids (only to read them), parses tool calls, runs them (or steps the
environment), and returns the token ids of the answer: the chat template's suffix for the tool or user messages
and the next generation prompt, or `<result>...</result>` in the raw protocol. The model's own ids are never
re-encoded. An episode ends when the model answers without a tool call (and the environment, if any, says done),
at `max_turns`, when a turn is cut by a budget, or when an observation would not fit the episode's budget.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from logitless.agents.environment import check_first, check_reward, check_step, has_image
from logitless.agents.parsing import PARSERS, ParsedTurn, ToolCall
from logitless.agents.runner import Outcome, TaskPool, run_tasks
from logitless.agents.rowtools import unknown_tool
from logitless.agents.templates import special_ids, tool_call_message, with_system
from logitless.agents.tools import (AgentFatalError, Tool, ToolResult, check_arguments,
                                    cut_middle, error_text, run_call)
from logitless.rollout.episodes import EpisodeRecord, ImageReply, TurnEnd
from logitless.rollout.vision import encode_text_with_images, prompt_images

RAW_STOP = "</call>"


@dataclass
class _Episode:
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    env: Any = None
    done: bool = False
    rewards: list[float] = field(default_factory=list)


@dataclass
class _Plan:
    """What one turn needs before its answer can be written."""

    turn: TurnEnd
    parsed: ParsedTurn
    continuable: bool
    results: list[ToolResult | None] = field(default_factory=list)  # one per call
    step_text: str = ""  # what the environment's step() reads (a turn without calls)
    step_out: Outcome | None = None  # how step() ended
    waiting: int = 0  # tasks of this turn still running (its answer is written when none is)


class AgentDriver:
    """Implements `logitless.rollout.episodes.EpisodeDriver` for one rollout (rows i*G + g of prompt i)."""

    def __init__(self, agent: Any, rows: Sequence[Any], num_generations: int, fmt: str) -> None:  # agent: `Agent`
        self.agent, self.options, self.format = agent, agent.options, fmt
        self.rows, self.num_generations = list(rows), num_generations
        tok = agent.tokenizer
        self.parse = PARSERS[fmt] if fmt in PARSERS else PARSERS["hermes"]
        self.turn_end_ids: list[int] = list(agent.bridge.turn_end_ids) if fmt != "raw" else []
        self.turn_stops: list[str] = [RAW_STOP] if fmt == "raw" and agent.toolset else []
        self.max_turn_tokens: int | None = self.options.max_turn_tokens
        # a template that renders one tool call per assistant turn (Llama 3.1): a turn with several is one invalid call
        self.one_call = fmt != "raw" and bool(agent.toolset) and not agent.bridge.renders_several_calls()
        # call ids where the model wrote none (9 digits): row and count of its calls, whatever order rows end in
        self._calls = [0] * (len(self.rows) * num_generations)
        self._pool: TaskPool | None = None  # runs the turns' calls and steps (created at the first submit)
        self._replies: list[tuple[int, list[int] | None]] = []  # answered turns not yet handed back by ready()
        self._inflight = 0
        self._warned = False
        self._special = special_ids(tok)
        self._records: list[EpisodeRecord] | None = None  # set by finish()
        keys = ["observation_tokens", "tool_timeouts", "tool_outputs_cut"] + (["env_errors"] if agent.env else [])
        self.episodes = [_Episode(EpisodeRecord(metrics=dict.fromkeys(keys, 0.0)))
                         for _ in range(len(self.rows) * num_generations)]
        self.prompts: list[Any] = []  # each prompt as given to the model (with the environment's first observation)
        self.prompt_ids: list[list[int]] = []
        self.prompt_images: list[Any] = []  # each prompt's image tensors (a vision-language model), or None
        # each prompt's tools (agent.tools_field; every tool without it) and the bridge that shows them
        self.allowed = [agent.row_tools.names(row, f"prompt {i} of this rollout") for i, row in enumerate(self.rows)]
        self.bridges = [agent.row_tools.bridge(names) for names in self.allowed]
        for i, row in enumerate(self.rows):
            first = self._reset(i, row)
            prompt = row.prompt
            if fmt == "raw":
                prompt = prompt + (first or "")
                ids = list(tok(prompt, add_special_tokens=True)["input_ids"])
            else:
                prompt = with_system([dict(m) for m in prompt], self.options.system_prompt)
                if first is not None:
                    if prompt and prompt[-1]["role"] == "user":
                        text = prompt[-1]["content"]
                        if isinstance(text, list):  # content blocks (images): the observation is one more block
                            prompt[-1]["content"] = [*text, {"type": "text", "text": first}]
                        else:
                            prompt[-1]["content"] = f"{text}\n\n{first}" if text else first
                    else:
                        prompt.append({"role": "user", "content": first})
                if prompt_images(prompt):
                    ids, tensors = self._with_images(
                        lambda b=self.bridges[i], p=prompt: b.render(p, add_generation_prompt=True),
                        prompt_images(prompt), f"prompt {i}", True)
                else:
                    ids, tensors = self.bridges[i].prompt_ids(prompt), None
                self.prompt_images.append(tensors)
            self.prompts.append(prompt)
            self.prompt_ids.append(ids)
        if fmt == "raw":
            self.prompt_images = [None] * len(self.rows)

    def _reset(self, i: int, row: Any) -> str | None:
        """Build and reset the environments of prompt i's episodes (concurrently, each within
        agent.tool_timeout_s); their common first observation."""
        env = self.agent.env
        if env is None:
            return None
        G = self.num_generations
        fields = dict(getattr(row, "fields", {}) or {})
        fields.setdefault("prompt", row.prompt)

        def start(ep: _Episode) -> Any:
            ep.env = env.make()
            return ep.env.reset(dict(fields))

        eps = self.episodes[i * G:(i + 1) * G]
        outs = run_tasks([lambda ep=ep: start(ep) for ep in eps], [self.options.tool_timeout_s] * G,
                         self.options.max_parallel_tools, [f"{env.name}.reset()"] * G)
        firsts = []
        for out in outs:
            if out.timed_out:
                raise RuntimeError(f"agent.environment: building or resetting {env.name} for prompt {i} did not "
                                   f"return within agent.tool_timeout_s={self.options.tool_timeout_s:g} s; make "
                                   "reset() return sooner, or raise agent.tool_timeout_s")
            if out.error is not None:
                e = out.error
                raise RuntimeError(f"agent.environment: building or resetting {env.name} for prompt {i} failed "
                                   f"({type(e).__name__}: {e})") from e
            firsts.append(check_first(env.name, out.value))
        if any(f != firsts[0] for f in firsts):
            raise ValueError(f"agent.environment: {env.name}.reset() gave the {G} episodes of prompt {i} different "
                             "first observations; GRPO compares samples of one state, so seed any randomness of "
                             "reset from the row (e.g. random.Random(row['id']))")
        return firsts[0]

    # -- the episode protocol --------------------------------------------------------------------------------

    def begin(self, num_rows: int, num_generations: int) -> None:
        if num_generations != self.num_generations or num_rows != len(self.episodes):
            raise ValueError(f"AgentDriver.begin({num_rows}, {num_generations}): this driver was made for "
                             f"{len(self.rows)} prompts x {self.num_generations} generations")

    def respond(self, turns: list[TurnEnd]) -> list[list[int] | None]:
        """The replies to `turns`, once all their calls and environment steps have run (`submit`, then `ready`
        until every one is answered)."""
        if self._inflight:
            raise RuntimeError("AgentDriver.respond: turns submitted earlier are still being answered")
        self.submit(turns)
        got: dict[int, list[int] | None] = {}
        while len(got) < len(turns):
            got.update(self.ready(wait=True))
        return [got[t.row] for t in turns]

    def submit(self, turns: list[TurnEnd]) -> None:
        """Start answering `turns` and return at once: their tool calls and environment steps run in the driver's
        workers (at most agent.max_parallel_tools at a time, each bounded by agent.tool_timeout_s) while the
        engine decodes other rows; `ready` hands back each reply once its turn's work is done."""
        plans: list[_Plan | None] = []
        for t in turns:
            ep = self.episodes[t.row]
            if ep.done:
                raise ValueError(f"AgentDriver.respond: row {t.row}'s episode has already ended")
            ep.record.turns += 1
            ep.record.turn_rewards.append(None)
            plans.append(self._plan(t, ep))
        self._inflight += len(turns)
        for t, p in zip(turns, plans):
            if p is None:
                self._replies.append((t.row, None))
        self._run([p for p in plans if p is not None])

    def ready(self, wait: bool = False) -> list[tuple[int, list[int] | None]]:
        """(row, reply) of each submitted turn whose calls and step have ended since the last call, in the order
        they ended; a reply is the ids to append or None (the episode is over). wait: block until there is one
        (while any turn is in flight). Raises what the run must stop for (a server gone, TaskStuck)."""
        from logitless.stops import stoppable

        while True:
            blocking = wait and not self._replies and self._pool is not None and self._pool.pending > 0
            if self._pool is not None:
                if blocking:
                    with stoppable("the agent's tool and environment calls"):
                        outs = self._pool.poll(wait=True)
                else:
                    outs = self._pool.poll()
                for (sink, plans), out in outs:
                    self._settle(sink, plans, out)
            if self._replies or not blocking:
                break
        done, self._replies = self._replies, []
        self._inflight -= len(done)
        return done

    @property
    def in_flight(self) -> int:
        """Turns submitted whose reply `ready` has not handed back yet."""
        return self._inflight

    def finish(self) -> list[EpisodeRecord]:
        if self._records is not None:
            return self._records
        env = self.agent.env
        if env is not None and (env.has_reward or env.has_close):
            n = len(self.episodes)
            outs = run_tasks([lambda e=ep.env: _final_reward(e, env.has_reward, env.has_close) for ep in self.episodes],
                             [self.options.tool_timeout_s] * n, self.options.max_parallel_tools,
                             [f"{env.name}.reward()/close()"] * n)
            for ep, out in zip(self.episodes, outs):
                if out.error is not None or out.timed_out:
                    self._env_error(ep, "reward" if env.has_reward else "close", out)
                    continue
                value, closing = out.value
                if env.has_reward:
                    value = check_reward(f"{env.name}.reward()", value)
                    if value is not None:
                        ep.rewards.append(value)
                if closing is not None:  # the reward stands; close() is named as what failed
                    self._env_error(ep, "close", Outcome(error=closing))
        records = []
        for ep in self.episodes:
            ep.record.reward = sum(ep.rewards) if ep.rewards else None
            ep.done, ep.env = True, None
            records.append(ep.record)
        self._records = records
        return records

    # -- one turn --------------------------------------------------------------------------------------------

    def _plan(self, t: TurnEnd, ep: _Episode) -> _Plan | None:
        tok = self.agent.tokenizer
        ids = list(t.ids)
        closed = bool(ids) and ids[-1] in self.turn_end_ids
        body = ids[:-1] if ids and ids[-1] in self._special else ids
        text = tok.decode(body, skip_special_tokens=False)
        if t.ended in ("length", "budget"):  # cut by a budget: a half-written turn is not a call
            ep.record.messages.append({"role": "assistant", "content": text.strip()})
            return self._end(ep, truncated=True)
        if self.agent.toolset:
            parsed = self.parse(text)
        else:  # no tools: calls are not read (harmony: the final channel's text is still the content)
            parsed = ParsedTurn(self.parse(text).content if self.format == "harmony" else text.strip(), [])
        if self.one_call and len(parsed.calls) > 1:
            parsed.calls = [ToolCall(None, error=f"this model's chat template takes one tool call per turn, and the "
                                                 f"turn wrote {len(parsed.calls)}: write one call, read its result, "
                                                 "then write the next")]
        for c in parsed.calls:
            c.id = c.id or self._call_id(t.row)
        malformed = any(c.error is not None or c.name is None for c in parsed.calls)
        # a malformed call keeps the turn's whole text, so that rewards and eval samples see what the model wrote
        message: dict[str, Any] = {"role": "assistant", "content": text.strip() if malformed else parsed.content}
        if parsed.calls:  # as the template renders them to the model: each tool result answers one of these
            message["tool_calls"] = call_messages(parsed.calls)
        ep.record.messages.append(message)
        # chat: only a turn closed by the template's end-of-turn token continues token-exactly; raw: a call
        # continues only when its </call> ended the turn (an EOS after an unclosed call ends the episode)
        continuable = closed if self.format != "raw" else (t.ended == "stop" or not parsed.calls)
        if parsed.calls:
            if not continuable:  # ended by another EOS or a stop string: the model ended the conversation
                return self._end(ep)
            if ep.record.turns >= self.options.max_turns:
                return self._end(ep, truncated=True)
            return _Plan(t, parsed, continuable, results=[None] * len(parsed.calls))
        if self.agent.env is None:
            return self._end(ep)
        # what step() reads: the turn without special tokens (harmony: the final channel's text, not its headers)
        content = parsed.content if self.format == "harmony" else tok.decode(body, skip_special_tokens=True)
        return _Plan(t, ParsedTurn(content, []), continuable, step_text=content)

    def _run(self, plans: list[_Plan]) -> None:
        """Submit every call and environment step of these turns to the driver's pool (see runner.TaskPool); a
        turn whose calls were all refused before running is answered at once."""
        if self._pool is None:
            self._pool = TaskPool(self.options.max_parallel_tools)
        tasks = []  # (fn, timeout, name, sink, the plans it answers); sink(outcome) stores a task's outcome
        batches: dict[str, list[tuple[_Plan, int, dict[str, Any]]]] = {}
        for p in plans:
            ep = self.episodes[p.turn.row]
            if not p.parsed.calls:  # an environment step
                tasks.append((lambda e=ep.env, text=p.step_text: e.step(text), self.options.tool_timeout_s,
                              f"{self.agent.env.name}.step()",  # type: ignore[union-attr]
                              lambda out, p=p: setattr(p, "step_out", out), [p]))
                continue
            chain = []  # environment-method calls of this episode: one after another, in the model's order
            for k, call in enumerate(p.parsed.calls):
                tool, args, err = self._check(call, self.allowed[p.turn.row // self.num_generations])
                if err is not None:
                    p.results[k] = ToolResult(error_text(err), error=True)
                elif tool.batch is not None:
                    batches.setdefault(tool.name, []).append((p, k, args))
                elif tool.method:
                    chain.append((k, tool, args))
                else:
                    tasks.append((lambda tool=tool, args=args: [run_call(tool, args, None)], tool.timeout_s,
                                  f"the tool '{tool.name}'",
                                  lambda out, p=p, ks=[k], tools=[tool]: self._store(p, ks, tools, out), [p]))
            if chain:
                tasks.append((lambda chain=chain, e=ep.env: [run_call(tool, args, e) for _, tool, args in chain],
                              sum(tool.timeout_s for _, tool, _ in chain),
                              " then ".join(f"the tool '{tool.name}'" for _, tool, _ in chain),
                              lambda out, p=p, c=chain: self._store(p, [k for k, _, _ in c], [t for _, t, _ in c], out),
                              [p]))
        for name, items in batches.items():
            tool = self.agent.toolset[name]
            tasks.append((lambda tool=tool, items=items: tool.batch([a for _, _, a in items]),  # type: ignore[misc]
                          tool.batch_timeout(len(items)) if tool.batch_timeout else tool.timeout_s,
                          f"the tool '{tool.name}' ({len(items)} calls)",
                          lambda out, items=items, tool=tool: self._store_batch(items, tool, out),
                          [p for p, _, _ in items]))
        for *_, answers in tasks:
            for p in answers:
                p.waiting += 1
        for p in plans:
            if p.waiting == 0:  # every call was refused before running
                self._replies.append((p.turn.row, self._answer(p)))
        for fn, timeout, name, sink, answers in tasks:
            self._pool.submit(fn, timeout, name, (sink, answers))

    def _settle(self, sink: Any, plans: list[_Plan], out: Outcome) -> None:
        """Store a task's outcome; answer each turn whose last task it was."""
        if isinstance(out.error, AgentFatalError):  # a server the agent needs is gone: the run fails, naming it
            raise out.error
        sink(out)
        for p in plans:
            p.waiting -= 1
            if p.waiting == 0:
                self._replies.append((p.turn.row, self._answer(p)))

    def _call_id(self, row: int) -> str:
        """The next id of a call of `row`'s episode that the model gave none: 9 digits, the row's then the count of
        its calls (so ids do not depend on which rows' turns ended first)."""
        n, self._calls[row] = self._calls[row], self._calls[row] + 1
        return f"{(row * 10_000 + n) % 10**9:09d}"

    def _check(self, call: ToolCall, allowed: tuple[str, ...]) -> tuple[Tool | None, dict[str, Any], str | None]:
        """The tool and checked arguments of a call, or the error the model reads (`allowed`: its row's tools)."""
        if call.error is not None:
            return None, {}, call.error
        if call.name not in allowed:  # not configured, or not one of this row's tools: the same answer
            return None, {}, unknown_tool(call.name, allowed)
        tool = self.agent.toolset[call.name]  # type: ignore[index]
        args, err = check_arguments(tool, call.arguments, call.positional)
        return tool, args, err

    @staticmethod
    def _store(p: _Plan, ks: list[int], tools: list[Tool], out: Outcome) -> None:
        for j, (k, tool) in enumerate(zip(ks, tools)):
            if out.timed_out or out.error is not None or not isinstance(out.value, list) or j >= len(out.value):
                p.results[k] = _failed(tool, out)
            else:
                p.results[k] = out.value[j]

    @staticmethod
    def _store_batch(items: list[tuple[_Plan, int, dict[str, Any]]], tool: Tool, out: Outcome) -> None:
        if out.error is not None:  # the tool's machinery (the sandbox) failed, not the model's programs
            raise RuntimeError(f"the {tool.name} tool failed ({type(out.error).__name__}: {out.error})") from out.error
        values = out.value if isinstance(out.value, list) and len(out.value) == len(items) else None
        for j, (p, k, _) in enumerate(items):
            p.results[k] = values[j] if values is not None and not out.timed_out else _failed(tool, out)

    def _answer(self, p: _Plan) -> list[int] | None:
        """The ids to append after a turn whose calls / step have run, or None (episode over)."""
        ep, opts, t = self.episodes[p.turn.row], self.options, p.turn
        rec = ep.record
        if p.parsed.calls:
            msgs = []
            for call, res in zip(p.parsed.calls, p.results):
                assert res is not None
                text, cut = cut_middle(res.text, opts.max_tool_output_chars)
                rec.tool_calls += 1
                rec.tool_errors += int(res.error)
                _count(rec, "tool_timeouts", res.timed_out)
                _count(rec, "tool_outputs_cut", cut or res.cut)
                msgs.append({"role": "tool", "name": call.name or "invalid_call", "content": text,
                             "tool_call_id": call.id})
            if self.format == "raw":
                ids = self._encode("".join(f"<result>{m['content']}</result>" for m in msgs))
            else:
                bridge = self.bridges[t.row // self.num_generations]
                ids = bridge.tool_suffix(call_messages(p.parsed.calls), msgs)  # type: ignore[union-attr]
        else:
            out = p.step_out
            assert out is not None
            if out.error is not None or out.timed_out:
                self._env_error(ep, "step", out)
                return self._end(ep)
            obs, reward, done = check_step(self.agent.env.name, out.value)  # type: ignore[union-attr]
            if reward is not None:
                ep.rewards.append(reward)
                rec.turn_rewards[-1] = reward
            if done or obs is None or not p.continuable:
                return self._end(ep)
            if rec.turns >= opts.max_turns:
                return self._end(ep, truncated=True)
            msgs = [{"role": "user", "content": obs}]
            bridge = self.bridges[t.row // self.num_generations]
            if has_image(obs):
                if self.format == "raw":
                    raise ValueError(f"agent.environment: {self.agent.env.name}.step() returned an image, which "  # type: ignore[union-attr]
                                     "the raw-text protocol (agent.format=raw) cannot show: use chat prompts")
                refs = [b["image"] for b in obs if b["type"] == "image"]  # type: ignore[union-attr]
                ids = ImageReply(*self._with_images(lambda: bridge.user_suffix_text(obs), refs,  # type: ignore[union-attr]
                                                    f"agent.environment: {self.agent.env.name}.step()", False))  # type: ignore[union-attr]
                msgs = [{"role": "user", "content": traced(obs)}]
            else:
                ids = self._encode(obs) if self.format == "raw" else bridge.user_suffix(obs)  # type: ignore[union-attr]
        if len(ids) >= t.room:  # the observation and one more model token would not fit the episode's budget
            return self._end(ep, truncated=True)
        rec.messages.extend(msgs)
        _count(rec, "observation_tokens", len(ids))
        return ids

    def _with_images(self, render: Any, refs: list[Any], where: str, first: bool) -> tuple[list[int], Any]:
        """(ids, image tensors) of the chat text `render()` writes, holding `refs`' images (a prompt's, `first`:
        with the tokenizer's special tokens; an observation's: without), expanded by the vision-language model's
        processor. Refused naming `where`: a text model, a chat template that cannot render image blocks, images
        that cannot be read."""
        if self.agent.processor is None:
            raise ValueError(f"{where} holds an image, but the model is a text model (it has no processor to show "
                             "images): use a vision-language model (model.name_or_path), or return text")
        try:
            text = render()
        except Exception as e:  # noqa: BLE001 (jinja errors of a template that renders no content blocks)
            raise ValueError(f"{where} holds an image, which the agent's chat template cannot render "
                             f"({type(e).__name__}: {e}); use the model's own template (unset agent.chat_template; "
                             "with tools, one that renders both tools and images)") from None
        try:
            return encode_text_with_images(self.agent.processor, text, refs, add_special_tokens=first)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: its images cannot be processed ({e})") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.agent.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _end(ep: _Episode, truncated: bool = False) -> None:
        ep.done = True
        ep.record.truncated = ep.record.truncated or truncated
        return None

    def _env_error(self, ep: _Episode, what: str, out: Outcome) -> None:
        name = self.agent.env.name  # type: ignore[union-attr]
        _count(ep.record, "env_errors", True)
        if not self._warned:
            self._warned = True
            why = (f"did not return within {self.options.tool_timeout_s:g} s (agent.tool_timeout_s)" if out.timed_out
                   else f"raised {type(out.error).__name__}: {out.error}")
            warnings.warn(f"agent.environment: {name}.{what}() {why}; the episode ended there (counted in the "
                          "episode metric env_errors; further errors of this rollout are not warned)", stacklevel=3)


def traced(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content blocks as an episode record keeps them: an image as {"type": "image"} without its pixels (records
    are written to traces and logs)."""
    return [{"type": "image"} if b["type"] == "image" else dict(b) for b in blocks]


def _final_reward(env: Any, reward: bool, close: bool) -> tuple[float | None, BaseException | None]:
    """`env.reward()` (None without one), then `env.close()` if it has one (also after reward() raised, whose
    error then propagates); returns the reward and what close() raised, so that each is reported under its name."""
    closing = None
    try:
        value = env.reward() if reward else None
    finally:
        if close:
            try:
                env.close()
            except Exception as e:  # noqa: BLE001 (user code: any error is close()'s)
                closing = e
    return value, closing


def _failed(tool: Tool, out: Outcome) -> ToolResult:
    if out.timed_out:
        return ToolResult(error_text(f"{tool.name} did not finish within {out.seconds:.3g} s and was abandoned"),
                          error=True, timed_out=True)
    if out.error is not None:
        return ToolResult(error_text(f"{tool.name} failed: {type(out.error).__name__}: {out.error}"), error=True)
    return ToolResult(error_text(f"{tool.name} returned no result"), error=True)


def _count(rec: EpisodeRecord, key: str, value: int | bool) -> None:
    rec.metrics[key] = rec.metrics.get(key, 0.0) + float(value)


def call_messages(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The `tool_calls` of an assistant turn: a malformed call as `invalid_call` with no arguments."""
    return [tool_call_message(c.name or "invalid_call", c.arguments if c.error is None else {}, c.id)  # type: ignore[arg-type]
            for c in calls]
