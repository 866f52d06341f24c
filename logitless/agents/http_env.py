"""Environments served over HTTP: `agent.environment: http://host:port` (docs/agents.md, "HTTP environments").

The JSON follows OpenEnv's HTTP shapes, with the episode's id on every request so that one server can hold the
many episodes of a rollout at once:

    POST {url}/reset  {"seed": int, "episode_id": str, <agent.env_options.reset_fields of the row>}
        -> {"observation": {...} | str, "reward": float | null, "done": bool}
    POST {url}/step   {"action": {<action_key>: the model's turn text}, "episode_id": str}
        -> {"observation": {...} | str, "reward": float | null, "done": bool}

The model reads the observation's `observation_key` field (or the observation itself when it is a string). Each
episode gets its own `episode_id` (one session per episode); all `num_generations` episodes of a prompt reset with
one seed (the row's `seed` field, else a hash of the row), so a deterministic server gives them one first
observation, as GRPO needs.

Failures: a connection error or a 5xx answer is retried with backoff within the call's budget
(`agent.tool_timeout_s`); a server that stays unreachable, answers 4xx or answers something that is not the
protocol raises `AgentFatalError` naming the URL and the setting, which fails the run. A server that accepts the
request but does not answer within the budget is a step that timed out: the episode ends (`env_errors`).
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from logitless.agents.environment import EnvironmentClass
from logitless.agents.tools import AgentFatalError

URL_SCHEMES = ("http://", "https://")
RETRY_STATUS = (500, 502, 503, 504)
BACKOFF_S = 0.25  # first retry's wait; doubled per retry
BUDGET_SHARE = 0.9  # of agent.tool_timeout_s: retries end before the rollout abandons the call


def is_url(spec: Any) -> bool:
    """Whether agent.environment names a server (http:// or https://) rather than a class."""
    return isinstance(spec, str) and spec.startswith(URL_SCHEMES)


@dataclass
class HttpOptions:
    """`agent.env_options` of an HTTP environment."""

    action_key: str = "message"  # the action's field that holds the model's turn text
    observation_key: str = "text"  # the observation's field the model reads (a string observation is read as is)
    reset_fields: list[str] = field(default_factory=list)  # row fields sent with /reset (beside seed, episode_id)
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (e.g. Authorization)
    request_timeout_s: float | None = None  # one request's bound; None: agent.tool_timeout_s
    max_retries: int = 3  # retries of a request after a connection error or a 5xx answer


class HttpServer:
    """The connection to one environment server, shared by the episodes of a run (httpx's client is
    thread-safe and keeps connections alive)."""

    def __init__(self, url: str, options: HttpOptions, timeout_s: float) -> None:
        import httpx

        self.url, self.options = url.rstrip("/"), options
        self.budget_s = BUDGET_SHARE * timeout_s
        self.request_timeout_s = min(options.request_timeout_s or timeout_s, self.budget_s)
        self.client = httpx.Client(headers=options.headers, follow_redirects=True)
        self._httpx = httpx

    def check(self) -> None:
        """Refuse, before anything slow, a URL where no server answers (any HTTP answer to GET /health will do)."""
        try:
            self.client.get(f"{self.url}/health", timeout=min(5.0, self.request_timeout_s))
        except self._httpx.HTTPError as e:
            raise ValueError(f"agent.environment={self.url!r}: no environment server answers there "
                             f"({type(e).__name__}: {e}); start the server, or fix the URL") from None

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` as JSON and return the JSON object answered, retrying connection errors and 5xx answers
        with backoff within the call's budget. Raises AgentFatalError for a server that stays unreachable or
        breaks the protocol, TimeoutError for one that does not answer in time."""
        httpx, url = self._httpx, f"{self.url}{path}"
        deadline = time.monotonic() + self.budget_s
        attempt, why = 0, ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                response = self.client.post(url, json=body, timeout=min(self.request_timeout_s, left))
            except (httpx.ConnectTimeout, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                why = f"{type(e).__name__}: {e}"  # no server there, or it dropped the connection
            except httpx.TimeoutException:
                raise TimeoutError(f"POST {url} was not answered within {min(self.request_timeout_s, left):.3g} s "
                                   "(agent.env_options.request_timeout_s / agent.tool_timeout_s)") from None
            except httpx.HTTPError as e:
                raise AgentFatalError(f"agent.environment={self.url!r}: POST {path} failed ({type(e).__name__}: "
                                      f"{e})") from None
            else:
                if response.status_code in RETRY_STATUS:
                    why = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    return self._json(path, response)
            if attempt >= self.options.max_retries:
                break
            wait = BACKOFF_S * 2 ** attempt
            if time.monotonic() + wait >= deadline:
                break
            time.sleep(wait)
            attempt += 1
        raise AgentFatalError(
            f"agent.environment={self.url!r}: POST {path} failed after {attempt + 1} attempt(s) within "
            f"{self.budget_s:.3g} s ({why}); the environment server is down or unreachable. Restart it (the run can "
            "be resumed), or raise agent.env_options.max_retries / agent.tool_timeout_s for a server that restarts")

    def _json(self, path: str, response: Any) -> dict[str, Any]:
        if response.status_code >= 400:
            raise AgentFatalError(
                f"agent.environment={self.url!r}: POST {path} was refused with HTTP {response.status_code} "
                f"({response.text[:300]}); check the server's action and reset formats against "
                "agent.env_options (action_key, reset_fields)")
        try:
            data = response.json()
        except (json.JSONDecodeError, ValueError):
            data = None
        if not isinstance(data, dict) or "observation" not in data:
            raise AgentFatalError(f"agent.environment={self.url!r}: POST {path} answered {response.text[:200]!r}, "
                                  "not a JSON object with an 'observation' (and 'reward', 'done')")
        return data

    def close(self) -> None:
        self.client.close()


class HttpEnvironment:
    """One episode on an environment server: `reset` and `step` of the environment protocol over HTTP."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.episode_id = uuid.uuid4().hex

    def reset(self, row: dict[str, Any]) -> str | None:
        """POST /reset with the row's seed and this episode's id; the first observation's text."""
        opts = self.server.options
        missing = [k for k in opts.reset_fields if k not in row]
        if missing:
            raise ValueError(f"agent.env_options.reset_fields names {missing}, which the row lacks; its fields are "
                             f"{sorted(row)}")
        body = {"seed": row_seed(row), "episode_id": self.episode_id, **{k: row[k] for k in opts.reset_fields}}
        return self._text("/reset", self.server.post("/reset", body))

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        """POST /step with the model's turn as the action: (observation text, reward, done)."""
        data = self.server.post("/step", {"action": {self.server.options.action_key: text},
                                          "episode_id": self.episode_id})
        reward, done = data.get("reward"), data.get("done", False)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise AgentFatalError(f"agent.environment={self.server.url!r}: /step answered the reward {reward!r}; "
                                  "a reward is a number or null")
        if not isinstance(done, bool):
            raise AgentFatalError(f"agent.environment={self.server.url!r}: /step answered done={done!r}; done is "
                                  "true or false")
        return self._text("/step", data), None if reward is None else float(reward), done

    def _text(self, path: str, data: dict[str, Any]) -> str | None:
        obs, key = data["observation"], self.server.options.observation_key
        if obs is None or isinstance(obs, str):
            return obs
        if isinstance(obs, dict) and key in obs and (obs[key] is None or isinstance(obs[key], str)):
            return obs[key]
        fields = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
        raise AgentFatalError(f"agent.environment={self.server.url!r}: {path} answered an observation without a "
                              f"text field '{key}' (its fields: {fields}); set agent.env_options.observation_key "
                              "to the field the model should read")


def row_seed(row: dict[str, Any]) -> int:
    """The reset seed of a row: its `seed` field when that is an int >= 0, else a stable 31-bit hash of the row."""
    seed = row.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        return seed
    return zlib.crc32(json.dumps(row, sort_keys=True, default=str).encode()) & 0x7FFFFFFF


def http_environment(url: str, env_options: dict[str, Any], timeout_s: float) -> EnvironmentClass:
    """The checked environment of a server URL: `agent.env_options` read as HttpOptions, the server reachable."""
    known = list(HttpOptions.__dataclass_fields__)
    unknown = [k for k in env_options if k not in known]
    if unknown:
        raise ValueError(f"agent.env_options: {unknown} are not options of an HTTP environment; they are {known}")
    options = HttpOptions(**env_options)
    for key in ("action_key", "observation_key"):
        if not isinstance(getattr(options, key), str) or not getattr(options, key):
            raise ValueError(f"agent.env_options.{key}={getattr(options, key)!r}: give a field name")
    if not isinstance(options.reset_fields, list) or not all(isinstance(k, str) for k in options.reset_fields):
        raise ValueError(f"agent.env_options.reset_fields={options.reset_fields!r}: give a list of row field names")
    if not isinstance(options.headers, dict) or not all(isinstance(v, str) for v in options.headers.values()):
        raise ValueError("agent.env_options.headers: give {name: value} strings, e.g. {Authorization: 'Bearer ...'}")
    t = options.request_timeout_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        raise ValueError(f"agent.env_options.request_timeout_s={t!r}: give seconds > 0, or null for "
                         "agent.tool_timeout_s")
    if isinstance(options.max_retries, bool) or not isinstance(options.max_retries, int) or options.max_retries < 0:
        raise ValueError(f"agent.env_options.max_retries={options.max_retries!r}: give an int >= 0")
    server = HttpServer(url, options, timeout_s)
    try:
        server.check()
    except BaseException:
        server.close()
        raise
    return EnvironmentClass(HttpEnvironment, {"server": server}, label=f"HttpEnvironment({server.url})",
                            resource=server)
