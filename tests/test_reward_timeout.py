"""reward.timeout_s: a reward function call that hangs or runs too long is stopped, and its samples are handled by
reward.on_error; the built-ins, which bound their own time, are not limited."""

from __future__ import annotations

import math
import signal
import threading
import time

import pytest

from logitless.rewards import RewardFunctionError, get_reward_fn, score_completions
from logitless.trainer.config.schema import ConfigError, load_train_config
from tests.test_rundir import _e2e_cfg, _tiny_train, tok  # noqa: F401  (fixture)

PROMPTS = ["1 + 1 ="] * 4
COMPLETIONS = ["1", "2", "3", "4"]
ROWS = [{"answer": "2"}] * 4
LIMIT = 0.3  # seconds
SLACK = 10.0  # what a loaded test machine may add to LIMIT before the call is back


class Hang:
    """A reward function (1.0 per sample) that hangs on calls holding a completion in `on`: it sleeps, spins, or
    sleeps in a loop that swallows every Exception. Records each call's completions and how many calls ended."""

    def __init__(self, how: str = "sleep", on: tuple[str, ...] = tuple(COMPLETIONS), batch_error: bool = False):
        self.how, self.on, self.batch_error = how, on, batch_error
        self.calls: list[list[str]] = []
        self.ended = 0
        self.__name__ = "hang"

    def __call__(self, prompts, completions, **fields):
        self.calls.append(list(completions))
        try:
            if self.batch_error and len(completions) > 1:
                raise ValueError("batch call fails")
            if any(c in self.on for c in completions):
                if self.how == "sleep":
                    time.sleep(600)
                elif self.how == "spin":
                    while True:
                        pass
                elif self.how == "swallow":
                    while True:
                        try:
                            time.sleep(600)
                        except Exception:  # the common `except Exception` of reward code does not catch the stop
                            pass
            return [1.0] * len(completions)
        finally:
            self.ended += 1


def _score(fns, **kw):
    return score_completions(fns, None, PROMPTS, COMPLETIONS, ROWS, **kw)


@pytest.mark.parametrize("how", ["sleep", "spin", "swallow"])
def test_a_hung_call_is_stopped_and_named_with_the_setting(how):
    fn = Hang(how)
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError) as e:
        _score(["numeric_answer", fn], timeout_s=LIMIT)
    assert LIMIT <= time.monotonic() - t0 < LIMIT + SLACK
    msg = str(e.value)
    assert "reward function 'hang' did not return within reward.timeout_s=0.3 s on a batch of 4 completions" in msg
    assert "it was stopped" in msg and "reward.on_error=penalty" in msg and "raise reward.timeout_s" in msg
    assert fn.calls == [COMPLETIONS]  # one batch call, no per-sample re-runs of a hanging function
    assert fn.ended == 1  # stopped, its finally block ran: nothing is left running


SWALLOWS_EVERYTHING = """
import time
from logitless.rewards import score_completions

def hang(prompts, completions, **fields):
    while True:  # a retry loop that swallows every exception, the stop's too
        try:
            time.sleep(600)
        except BaseException:
            pass

score_completions([hang], None, ["1 + 1 ="], ["2"], [{}], on_error="penalty", timeout_s=0.3)
print("returned")
"""


def test_a_call_that_swallows_the_stop_ends_the_process_naming_it():
    """Python cannot stop a thread: a reward that catches BaseException and never returns ends the process (exit 1,
    its stack printed) GIVE_UP_S seconds after its deadline, even under on_error=penalty; it used to hang."""
    import subprocess
    import sys

    from logitless.rewards.deadline import GIVE_UP_S
    from tests.conftest import subprocess_env

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SWALLOWS_EVERYTHING], env=subprocess_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode == 1 and "returned" not in proc.stdout, proc.stderr
    assert ("error: reward function 'hang' did not return within reward.timeout_s=0.3 s and was still running 5 s "
            "after it was stopped: it catches the stop") in proc.stderr, proc.stderr
    assert "catch Exception, not BaseException" in proc.stderr and ", in hang\n" in proc.stderr  # its stack
    assert LIMIT + GIVE_UP_S <= seconds < LIMIT + GIVE_UP_S + 60  # (most of the slack: the child's imports)


def test_under_penalty_the_samples_of_a_timed_out_call_score_the_penalty_as_errors():
    fn = Hang()
    scores = _score(["numeric_answer", fn], on_error="penalty", penalty=-1.0, timeout_s=LIMIT)
    assert scores.rewards[:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]  # the built-in is scored as usual
    assert scores.rewards[:, 1].tolist() == [-1.0] * 4
    assert scores.num_errors == [0, 4] and scores.error_texts[0] is None
    assert "did not return within reward.timeout_s=0.3 s" in scores.error_texts[1]
    assert scores.total.tolist() == [-1.0, 0.0, -1.0, -1.0]


