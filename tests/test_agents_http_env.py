"""HTTP environments (agent.environment: http://...): a guessing game served by a real HTTP server on loopback
(stdlib http.server in a thread), driven with scripted turns and by CPU training runs; a dead, failing or
misspoken server fails the run naming the URL and the setting, within agent.tool_timeout_s."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from logitless.agents import AgentFatalError
from logitless.data.prompts import PromptRow
from tests.agent_fixtures import chatml_tokenizer, make_agent, run_turns
from tests.test_trainer import _cfg, _train, rewards_module, tok  # noqa: F401 (fixtures)


class GuessServer(ThreadingHTTPServer):
    """Guess a digit: the secret is the reset seed mod 10; each guess is answered higher/lower, done with reward 1
    when right. Episodes are kept by episode_id. `fail_next` answers that many requests with 503; `refuse` answers
    every /step with 422; `die_on_step` stops the server at the next /step, which gets no answer."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), GuessHandler)
        self.episodes: dict[str, int] = {}
        self.requests: list[tuple[str, dict]] = []
        self.fail_next, self.refuse, self.die_on_step = 0, False, False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        """Stop serving and close the listening socket: new connections are refused from here on."""
        self.shutdown()
        self.server_close()


class GuessHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, {"status": "healthy"} if self.path == "/health" else {"detail": "not found"})

    def do_POST(self) -> None:
        srv: GuessServer = self.server  # type: ignore[assignment]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append((self.path, body))
            if srv.die_on_step and self.path == "/step":
                srv.die_on_step = False
                threading.Thread(target=srv.stop).start()
                self.close_connection = True
                return None
            if srv.fail_next:
                srv.fail_next -= 1
                return self._send(503, {"detail": "warming up"})
            if self.path == "/reset":
                srv.episodes[body["episode_id"]] = body["seed"] % 10
                return self._send(200, {"observation": {"text": "Guess my digit.", "turn": 0}, "reward": None,
                                        "done": False})
            if srv.refuse:
                return self._send(422, {"detail": [{"loc": ["action", "guess"], "msg": "field required"}]})
            secret = srv.episodes[body["episode_id"]]
        text = str(body["action"]["message"]).strip()
        guess = int(text) if text.isdigit() else -1
        if guess == secret:
            return self._send(200, {"observation": {"text": "Right!"}, "reward": 1.0, "done": True})
        self._send(200, {"observation": {"text": "Higher." if guess < secret else "Lower."}, "reward": 0.0,
                         "done": False})

    def _send(self, status: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def server():
    srv = GuessServer()
    yield srv
    srv.stop()


def free_url() -> str:
    """A loopback URL where nothing listens."""
    srv = GuessServer()
    srv.stop()
    return srv.url


ROWS = [PromptRow([{"role": "user", "content": "Play."}], {"seed": 13}),
        PromptRow([{"role": "user", "content": "Play."}], {"seed": 7})]


def test_episodes_play_the_served_game_each_in_its_own_session(server):
    tok = chatml_tokenizer()
    with make_agent(tok, environment=server.url) as agent:
        driver = agent.driver(ROWS, 2)
        assert driver.prompts[0][-1]["content"] == "Play.\n\nGuess my digit."  # the first observation's text
        driver.begin(4, 2)
        out = run_turns(driver, tok, ["5<|im_end|>", "3<|im_end|>", "9<|im_end|>", "7<|im_end|>"])
        assert [o is None for o in out] == [False, True, False, True]  # 3 and 7 are right
        assert run_turns(driver, tok, ["3<|im_end|>", None, "7<|im_end|>", None]) == [None, None]
        records = driver.finish()
    assert [r.reward for r in records] == [1.0, 1.0, 1.0, 1.0]
    assert [m["content"] for m in records[0].messages] == ["5", "Lower.", "3"]
    resets = [b for p, b in server.requests if p == "/reset"]
    assert [b["seed"] for b in resets].count(13) == 2 and len({b["episode_id"] for b in resets}) == 4
    steps = [b for p, b in server.requests if p == "/step"]
    assert {b["episode_id"] for b in steps} == {b["episode_id"] for b in resets}  # one session per episode


def test_a_row_without_a_seed_resets_its_episodes_alike():
    from logitless.agents.http_env import row_seed

    row = {"prompt": [{"role": "user", "content": "x"}], "id": 3}
    assert row_seed(row) == row_seed(dict(row)) != row_seed({**row, "id": 4})
    assert row_seed({"seed": 5}) == 5


def test_5xx_answers_are_retried_with_backoff(server):
    tok = chatml_tokenizer()
    server.fail_next = 2
    with make_agent(tok, environment=server.url) as agent:
        driver = agent.driver(ROWS[:1], 1)
    assert driver.prompts[0][-1]["content"].endswith("Guess my digit.")
    assert [p for p, _ in server.requests] == ["/reset"] * 3


def test_a_url_where_no_server_answers_is_refused_when_the_agent_is_built():
    url = free_url()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"agent\.environment='{url}': no environment server answers there .*start "
                                         "the server, or fix the URL"):
        make_agent(environment=url)
    assert time.monotonic() - t0 < 5


