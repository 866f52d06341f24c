"""MCP tools (agent.mcp_servers): a stdio MCP server written here with the official SDK's MCPServer (FastMCP in mcp
1.x) serves tools that scripted turns and a CPU training run call like local tools; the servers start with the
agent, stop with it (no process left behind), and a server that cannot start or exits is named."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import torch

from logitless.agents import AgentFatalError, AgentOptions
from logitless.data.prompts import PromptRow
from logitless.trainer.loop import train
from tests.agent_fixtures import call_text, chatml_tokenizer, make_agent, run_turns, tool_text
from tests.conftest import tiny_qwen2
from tests.test_trainer import VOCAB, _cfg, tok  # noqa: F401 (fixtures)

SERVER = '''
import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

LOG = os.environ["VAULT_LOG"]
with open(LOG, "a") as f:
    f.write(f"start {os.getpid()}\\n")
server = MCPServer("vault")


@server.tool()
def secret() -> str:
    """The vault's secret."""
    with open(LOG, "a") as f:
        f.write("call secret\\n")
    return "the secret is 42"


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def refuse(reason: str) -> str:
    """Refuse, saying why."""
    raise ToolError(f"refused: {reason}")


@server.tool()
async def slow(seconds: float) -> str:
    """Wait, then answer."""
    await anyio.sleep(seconds)
    return "done"


if __name__ == "__main__":
    server.run()
'''


@pytest.fixture
def vault(tmp_path):
    """The server's entry of agent.mcp_servers, and its log (a line per start with its pid, one per secret call)."""
    (tmp_path / "vault_server.py").write_text(textwrap.dedent(SERVER))
    log = tmp_path / "vault.log"
    return {"name": "vault", "command": [sys.executable, str(tmp_path / "vault_server.py")],
            "env": {"VAULT_LOG": str(log)}}, log


def started(log) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("start")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_mcp_tools_are_described_and_called_like_local_tools(vault):
    spec, log = vault
    tok = chatml_tokenizer()
    with make_agent(tok, mcp_servers=[spec], tool_timeout_s=8.0) as agent:
        assert list(agent.tools) == ["secret", "add", "refuse", "slow"]
        add = agent.tools["add"].schema["function"]
        assert add["description"] == "Add two integers."
        assert add["parameters"]["properties"]["a"]["type"] == "integer" and add["parameters"]["required"] == ["a", "b"]
        assert '"name": "add"' in agent.bridge.render([{"role": "user", "content": "x"}], True)  # shown to the model
        driver = agent.driver([PromptRow([{"role": "user", "content": "Go."}])], 4)
        driver.begin(4, 4)
        run_turns(driver, tok, [call_text("add", {"a": 2, "b": 40}), call_text("refuse", {"reason": "no"}),
                                call_text("add", {"a": "two", "b": 1}), call_text("secret")])
        assert [tool_text(driver, r) for r in range(4)] == [
            "42", "Error: Error executing tool refuse: refused: no",  # (the server's text)
            "Error: add(): argument 'a' must be integer, got \"two\"", "the secret is 42"]
        (pid,) = started(log)
        assert alive(pid)
    assert not alive(pid)  # closing the agent stopped the server


def test_a_call_past_the_timeout_is_abandoned_and_the_server_goes_on(vault):
    spec, _ = vault
    tok = chatml_tokenizer()
    with make_agent(tok, mcp_servers=[spec], tool_timeout_s=1.5) as agent:
        driver = agent.driver([PromptRow([{"role": "user", "content": "Go."}])], 2)
        driver.begin(2, 2)
        t0 = time.monotonic()
        run_turns(driver, tok, [call_text("slow", {"seconds": 30}), call_text("slow", {"seconds": 0})])
        assert time.monotonic() - t0 < 5
        assert tool_text(driver, 0).startswith("Error: slow did not finish within 1.5 s and was abandoned")
        assert tool_text(driver, 1) == "done"


def test_a_server_that_exits_fails_the_rollout_naming_it(vault):
    spec, log = vault
    tok = chatml_tokenizer()
    with make_agent(tok, mcp_servers=[spec]) as agent:
        driver = agent.driver([PromptRow([{"role": "user", "content": "Go."}])], 1)
        driver.begin(1, 1)
        os.kill(started(log)[0], 9)
        with pytest.raises(AgentFatalError, match=r"agent\.mcp_servers: the server 'vault' closed the connection"):
            run_turns(driver, tok, [call_text("secret")])


def test_servers_that_cannot_start_are_refused_naming_the_entry(vault, tmp_path):
    spec, log = vault
    with pytest.raises(ValueError, match=r"agent\.mcp_servers\[0\] 'gone' \(/no/such/program\) failed to start "
                                         r"\(FileNotFoundError"):
        make_agent(mcp_servers=[{"name": "gone", "command": ["/no/such/program"]}])
    crash = [sys.executable, "-c", "import sys; sys.exit('no database at /data')"]
    with pytest.raises(ValueError, match=r"'crash' .* failed to start .*its stderr ends:\nno database at /data"):
        make_agent(mcp_servers=[{"name": "crash", "command": crash}])
    with pytest.raises(ValueError, match=r"agent\.mcp_servers\[1\] 'vault' .*: names \['sekret'\] in tools, which the "
                                         r"server does not serve; it serves \['secret', 'add', 'refuse', 'slow'\]"):
        make_agent(mcp_servers=[{**spec, "name": "first"}, {**spec, "tools": ["sekret"]}])
    assert len(started(log)) == 2 and not any(alive(p) for p in started(log))  # both stopped again
    with pytest.raises(ValueError, match=r"agent\.mcp_servers \(the tool 'slow'\): two tools are named 'slow'"):
        make_agent(tools=["tests.agent_fixtures:slow"], mcp_servers=[spec])
    assert not any(alive(p) for p in started(log))


def test_bad_server_entries_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"agent\.mcp_servers\[0\]\.command=None is invalid: give the program"):
        AgentOptions(mcp_servers=[{"name": "x"}])
    with pytest.raises(ValueError, match=r"agent\.mcp_servers\[0\]: \['args'\] are not server options"):
        AgentOptions(mcp_servers=[{"name": "x", "command": ["y"], "args": []}])
    with pytest.raises(ValueError, match=r"agent\.mcp_servers\[1\]\.name='x': two servers are named so"):
        AgentOptions(mcp_servers=[{"name": "x", "command": ["y"]}, {"name": "x", "command": ["z"]}])
    assert AgentOptions(mcp_servers=[{"name": "x", "command": "python -m srv"}]).enabled


def test_without_the_sdk_the_error_names_the_install(monkeypatch, vault):
    monkeypatch.setitem(sys.modules, "mcp", None)  # import mcp raises ImportError
    with pytest.raises(ValueError, match=r"agent\.mcp_servers needs the MCP SDK, which is not installed: pip install "
                                         r"'logitless\[agents-mcp\]'"):
        make_agent(mcp_servers=[vault[0]])


# The policy writes the call itself: a one-layer model whose attention and MLP add nothing, so each next token
# follows from the current one alone, with embedding and lm_head rows chosen for the chain
# "." -> "<call>secret()</call>" (the prompts end with "."), and after "</result>" "secret()</call>" (no call: done).
CHAIN = {".": "<", "<": "call", "call": ">", ">": "secret", "secret": "()", "()": "</", "</": "call"}

TRAIN_REWARDS = '''
SEEN = []