def test_a_re_run_that_hangs_fails_it_and_the_samples_after_it_without_calling_them():
    fn = Hang(on=("3",), batch_error=True)  # the batch raises; sample 2 ("3") alone hangs
    scores = _score([fn], on_error="penalty", penalty=-1.0, timeout_s=LIMIT)
    assert scores.rewards[:, 0].tolist() == [1.0, 1.0, -1.0, -1.0] and scores.num_errors == [2]
    assert fn.calls == [COMPLETIONS, ["1"], ["2"], ["3"]]  # sample 3 ("4") is not called after the hang
    assert "on sample 2 alone" in scores.error_texts[0]
    with pytest.raises(RewardFunctionError, match=r"within reward.timeout_s=0.3 s on sample 2 alone .*batch call had "
                                                  r"raised ValueError: batch call fails"):
        _score([Hang(on=("3",), batch_error=True)], timeout_s=LIMIT)


def test_a_function_within_its_limit_is_called_once_on_the_batch():
    fn = Hang(on=())
    scores = _score([fn], timeout_s=30.0)
    assert fn.calls == [COMPLETIONS] and fn.ended == 1 and scores.rewards[:, 0].tolist() == [1.0] * 4


def test_signal_alarm_timeouts_inside_a_reward_keep_working():
    """Reward code often bounds its own parsing with signal.alarm (math_verify's parse/verify do, and refuse to run
    on any other thread); under reward.timeout_s it still runs on the main thread, so that keeps working."""

    def alarmed(prompts, completions, **fields):
        previous = signal.signal(signal.SIGALRM, lambda *a: None)  # ValueError off the main thread
        signal.alarm(30)
        try:
            return [float(c == "2") for c in completions]
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    assert _score([alarmed], timeout_s=30.0).rewards[:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_off_the_main_thread_the_call_is_abandoned_at_the_limit():
    release = threading.Event()

    def blocked(prompts, completions, **fields):
        release.wait(600)
        return [0.0] * len(completions)

    out: dict = {}

    def score():
        t0 = time.monotonic()
        out["scores"] = _score([blocked], on_error="penalty", penalty=-2.0, timeout_s=LIMIT)
        out["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(LIMIT + SLACK)
    release.set()  # let the abandoned call end
    assert not worker.is_alive() and LIMIT <= out["seconds"] < LIMIT + SLACK
    scores = out["scores"]
    assert scores.rewards[:, 0].tolist() == [-2.0] * 4 and scores.num_errors == [4]
    assert "its thread was left running" in scores.error_texts[0]


def test_the_builtins_bound_their_own_time_and_are_not_limited():
    from logitless.rewards.scoring import bounds_own_time

    assert bounds_own_time(get_reward_fn("numeric_answer"))
    assert bounds_own_time(get_reward_fn("math_verify", timeout_seconds=1))  # options bound: a partial
    assert not bounds_own_time(Hang())
    scores = _score(["numeric_answer"], timeout_s=1e-9)  # a limit no call could meet
    assert scores.rewards[:, 0].tolist() == [0.0, 1.0, 0.0, 0.0] and scores.num_errors == [0]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        _score(["numeric_answer"], timeout_s=0)


def test_config_default_and_bounds():
    assert load_train_config().reward.timeout_s == 300.0
    assert load_train_config(None, ["reward.timeout_s=null"]).reward.timeout_s is None
    with pytest.raises(ConfigError, match=r"reward.timeout_s must be > 0, got 0"):
        load_train_config(None, ["reward.timeout_s=0"])


# ---- in a training run


HANGING_REWARD = '''
import time

def hang(prompts, completions, **fields):
    time.sleep(600)
'''


def test_a_training_step_with_a_hanging_reward_scores_the_penalty_and_goes_on(tmp_path, monkeypatch, capsys, tok):
    (tmp_path / "hanging_rewards.py").write_text(HANGING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _e2e_cfg(tmp_path / "run", "train.max_steps=1", "reward.reward_funcs=[numeric_answer, hanging_rewards:hang]",
                   "reward.on_error=penalty", "reward.error_penalty=-1.0", f"reward.timeout_s={LIMIT}")
    result = _tiny_train(cfg, tok)
    assert result.step == 1 and result.records[0]["reward/hang/errors"] == 8
    err = capsys.readouterr().err
    assert "reward function 'hang' failed on 8 of 8 samples" in err and "reward.timeout_s=0.3" in err
    assert not math.isnan(result.records[0]["reward/mean"])