def test_bad_http_options_are_refused(server):
    with pytest.raises(ValueError, match=r"agent\.env_options: \['high'\] are not options of an HTTP environment"):
        make_agent(environment=server.url, env_options={"high": 3})
    with pytest.raises(ValueError, match=r"agent\.env_options\.max_retries=-1"):
        make_agent(environment=server.url, env_options={"max_retries": -1})


def test_a_server_that_refuses_or_misspeaks_fails_the_rollout(server):
    tok = chatml_tokenizer()
    server.refuse = True
    with make_agent(tok, environment=server.url) as agent:
        driver = agent.driver(ROWS[:1], 1)
        driver.begin(1, 1)
        with pytest.raises(AgentFatalError, match=r"POST /step was refused with HTTP 422 .*field required.*action_key"):
            run_turns(driver, tok, ["5<|im_end|>"])
    with make_agent(tok, environment=server.url, env_options={"observation_key": "prompt"}) as agent:
        with pytest.raises(RuntimeError, match=r"without a text field 'prompt' \(its fields: \['text', 'turn'\]\); set "
                                               r"agent\.env_options\.observation_key"):
            agent.driver(ROWS[:1], 1)


def test_a_server_that_stops_fails_the_step_within_the_timeout(server):
    tok = chatml_tokenizer()
    with make_agent(tok, environment=server.url, tool_timeout_s=2.0) as agent:
        driver = agent.driver(ROWS[:1], 2)
        driver.begin(2, 2)
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(AgentFatalError, match=rf"agent\.environment='{server.url}': POST /step failed after 4 "
                                                  r"attempt\(s\) .*ConnectError.*the environment server is down"):
            run_turns(driver, tok, ["5<|im_end|>", "5<|im_end|>"])
        assert time.monotonic() - t0 < 2.0


HTTP_RUN = ["rollout.max_completion_length=24", "rollout.stop=[e]", "train.prompts_per_step=2",
            "rollout.num_generations=2", "reward.reward_funcs=[my_rewards:digits]", "agent.max_turns=3"]


def test_training_drives_the_served_game(tmp_path, tok, rewards_module, server):  # noqa: F811
    result = _train(_cfg(tmp_path / "run", f"agent.environment={server.url}", *HTTP_RUN, "train.max_steps=2"), tok)
    assert [r["step"] for r in result.records] == [1, 2]
    for r in result.records:
        assert r["episode/turns_mean"] > 1 and r["tokens/env_mean"] > 3  # "Lower."/"Higher." answered the turns
        assert "reward/environment/mean" in r
    resets = [b for p, b in server.requests if p == "/reset"]
    assert len(resets) == 2 * 2 * 2 and all(p in ("/reset", "/step") for p, _ in server.requests)


def test_killing_the_server_mid_run_fails_the_run_with_the_reason(tmp_path, tok, rewards_module, server):  # noqa: F811
    """The server stops at the first /step of the second step (that request gets no answer): the run fails with the
    reason within agent.tool_timeout_s, after the first step's record."""
    def hook(event: str, step: int) -> None:
        if event == "generate" and step == 2:
            server.die_on_step = True

    cfg = _cfg(tmp_path / "run", f"agent.environment={server.url}", *HTTP_RUN, "train.max_steps=3",
               "agent.tool_timeout_s=3")
    t0 = time.monotonic()
    with pytest.raises(AgentFatalError, match=rf"agent\.environment='{server.url}': POST /step failed after \d "
                                              r"attempt\(s\) within 2.7 s .*the environment server is down"):
        _train(cfg, tok, hook=hook)
    assert time.monotonic() - t0 < 60
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
