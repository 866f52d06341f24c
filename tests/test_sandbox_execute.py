"""SandboxPool.execute: programs run once, top to bottom, under the confinement of code_tests, for a Python tool."""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from logitless.rewards.sandbox import ExecResult, SandboxOptions, SandboxPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
OUTPUT_KB = 16


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(SandboxOptions(timeout_seconds=2.0, memory_mb=256, output_kb=OUTPUT_KB), num_workers=2)
    yield p
    p.close()


def test_output_and_outcomes(pool):
    programs = [
        "print('hello')\nprint(1 + 1)\nimport sys\nprint('to stderr', file=sys.stderr)",
        "print('before')\nraise ValueError('boom')",
        "def f(:\n    pass",
        "import sys\nprint('bye')\nsys.exit(0)",
        "try:\n    int('x')\nexcept ValueError:\n    raise KeyError('y')",
        "import sys\nsys.exit(2)",
        "if __name__ == '__main__':\n    print('main')",
        "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')",
        "import os\nos.abort()",
    ]
    results = pool.execute(programs)
    assert results[0] == ExecResult("ok", "hello\n2\nto stderr\n", "")
    assert results[1] == ExecResult("error", "before\n", "ValueError: boom")
    assert results[2].status == "error" and results[2].error.endswith("SyntaxError: invalid syntax"), results[2]
    assert '"<program>", line 1' in results[2].error
    assert results[3] == ExecResult("ok", "bye\n", "")
    assert results[4] == ExecResult("error", "", "KeyError: 'y'")  # raised while handling another exception
    assert results[5] == ExecResult("error", "", "SystemExit: 2")
    assert results[6] == ExecResult("ok", "main\n", "")
    assert results[7] == ExecResult("ok", "\ufffd\ufffd ok\n", "")
    assert results[8] == ExecResult("crashed", "", "killed by SIGABRT")
    assert pool.execute([]) == []


def test_limits(pool):
    t0 = time.monotonic()
    timeout, memory, flood = pool.execute([
        # what was printed before the timeout is kept; the program idles, so the wall clock, not the CPU limit
        # (which a busy loop on a loaded machine can reach first, `test_cpu_limit`), ends it
        "print('started', flush=False)\nimport time\ntime.sleep(60)",
        "print('allocating')\nx = bytearray(10 ** 10)",
        "while True:\n    print('x' * 1000)",
    ])
    assert time.monotonic() - t0 < 8.0
    assert timeout == ExecResult("timeout", "started\n", "timed out after 2 s")
    assert memory == ExecResult("memory", "allocating\n", "MemoryError")
    assert flood.status == "output_limit" and len(flood.stdout) == OUTPUT_KB * 1024
    assert set(flood.stdout) == {"x", "\n"} and flood.error == f"output over {OUTPUT_KB} KiB, cut"


def test_cpu_limit():
    p = SandboxOptions(timeout_seconds=30.0, cpu_seconds=1)
    pool = SandboxPool(p, num_workers=1)
    try:
        (r,) = pool.execute(["while True:\n    pass"])
    finally:
        pool.close()
    assert r == ExecResult("timeout", "", "CPU time limit of 1 s exceeded")


def test_confinement(pool, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    outside = tmp_path / "escape.txt"
    try:
        network, write, proc, fresh_dir, temp = pool.execute([
            f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=0.5)",
            f"open({str(outside)!r}, 'w').write('x')",
            f"print(open('/proc/{os.getpid()}/cmdline', 'rb').read())",
            "import os\nprint(sorted(os.listdir('.')))\nopen('left.txt', 'w').write('x')",
            "import tempfile, os\nwith tempfile.NamedTemporaryFile('w') as f:\n    f.write('x')\n"
            "    print(os.path.dirname(f.name) == os.getcwd())",
        ])
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert network.status == "error", network  # sockets refused; here `socket` may not even be importable
    assert write.status == "error" and not outside.exists(), write
    assert proc.status == "error" and proc.stdout == "", proc
    assert fresh_dir == ExecResult("ok", "['output.txt']\n", "")
    assert pool.execute(["import os\nprint(sorted(os.listdir('.')))"])[0].stdout == "['output.txt']\n"
    assert temp == ExecResult("ok", "True\n", "")