def seen(prompts, completions, **fields):
    """Keeps each conversation; 0 reward."""
    SEEN.extend(completions)
    return [0.0] * len(completions)
'''


def chain_model(tok):  # noqa: F811
    model = tiny_qwen2(vocab_size=VOCAB, hidden=32, layers=1, tie=False)
    ids = {t: tok.convert_tokens_to_ids(t) for t in {*CHAIN, *CHAIN.values()}}
    ids["."] = tok(".", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, (src, dst) in enumerate(CHAIN.items()):
            model.model.embed_tokens.weight[ids[src]] = 0.0
            model.model.embed_tokens.weight[ids[src], i] = 10.0
            model.lm_head.weight[ids[dst], i] += 20.0
    return model


def test_training_calls_the_mcp_tool_and_stops_the_server(tmp_path, tok, vault, monkeypatch):  # noqa: F811
    spec, log = vault
    (tmp_path / "mcp_rewards.py").write_text(textwrap.dedent(TRAIN_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mcp_rewards", raising=False)
    servers = "[{name: vault, command: [%s, %s], env: {VAULT_LOG: %s}}]" % (*spec["command"], spec["env"]["VAULT_LOG"])
    cfg = _cfg(tmp_path / "run", f"agent.mcp_servers={servers}", "agent.max_turns=2", "agent.tool_timeout_s=20",
               "train.max_steps=2", "train.prompts_per_step=1", "rollout.num_generations=2",
               "rollout.max_completion_length=40", "reward.reward_funcs=[mcp_rewards:seen]")
    result = train(cfg, model=chain_model(tok), tokenizer=tok)
    assert [r["step"] for r in result.records] == [1, 2]
    assert all(r["episode/tool_calls_mean"] == 1 and r["episode/tool_errors_mean"] == 0 for r in result.records)
    import mcp_rewards

    assert len(mcp_rewards.SEEN) == 4
    for conversation in mcp_rewards.SEEN:
        call, answer = conversation[:2]
        assert call["tool_calls"][0]["function"]["name"] == "secret"
        assert answer == {"role": "tool", "name": "secret", "content": "the secret is 42",
                          "tool_call_id": call["tool_calls"][0]["id"]}
    assert log.read_text().count("call secret") == 4
    pids = started(log)
    assert len(pids) == 2 and not any(alive(p) for p in pids)  # preflight's listing, then the run's: both stopped
