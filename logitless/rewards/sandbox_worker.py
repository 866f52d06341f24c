"""Sandbox worker: a pre-warmed interpreter that runs untrusted programs, with or without tests, one job at a time.

Started as `python -I -S -B sandbox_worker.py [FEATURE ...]` with an empty environment, by `sandbox_setup.py` once
it has entered the namespaces (the features it names) or directly without them. It uses the standard library
only and never loads `ctypes`. Protocol on stdin/stdout: 4-byte big-endian length + JSON.
    job    {"program": str, "tests": [str] | null, "timeout": s, "cpu": s, "memory_mb": n, "output_kb": n, "files": n}
    reply  with tests: {"passed": [test indices], "status": "ok" | "timeout" | "killed"}
           tests null: {"status": "ok" | "error" | "timeout" | "memory" | "output_limit" | "crashed",
                        "stdout": str, "error": str}

Per job the worker forks one child (the only process that runs untrusted code) in a fresh work directory and
draws a random 128-bit token per test. The child confines itself (descriptors, resource limits, audit hook), then
runs the program and each test from a harness frame that writes a test's token to the report pipe when the test
raised nothing; the worker counts a test as passed only if its token arrives. Untrusted code cannot reach that
frame: no frame object can be obtained (the audit hook refuses every way to one, and the worker removes the only
function that installs a Python signal handler, which would receive the interrupted frame).
See docs/rewards.md for the threat model.
"""

import _imp
import _signal
import builtins
import io
import json
import os
import posix
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import types

NOBODY = 65534
REPORT_FD = 777  # above RLIMIT_NOFILE: a program can write to it but cannot put another file in its place
AUDIT = SNAPSHOT = None  # set by main(): sandbox_audit.py, and the state tests start from (_prepare)
UNAUDITED = ("mkfifo", "mknod")  # os functions that create files without an audit event: removed in the child
# Imported before the worker drops privileges (the interpreter's files may not be readable by nobody) and so
# that a job's imports of them cost nothing; every built-in module too (a job cannot create them afresh).
PRELOAD = (
    "abc", "array", "bisect", "cmath", "collections", "collections.abc", "copy", "dataclasses", "datetime",
    "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "io", "itertools", "json", "math",
    "numbers", "operator", "random", "re", "statistics", "string", "textwrap", "time", "typing", "unicodedata",
    "queue", "struct", "contextlib", "types", "warnings", "inspect", "traceback", "pprint", "calendar",
    "base64", "binascii", "csv", "difflib", "fnmatch", "glob", "graphlib", "zlib", "pathlib", "shlex", "threading",
)


