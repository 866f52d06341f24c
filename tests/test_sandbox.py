"""The code_tests reward and its sandbox, against programs that try to escape or fake a pass.

Each adversarial program attempts its attack and records whether it worked; its tests assert that the attack
worked, so they really pass only if the sandbox failed. Every case must score 0, leave this process and the
host files alone, and the same pool must still score a correct program afterwards.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from logitless.rewards import get_reward_fn, score_completions
from logitless.rewards.code import code_tests, extract_program
from logitless.rewards.sandbox import WORKER, SandboxOptions, SandboxPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
SECRET_ENV = "LOGITLESS_TEST_PARENT_SECRET"
GOOD = ("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])


@pytest.fixture(scope="module", params=[True, False], ids=["namespaces", "no_namespaces"])
def pool(request):
    """Each attack runs with the kernel namespaces and without them (what a kernel or container that does not
    permit user namespaces gets): the other layers must hold on their own."""
    os.environ[SECRET_ENV] = "s3cret-value"  # in the training process's environment when the workers start
    p = SandboxPool(SandboxOptions(timeout_seconds=1.5, memory_mb=256, output_kb=64), num_workers=2,
                    namespaces=request.param)
    p.run([GOOD])
    if not request.param:
        assert "net_namespace" not in p.features and "pid_namespace" not in p.features
    yield p
    p.close()
    os.environ.pop(SECRET_ENV, None)


def _attack(body: str) -> str:
    """A program that runs `body` (which sets `worked = True` on success), swallowing any error."""
    indented = "\n".join("    " + line for line in body.strip().splitlines())
    return f"worked = False\ntry:\n{indented}\nexcept BaseException:\n    pass\n"


def _check_unharmed(pool: SandboxPool) -> None:
    assert os.path.exists(WORKER)
    (good,) = pool.run([GOOD])
    assert good.passed == [True, True], good


def test_correct_partial_and_broken_programs(pool):
    results = pool.run([
        GOOD,
        ("def add(a, b):\n    return a * b\n", ["assert add(2, 2) == 4", "assert add(1, 2) == 3"]),
        ("def add(a, b) return", ["assert True"]),  # syntax error
        ("raise ValueError('boom')", ["assert True"]),  # a program that raises passes nothing
        (GOOD[0], ["assert add(1, 2) == 3", "syntax error here"]),  # a test that does not compile fails alone
    ])
    assert [r.passed for r in results] == [[True, True], [True, False], [False], [False], [True, False]]


@pytest.mark.parametrize("body", [
    "while True:\n    pass",
    "import time\ntime.sleep(60)",
])
def test_infinite_loop_times_out(pool, body):
    t0 = time.monotonic()
    (r,) = pool.run([(body, ["assert True"])])
    assert r.passed == [False] and r.status == "timeout"
    assert time.monotonic() - t0 < 5.0
    _check_unharmed(pool)


def test_tests_before_a_hanging_test_keep_their_credit(pool):
    program = "def f(x):\n    if x == 0:\n        while True:\n            pass\n    return x\n"
    (r,) = pool.run([(program, ["assert f(1) == 1", "assert f(0) == 0", "assert f(2) == 2"])])
    assert r.passed == [True, False, False] and r.status == "timeout"


ATTACKS = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n    worked = True",
    "subprocess": "import subprocess\nsubprocess.run(['true'])\nworked = True",
    "posixsubprocess": "import _posixsubprocess\nworked = True",
    "thread": "import threading\nthreading.Thread(target=print).start()\nworked = True",
    "alloc_10gb": "x = bytearray(10 * 1024 ** 3)\nworked = True",
    "network": "import socket\ns = socket.create_connection(('127.0.0.1', PORT), timeout=0.5)\ns.sendall(b'x')\n"
               "worked = True",
    "env_own": f"import os\nworked = os.environ.get('{SECRET_ENV}') is not None",
    "env_proc": "import os\nfor p in os.listdir('/proc'):\n    try:\n"
                f"        worked = worked or b'{SECRET_ENV}' in open('/proc/' + p + '/environ', 'rb').read()\n"
                "    except Exception:\n        pass",
    "kill_parent": "import os, signal\nos.kill(HOST_PID, signal.SIGKILL)\nworked = True",
    "kill_worker": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nworked = True",
    "write_outside_tmp": "open('OUTSIDE_TMP', 'w').write('x')\nworked = True",
    "write_outside_host": "open('OUTSIDE_HOST', 'w').write('x')\nworked = True",
    "write_parent_dir": "import os\nos.makedirs('../../escape', exist_ok=True)\nworked = True",
    "delete_worker_file": "import os\nos.remove('WORKER_PATH')\nworked = True",
    "frames": "import sys\ntry:\n    1 / 0\nexcept ZeroDivisionError as e:\n"
              "    f = e.__traceback__.tb_frame.f_back\nworked = True",
    "getframe": "import sys\nsys._getframe(1)\nworked = True",
    "ctypes": "import ctypes\nworked = True",
    "gc_objects": "import gc\ngc.get_objects()\nworked = True",
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_zero_and_leaves_host_unharmed(pool, name, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    outside_tmp = f"/tmp/logitless-sandbox-escape-{os.getpid()}-{name}"
    outside_host = tmp_path / "escape.txt"
    body = (ATTACKS[name].replace("PORT", str(listener.getsockname()[1])).replace("HOST_PID", str(os.getpid()))
            .replace("OUTSIDE_TMP", outside_tmp).replace("OUTSIDE_HOST", str(outside_host))
            .replace("WORKER_PATH", str(WORKER)))
    try:
        (r,) = pool.run([(_attack(body), ["assert worked"])])
        assert r.passed == [False], (name, r)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected to the host
    finally:
        listener.close()
    assert not os.path.exists(outside_tmp) and not outside_host.exists()
    _check_unharmed(pool)


@pytest.mark.parametrize("program", [
    "def f():\n    return 1\nimport sys\nsys.exit(0)",
    "def f():\n    return 1\nimport os\nos._exit(0)",
    "def f():\n    return 1\nraise SystemExit(0)",
])
def test_exit_before_the_tests_passes_nothing(pool, program):
    (r,) = pool.run([(program, ["assert f() == 2", "assert False"])])
    assert r.passed == [False, False]
    _check_unharmed(pool)


@pytest.mark.parametrize("program", [
    "class AssertionError(Exception):\n    pass\nimport builtins\nbuiltins.AssertionError = AssertionError",
    "import builtins\nbuiltins.len = lambda x: 3\nbuiltins.isinstance = lambda *a: True",
    "import builtins\nclass Yes:\n    def __eq__(self, o): return True\nbuiltins.sorted = lambda x: Yes()",
    # a finalizer or a timer that patches builtins while the tests run
    "import builtins\nclass Patch:\n    def __del__(self):\n        builtins.len = lambda x: 3\n"
    "a = Patch(); b = [a]; a.cycle = b; del a, b",
    "import builtins, signal\nsignal.signal(signal.SIGALRM, lambda *a: setattr(builtins, 'len', lambda x: 3))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)",
    "import sys, builtins\nsys.settrace(lambda *a: setattr(builtins, 'len', lambda x: 3))",
    # forging the report line without the per-job secret
    "import os\nfor fd in range(3, 1024):\n    try:\n        os.write(fd, b'0' * 32 + b' 0\\n0 1\\n')\n"
    "    except OSError:\n        pass",
])
def test_faked_passes_do_not_count(pool, program):
    tests = ["x = [0] * 5\nassert len(x) == 3", "assert 1 == 2", "assert sorted([2, 1]) == 'no'",
             "assert isinstance(1, str)"]
    (r,) = pool.run([(program, tests)])
    assert r.passed == [False] * 4, r
    _check_unharmed(pool)


def test_deleting_files_in_the_work_dir_does_not_break_the_next_batch(pool):
    program = "import os, shutil\nfor p in os.listdir('.'):\n    os.remove(p)\nos.chdir('..')\n"
    (r,) = pool.run([(_attack(program), ["assert worked", "assert False"])])
    assert r.passed == [False, False]
    _check_unharmed(pool)


def test_megabytes_of_output_stay_out_of_the_trainer(pool, capfd):
    program = "import os, sys\nfor _ in range(50):\n    print('x' * 100_000)\n    sys.stderr.write('y' * 100_000)\n"
    t0 = time.monotonic()
    results = pool.run([(program, ["assert True"]), (_attack(program), ["assert True", "assert worked"])])
    assert time.monotonic() - t0 < 5.0
    assert results[0].passed == [False]  # writing past the 64 KiB cap raises
    assert results[1].passed == [True, False]  # the error swallowed: a plain test still really passes
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "yyyy" not in err
    _check_unharmed(pool)


def test_a_killed_worker_is_replaced(pool):
    for w in pool._workers:
        if w is not None:
            w.proc.kill()
            w.proc.wait()
    _check_unharmed(pool)


def test_extract_program():
    assert extract_program("text\n```python\na = 1\n```\nmore\n```py\nb = 2\n```\nend") == "b = 2\n"
    assert extract_program("```\nc = 3\n```") == "c = 3\n"
    assert extract_program("no fences: d = 4") == "no fences: d = 4"


def test_code_tests_reward(monkeypatch):
    completions = [
        "Here:\n```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",
        "def add(a, b): return a + b",
        "anything",
    ]
    tests = [["assert add(1, 2) == 3", "assert add(2, 2) == 4"], ["assert add(1, 1) == 2", "assert add(2, 0) == 2"],
             "assert add(1, 2) == 3\nassert add(0, 0) == 0", None]
    got = code_tests(["p"] * 4, completions, tests=tests, timeout_seconds=2.0, num_workers=2)
    assert got == [1.0, 0.5, 1.0, None]
    strict = get_reward_fn("code_tests", all_or_nothing=True, timeout_seconds=2.0, num_workers=2)
    assert strict(["p"] * 4, completions, tests=tests) == [1.0, 0.0, 1.0, None]
    rows = [{"tests": t} for t in tests]
    scores = score_completions(["code_tests"], None, ["p"] * 4, completions, rows)
    assert scores.rewards[:, 0].tolist()[:3] == [1.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="needs a 'tests' row field"):
        code_tests(["p"], ["x"], answer=["1"])
    with pytest.raises(ValueError, match="row 0 has tests of type int"):
        code_tests(["p"], ["x"], tests=[3])


def test_options_are_validated():
    with pytest.raises(ValueError, match="reward.reward_options.code_tests: sandbox timeout_seconds"):
        get_reward_fn("code_tests", timeout_seconds=-1)
    with pytest.raises(ValueError, match="code_tests.num_workers must be a positive int"):
        get_reward_fn("code_tests", num_workers=0)
    with pytest.raises(ValueError, match="timeout_seconds"):
        SandboxOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="memory_mb=16 is too small"):
        SandboxOptions(memory_mb=16)
    with pytest.raises(ValueError, match="num_workers"):
        SandboxPool(num_workers=0)


def test_throughput_of_trivial_completions(pool):
    jobs = [("def f(x):\n    return x + 1\n", ["assert f(1) == 2"])] * 200
    pool.run(jobs[:4])  # workers warm
    t0 = time.perf_counter()
    results = pool.run(jobs)
    rate = len(jobs) / (time.perf_counter() - t0)
    assert all(r.passed == [True] for r in results)
    assert rate > 50, f"{rate:.0f} completions/s"  # >= 200/s on an idle 2-core machine (bench/bench_sandbox.py)
