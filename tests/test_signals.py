"""Ctrl-C and SIGTERM during a run: the first says at once what happens (even while a reward function hangs), the
second stops at once without saving, and a process that inherited SIGINT ignored keeps ignoring it (SIGTERM still
stops it). Every test sets SIGINT's handling itself, so none depends on how pytest was started (a background job
of a non-interactive shell starts it with SIGINT ignored)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from logitless.trainer import checkpoint as ckpt
from logitless.trainer import loop as loop_mod
from tests.conftest import sigint_handler, start_with_sigint, subprocess_env
from tests.test_cli import _config, tiny_folder  # noqa: F401  (fixture)
from tests.test_rundir import _e2e_cfg, _tiny_train, tok  # noqa: F401  (fixture)

HANGING_REWARD = """
import pathlib, time

def hang(prompts, completions, **fields):
    pathlib.Path({marker!r}).write_text("scoring")
    while True:  # a retry loop that swallows every exception, the stop's too
        try:
            time.sleep(600)
        except BaseException:
            pass
"""
SIGNALLED_REWARD = """
import os, signal, time

def hang(prompts, completions, **fields):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while it hangs (reward.timeout_s: 300 s)
    time.sleep(600)
"""
SAID_WITHIN = 15.0  # seconds a loaded machine may take to show a line or end the process


def _lines(stream) -> queue.Queue:
    """The lines of `stream`, read on a thread (None at its end)."""
    q: queue.Queue = queue.Queue()

    def read():
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _wait_for(q: queue.Queue, needle: str, seen: list[str]) -> str:
    deadline = time.monotonic() + SAID_WITHIN
    while True:
        line = q.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert line is not None, "\n".join(seen)
        seen.append(line)
        if needle in line:
            return line


def test_ctrl_c_while_a_reward_swallows_every_exception_still_ends_the_run(tmp_path, tiny_folder):
    """The first Ctrl-C says at once what it does and interrupts the reward; one that swallows the interrupt ends the
    process GRACE_S seconds later with 130 (it used to print "stopping" and hang until killed)."""
    from logitless.trainer.signals import GRACE_S

    marker = tmp_path / "in_reward"
    (tmp_path / "hung_rewards.py").write_text(HANGING_REWARD.format(marker=str(marker)))
    cfg_path = _config(tmp_path, tiny_folder, max_steps=5)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["reward"] = {"reward_funcs": ["numeric_answer", "hung_rewards:hang"]}  # reward.timeout_s: 300 s, not reached
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = subprocess_env(OMP_NUM_THREADS="1")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    proc = start_with_sigint([sys.executable, "-m", "logitless", "train", str(cfg_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, seen = _lines(proc.stdout), []
    try:
        deadline = time.monotonic() + 120
        while not marker.is_file() and proc.poll() is None:
            assert time.monotonic() < deadline, "the reward was not called in time"
            time.sleep(0.05)  # polling for the reward phase of step 1, not synchronization
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        first = _wait_for(lines, "Ctrl-C", seen)
        assert first.startswith("Ctrl-C: stopping. Step 1 has not begun its update, so it is dropped: nothing was "
                                "trained, no checkpoint is saved and there is nothing to resume; start again with "
                                "the same command"), first
        assert first.endswith("Ctrl-C again stops at once, without saving.")
        assert proc.wait(timeout=GRACE_S + SAID_WITHIN) == 130
        assert GRACE_S <= time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    while (line := lines.get(timeout=SAID_WITHIN)) is not None:
        seen.append(line)
    out = "\n".join(seen)
    assert (f"Ctrl-C: the reward function 'hang' still running {GRACE_S:.0f} s after it was interrupted (it catches "
            "the interrupt); exiting") in out, out
    assert "--resume" not in out and "Traceback" not in out, out
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() and not [p for p in run.iterdir() if p.name.startswith(".tmp")]


def test_ctrl_c_while_a_reward_hangs_stops_at_once_with_130(tmp_path, tok, capfd, monkeypatch):
    """The first signal interrupts a hung reward call (one process): step 1 is dropped and the run ends with 130 at
    once, not after reward.timeout_s with 1."""
    (tmp_path / "signalled_rewards.py").write_text(SIGNALLED_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    t0 = time.monotonic()
    with sigint_handler(signal.default_int_handler):
        result = _tiny_train(_e2e_cfg(tmp_path / "run", "reward.reward_funcs=[numeric_answer, signalled_rewards:hang]"),
                             tok)
    assert result.interrupted == signal.SIGINT and result.exit_code == 130 and result.step == 0
    assert time.monotonic() - t0 < SAID_WITHIN
    err = capfd.readouterr().err
    assert "Ctrl-C: stopping. Step 1 has not begun its update, so it is dropped" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def _kill_at(*when: tuple[str, int, int]):
    """A hook sending signal s to this process at (event, step, s)."""
    def hook(event, step):
        for e, at, s in when:
            if (event, step) == (e, at):
                os.kill(os.getpid(), s)
    return hook


def test_a_second_signal_stops_at_once_without_saving(tmp_path, tok, capfd):
    from logitless.trainer.signals import StopNow

    run = tmp_path / "run"
    hook = _kill_at(("after_update", 1, signal.SIGINT), ("after_update", 1, signal.SIGINT))
    with sigint_handler(signal.default_int_handler), pytest.raises(StopNow) as e:
        _tiny_train(_e2e_cfg(run, "train.max_steps=3", "checkpoint.save_steps=0"), tok, hook=hook)
    assert e.value.exit_code == 130
    err = capfd.readouterr().err
    assert "Ctrl-C: stopping after step 1: its update finishes, then a checkpoint of step 1 is saved" in err
    assert ("Ctrl-C again: stopping now, without saving; no checkpoint was saved, so there is nothing to resume: "
            "start again with the same command") in err
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()  # step 1 not logged, no debris
    for t in threading.enumerate():  # the forced exit for a stuck unwinding is called off once train() returned
        if t.name == "logitless-stop":
            t.join(timeout=SAID_WITHIN)
            assert not t.is_alive()


def test_ctrl_c_before_training_starts_stops_at_once(tmp_path, tok, capfd, monkeypatch):
    from logitless.trainer.signals import StopNow

    real = loop_mod.build_context

    def interrupted_load(*args, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C came while the model loads
        return real(*args, **kw)

    monkeypatch.setattr(loop_mod, "build_context", interrupted_load)
    with sigint_handler(signal.default_int_handler), pytest.raises(StopNow):
        _tiny_train(_e2e_cfg(tmp_path / "run"), tok)
    err = capfd.readouterr().err
    assert ("Ctrl-C: stopping now, without saving (training had not started); no checkpoint was saved, so there is "
            "nothing to resume: start again with the same command") in err


def test_inherited_ignored_sigint_is_kept_and_sigterm_still_stops(tmp_path, tok, capfd):
    hook = _kill_at(("after_update", 1, signal.SIGINT), ("after_update", 2, signal.SIGTERM))
    with sigint_handler(signal.SIG_IGN):  # as a background job of a non-interactive shell starts
        result = _tiny_train(_e2e_cfg(tmp_path / "run", "train.max_steps=4"), tok, hook=hook)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert result.interrupted == signal.SIGTERM and result.step == 2 and result.exit_code == 143
    assert ckpt.read_latest(tmp_path / "run" / "checkpoints").name == "step-000002"
    err = capfd.readouterr().err
    assert f"this process ignores Ctrl-C (SIGINT was ignored when it started, as for a background job); stop it " \
           f"with SIGTERM: kill {os.getpid()}" in err
    assert "Ctrl-C:" not in err and "SIGTERM: stopping after step 2" in err


def test_a_stop_that_arrives_inside_a_finalizer_is_raised_after_it(capfd):
    """A signal handled while a `__del__` runs (a garbage collection can run one anywhere) raises its StopNow once
    the finalizer has returned: raised inside it, Python prints "Exception ignored" and drops the stop."""
    from logitless.trainer.signals import StopNow, StopSignals

    finished = []

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecodes, inside this finalizer
            total = 0
            for i in range(10_000):
                total += i
            finished.append(total)

    with StopSignals(), pytest.raises(StopNow) as stop:  # before the first step: the first signal stops at once
        Finalized()  # (no reference kept: its finalizer runs here)
        time.sleep(5)  # the stop ends this wait
    assert stop.value.signum == signal.SIGTERM and finished == [sum(range(10_000))]
    err = capfd.readouterr().err
    assert "SIGTERM: stopping now, without saving (training had not started)" in err
    assert "Exception ignored" not in err and "Traceback" not in err