def _load_audit():
    """sandbox_audit.py, beside this file, as a module (the worker runs without this package on its path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_audit.py")
    module = types.ModuleType("sandbox_audit")
    module.__file__ = path
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)
    return module


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _send(obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data):]


def _limit(kind, soft, hard=None):
    try:
        resource.setrlimit(kind, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass


def _confine(job, report_fd, out_fd, workdir):
    """In the job's child: work directory, stdin from /dev/null, stdout/stderr to the capped output file, every
    other descriptor closed but the report pipe (returned), resource limits, empty environment, temporary files
    in the work directory."""
    os.chdir(workdir)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    report = os.dup2(report_fd, REPORT_FD)
    os.closerange(3, report)
    os.closerange(report + 1, 65536)
    cpu = int(job["cpu"])
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_AS, int(job["memory_mb"]) << 20)
    _limit(resource.RLIMIT_FSIZE, (int(job["output_kb"]) << 10) + 1)  # one byte over the cap tells it was hit
    _limit(resource.RLIMIT_NOFILE, int(job["files"]))
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, 0)  # no new process or thread
    os.environ.clear()
    os.environ["TMPDIR"] = workdir  # tempfile's directory (the worker never asked tempfile for one)
    return report


def _prepare():
    """Once per worker, after its imports: the interpreter state every job starts from. Unbuffered stdout and
    stderr (what was printed before a timeout is kept; the worker itself writes replies with os.write), imports
    that compile sources (a path that never exists as the bytecode cache: no marshal.loads), no os function that
    creates files unaudited, no way to create fresh copies of built-in modules. Returns the snapshot that tests
    get their builtins and modules from: (builtins dict, its items, its names, {module name: (module, its dict,
    copy of its dict)}). Also: no module a job may not import loaded, every signal handled by default (SIGXFSZ
    ignored: output over the cap makes writes fail instead of killing; SIGPIPE ignored as Python has it), and no
    way left to install a Python signal handler: a handler receives the frame it interrupts, and the harness's
    frames are below every frame of untrusted code."""
    import gc

    for s in signal.valid_signals():
        if s not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(s, signal.SIG_IGN if s in (signal.SIGXFSZ, signal.SIGPIPE) else signal.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass
    install = _signal.signal  # the only function that installs Python signal handlers
    del _signal.signal
    signal.__dict__.pop("signal", None)  # the wrapper that calls it
    if [r for r in gc.get_referrers(install) if type(r) is not types.FrameType]:
        raise RuntimeError("sandbox worker: signal.signal is still reachable after its removal on this Python")
    install = None
    for name in list(sys.modules):
        if name.startswith(AUDIT.BLOCKED_MODULES):
            del sys.modules[name]
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.pycache_prefix = os.devnull + "/pycache"
    for name in UNAUDITED:
        for owner in (os, posix):
            owner.__dict__.pop(name, None)
    for name in ("create_builtin", "exec_builtin"):  # every built-in module is imported already
        _imp.__dict__.pop(name, None)
    saved = dict(builtins.__dict__)
    modules = {k: (m, m.__dict__, dict(m.__dict__)) for k, m in sys.modules.items()
               if type(m) is types.ModuleType and k not in ("__main__", "builtins")}
    return saved, tuple(saved.items()), frozenset(saved), modules


def _runner(work, snapshot):
    """The harness that runs all untrusted code (work[0] holds the codes, the tokens, the report pipe, whether the
    job has tests, and the program's namespace): codes[0], the program, in `namespace`, then, if it ran to
    completion, each test codes[k] (None: it did not compile) in a namespace of its own: the program's names but
    those of builtins, and a fresh copy of the genuine builtins whose `__import__` gives each module loaded before
    the program as it was then. For each test that raised nothing, its token goes to the report pipe; for a job
    without tests, the program's outcome. Then the process ends. Everything is bound now, before any untrusted
    code runs: these functions look up no global or builtin name, so a program cannot put its own code in the
    harness's way."""
    exec_, dict_, type_, str_, isinstance_, fmt, write = exec, dict, type, str, isinstance, \
        traceback.format_exception_only, os.write
    base, memory_error, system_exit, len_, exit_ = BaseException, MemoryError, SystemExit, len, os._exit
    bdict, real_import = builtins.__dict__, builtins.__import__
    saved, pristine, names, modules = snapshot
    known = modules.get

    def genuine_import(name, globals=None, locals=None, fromlist=(), level=0):
        result = real_import(name, globals, locals, fromlist, level)
        if level != 0 or type_(name) is not str_:
            return result
        key, first = "", None
        for part in name.split("."):
            key = key + "." + part if key else part
            entry = known(key)
            if entry is None:
                break
            entry[1].clear()
            entry[1].update(entry[2])
            first = entry[0] if first is None else first
        if fromlist:
            entry = known(name)
            return entry[0] if entry is not None else result
        return first if first is not None else result

    def outcome(e):
        if isinstance_(e, system_exit) and (e.code is None or e.code == 0):
            return b"\0ok\0"
        kind = b"\0memory\0" if isinstance_(e, memory_error) else b"\0error\0"
        try:
            e.__suppress_context__ = True  # the tracebacks of a chain would need frames, which the hook refuses
            text = "".join(fmt(type_(e), e)).strip("\n")
        except base:
            try:
                text = type_(e).__name__ + ": " + str_(e)
            except base:
                text = "the exception could not be formatted"
        try:
            return kind + text.encode("utf-8", "replace").replace(b"\0", b"")
        except base:
            return kind + b"the exception could not be formatted"

    def run():
        codes, tokens, report, has_tests, namespace = work.pop()
        count, ok, message = len_(codes), False, b"\0ok\0"
        try:
            exec_(codes[0], namespace)
            ok = True
        except base as e:
            message = None if has_tests else outcome(e)
        if not has_tests:
            try:
                write(report, message)
            except base:
                pass
            exit_(0)
        if not ok:
            exit_(0)  # the program did not run to completion: no test runs
        k = 1
        while k < count:
            ok = test = own = None
            try:
                if codes[k] is not None:
                    bdict.clear()
                    bdict.update(saved)
                    test = dict_()
                    for name, value in namespace.items():
                        if name not in names:
                            test[name] = value
                    own = dict_(pristine)
                    own["__import__"] = genuine_import
                    test["__builtins__"], test["__name__"] = own, "__main__"
                    exec_(codes[k], test)
                    ok = True
            except base:
                pass
            test = own = name = value = None
            try:
                if ok is True:
                    write(report, tokens[k - 1])
            except base:
                exit_(0)
            k += 1
        exit_(0)

    return run


def _child(job, tokens, report_fd, out_fd, workdir):
    """The job's child: confine, compile, install the audit hook, then run the program and its tests."""
    report = _confine(job, report_fd, out_fd, workdir)
    exec_mode = job["tests"] is None
    try:
        codes = [compile(job.pop("program"), "<program>", "exec")]
    except BaseException as e:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        if exec_mode:
            os.write(report, b"\0error\0" + "".join(traceback.format_exception_only(type(e), e)).strip("\n").encode(
                "utf-8", "replace").replace(b"\0", b""))
        os._exit(0)
    for i, source in enumerate(job.pop("tests") or ()):
        try:
            codes.append(compile(source, f"<test {i}>", "exec"))
        except BaseException:  # a test that does not compile fails alone
            codes.append(None)
    job.clear()
    module = types.ModuleType("__main__")  # `import __main__` in the program gives its own module
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    work = [(codes, [b"\n" + t + b"\n" for t in tokens], report, not exec_mode, module.__dict__)]
    tokens[:] = []
    codes = tokens = job = module = None
    run = _runner(work, SNAPSHOT)
    sys.addaudithook(AUDIT.audit_hook(workdir))
    run()


def _collect(read_fd, deadline, wanted):
    """Read the report pipe until the child closes it or the deadline passes. Returns (indices of the `wanted`
    lines seen, the last 64 KiB read, timed_out)."""
    seen, tail, partial = set(), b"", b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return seen, tail, True
        if not select.select([read_fd], [], [], left)[0]:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            return seen, tail, False
        tail = (tail + chunk)[-(64 << 10):]
        *lines, partial = (partial + chunk).split(b"\n")
        partial = partial[-64:]  # a token line is 32 characters
        for line in lines:
            if line in wanted:
                seen.add(wanted[line])


def _exec_reply(job, timed_out, code, tail, output):
    """The reply for a job without tests, from what the worker saw (the child's own report only says how the
    program ended; a program can forge that, but only for itself)."""
    cap = int(job["output_kb"]) << 10
    stdout = output[:cap].decode("utf-8", errors="replace")
    head, _, message = tail.rpartition(b"\0")
    kind = head.rpartition(b"\0")[2]
    message = message.decode("utf-8", errors="replace")
    if timed_out or code == -signal.SIGXCPU:
        return {"status": "timeout", "stdout": stdout, "error": f"timed out after {job['timeout']:g} s"
                if timed_out else f"CPU time limit of {job['cpu']} s exceeded"}
    if len(output) > cap:
        return {"status": "output_limit", "stdout": stdout, "error": f"output over {job['output_kb']} KiB, cut"}
    if kind in (b"memory", b"error"):
        return {"status": kind.decode(), "stdout": stdout, "error": message}
    if kind == b"ok" or code == 0:
        return {"status": "ok", "stdout": stdout, "error": ""}
    if code > 0:
        return {"status": "error", "stdout": stdout, "error": f"the program exited with status {code}"}
    return {"status": "crashed", "stdout": stdout, "error": f"killed by {signal.Signals(-code).name}"}


def _run_job(job, root):
    tests = job["tests"]
    tokens = [os.urandom(16).hex().encode() for _ in tests or ()]
    workdir = os.path.realpath(tempfile.mkdtemp(dir=root))
    out_fd = os.open(os.path.join(workdir, "output.txt"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    read_fd, write_fd = os.pipe()
    exit_ = os._exit
    deadline = time.monotonic() + float(job["timeout"])
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()  # one process group to kill
            os.close(read_fd)
            _child(job, tokens, write_fd, out_fd, workdir)
        finally:
            exit_(1)
    os.close(write_fd)
    wanted = {t: i for i, t in enumerate(tokens)}
    passed, tail, timed_out = _collect(read_fd, deadline, wanted)
    os.close(read_fd)
    try:
        os.killpg(pid, signal.SIGKILL)  # the job's whole process group
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    if os.getpid() == 1:  # PID 1 of the worker's own namespace: end anything else the job left behind
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:  # nothing left
            pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break
    output = os.pread(out_fd, (int(job["output_kb"]) << 10) + 1, 0) if tests is None else b""
    os.close(out_fd)
    shutil.rmtree(workdir, ignore_errors=True)
    code = os.waitstatus_to_exitcode(status)
    if tests is None:
        return _exec_reply(job, timed_out, code, tail, output)
    return {"passed": sorted(passed), "status": "timeout" if timed_out else ("ok" if code == 0 else "killed")}


def _drop_root():
    """Root becomes nobody (uid/gid 65534, no supplementary groups): in the user namespace when the setup mapped
    it there, else on the host. Returns the feature names in place."""
    if os.geteuid() != 0:
        return []
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    return ["uid_nobody"]


def main():
    import gc

    global AUDIT, SNAPSHOT
    AUDIT = _load_audit()
    features = [a for a in sys.argv[1:] if not a.startswith("-")]
    for name in PRELOAD + tuple(sys.builtin_module_names):
        try:
            __import__(name)
        except ImportError:
            pass
    features += _drop_root()
    if "pid_namespace" in features:
        server = os.fork()
        if server != 0:  # this process only waits: the server is PID 1 of the namespace
            _, status = os.waitpid(server, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    shm = "/dev/shm"  # tmpfs: creating and removing a work directory costs microseconds instead of milliseconds
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    root = tempfile.mkdtemp(prefix="logitless-sandbox-", dir=base)
    tempfile.tempdir = None  # jobs' tempfile calls find TMPDIR = their work directory
    SNAPSHOT = _prepare()
    gc.freeze()  # the interpreter's objects stay out of the jobs' collections: fewer copy-on-write faults
    _send({"ready": True, "features": features})
    try:
        while True:
            try:
                (n,) = struct.unpack(">I", _read_exact(0, 4))
                job = json.loads(_read_exact(0, n))
            except EOFError:
                return
            _send(_run_job(job, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