def test_concurrent_callers_share_the_pool(pool):
    """Callers in several threads (the tools of several episodes) each get their own results, in order, while
    reward jobs run beside them."""
    def call(k: int) -> list[ExecResult]:
        return pool.execute([f"print({k} * {i})" for i in range(3)] + [f"raise KeyError({k})"])

    with ThreadPoolExecutor(8) as ex:
        scores = ex.submit(pool.run, [("def f():\n    return 1\n", ["assert f() == 1"])] * 20)
        results = list(ex.map(call, range(16)))
    for k, rs in enumerate(results):
        assert [r.stdout for r in rs[:3]] == [f"{k * i}\n" for i in range(3)]
        assert rs[3] == ExecResult("error", "", f"KeyError: {k}")
    assert all(r.passed == [True] for r in scores.result())


def test_bad_input_and_a_closed_pool_restarts():
    p = SandboxPool(SandboxOptions(timeout_seconds=2.0), num_workers=1)
    with pytest.raises(TypeError, match="list of program sources"):
        p.execute("print(1)")
    assert p.execute(["print(1)"]) == [ExecResult("ok", "1\n", "")]
    p.close()
    assert p.execute(["print(2)"]) == [ExecResult("ok", "2\n", "")]  # used again: workers start again
    threads, procs = list(p._threads), [w.proc for w in p._workers if w is not None]
    p.close()
    assert threads and not any(t.is_alive() for t in threads)
    assert procs and all(proc.poll() is not None for proc in procs)


def test_the_kernel_keeps_the_file_system_read_only_and_proc_hidden(pool, tmp_path):
    """Beneath the audit hook (which a program could bypass only through a CPython memory bug): in the worker's
    mount namespace every mount is read-only, /proc and /tmp are empty, the work directory is writable."""
    pool.execute(["pass"])
    if not {"mount_namespace", "read_only_root"} <= set(pool.features):
        pytest.skip(f"this kernel granted {pool.features}")
    (r,) = pool.execute([
        "import os\n"
        "print(bool(os.statvfs('/usr').f_flag & os.ST_RDONLY), bool(os.statvfs('.').f_flag & os.ST_RDONLY))\n"
        f"print(os.path.exists('/proc/self'), os.path.exists({str(tmp_path)!r}), os.path.exists('/tmp'))"
    ])
    visible = not os.path.realpath(tmp_path).startswith("/tmp/")  # pytest's tmp_path is usually below /tmp
    assert r.status == "ok", r
    assert r.stdout.splitlines() == ["True False", f"False {visible} True"]


REFUSED = {  # operation -> the exception a program sees
    "import sys\nsys.settrace(lambda *a: None)": "PermissionError",
    "import sys\nsys.setprofile(lambda *a: None)": "PermissionError",
    "import sys\nsys._getframe()": "ValueError",
    "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame": "AttributeError",
    "def g():\n    yield\ng().gi_frame": "AttributeError",
    "(lambda: 0).__code__.replace(co_name='x')": "PermissionError",
    "import marshal\nmarshal.loads(marshal.dumps(compile('1', 'x', 'eval')))": "PermissionError",
    "import gc": "PermissionError",
    "import ctypes": "PermissionError",
    "import signal\nsignal.signal(signal.SIGUSR1, print)": "AttributeError",
    "import os\nos.chdir('/')": "PermissionError",
    "import os\nos.mkfifo('fifo')": "AttributeError",
    "import os\nos.open('/', os.O_RDONLY)": "PermissionError",
    # RLIMIT_NPROC 0 (Python audits thread creation only from 3.13)
    "import threading\nthreading.Thread(target=print).start()": ("PermissionError", "RuntimeError"),
}


def test_refused_operations(pool):
    results = pool.execute(list(REFUSED))
    for (program, errors), r in zip(REFUSED.items(), results):
        errors = (errors,) if isinstance(errors, str) else errors
        assert r.status == "error" and r.error.startswith(tuple(e + ": " for e in errors)), (program, r)
