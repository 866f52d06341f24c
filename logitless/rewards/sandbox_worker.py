"""Sandbox worker: a pre-warmed interpreter that runs untrusted programs with their tests, one job at a time.

Run by `logitless.rewards.sandbox` as `python -I -S -B sandbox_worker.py` with an empty environment; it uses
the standard library only. Protocol on stdin/stdout: 4-byte big-endian length + JSON.
    job    {"program": str, "tests": [str], "timeout": s, "cpu": s, "memory_mb": n, "output_kb": n, "files": n}
    result {"passed": [test indices], "status": "ok" | "timeout" | "killed"}

The worker serves as PID 1 of its own PID namespace when permitted. Per job it forks one child in a new
session, the only process running untrusted code; after the job it kills that process group and, as PID 1,
every other process in its namespace. The child sets resource limits, enters a fresh work directory, closes
every inherited file descriptor except a report pipe, installs an audit hook, runs the program, then each test.
After each test that raised nothing, the child writes "<secret> <index>" to the report pipe; the worker counts
only lines with this job's secret, so exiting early, closing or flooding the pipe can only lose credit.
See docs/rewards.md.
"""

import builtins
import ctypes
import ctypes.util
import gc
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
NOBODY = 65534
PR_SET_PDEATHSIG = 1
MAX_WRITTEN_FILES = 100  # per job; each file is also capped by RLIMIT_FSIZE
BLOCKED_EVENTS = (  # audit events refused to untrusted code (defence in depth behind the OS limits)
    "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.exec", "os.spawn", "os.system",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
    "socket.connect", "socket.bind", "socket.getaddrinfo", "sys._current_frames", "sys._current_exceptions",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlopen", "ctypes.cdata", "os.chroot",
    "os.setuid", "sys.addaudithook", "sys.remote_exec", "_thread.start_new_thread",
)
# Frames hold the harness's state: every way to reach one is refused (as AttributeError / ValueError, which
# the standard library already handles where it asks for a caller's frame, e.g. collections.namedtuple).
FRAME_ATTRS = ("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back")
FRAME_EVENTS = ("sys._getframe", "sys._getframemodulename")
BLOCKED_MODULES = ("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "gc")
FS_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
             "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile", "os.chdir", "os.mknod")
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
# Imported before the worker drops privileges (the interpreter's files may not be readable by nobody) and so
# that a job's imports of them cost nothing. Other standard-library modules are imported on demand.
PRELOAD = (
    "abc", "array", "bisect", "cmath", "collections", "collections.abc", "copy", "dataclasses", "datetime",
    "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "io", "itertools", "json", "math",
    "numbers", "operator", "random", "re", "statistics", "string", "textwrap", "time", "typing", "unicodedata",
    "queue", "struct", "contextlib", "types", "warnings", "inspect", "traceback", "pprint", "calendar",
)


def _write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def _isolate_worker(namespaces=True):
    """Once per worker: drop root to nobody, then enter new user, network and PID namespaces when the kernel
    permits. Returns the isolation features in place; with "pid_namespace" the caller must fork once and serve
    from the child, which is PID 1 of the new namespace."""
    features = []
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        features.append("uid_nobody")
    uid, gid = os.geteuid(), os.getegid()
    for flags, names in ((CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID, ["net_namespace", "pid_namespace"]),
                         (CLONE_NEWUSER | CLONE_NEWNET, ["net_namespace"])):
        if namespaces and LIBC.unshare(flags) == 0:
            try:
                _write_file("/proc/self/setgroups", "deny")
                _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
                _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
            except OSError:
                pass
            features += names
            break
    return features


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


def _audit_hook(workdir):
    """Refuse process creation, signals, sockets, introspection that could reach the harness, /proc, and file
    changes outside `workdir`."""
    blocked, modules, fs_events = set(BLOCKED_EVENTS), set(BLOCKED_MODULES), set(FS_EVENTS)
    attrs, frame_events = set(FRAME_ATTRS), set(FRAME_EVENTS)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    opened = [0]
    root = workdir.rstrip("/") + "/"
    realpath, fspath, isinstance_, str_, bytes_ = os.path.realpath, os.fspath, isinstance, str, bytes
    perm = PermissionError

    def inside(path):
        if isinstance_(path, int):
            return True
        p = fspath(path)
        p = p.decode(errors="replace") if isinstance_(p, bytes_) else str_(p)
        full = realpath(p)
        return full == workdir or full.startswith(root)

    def hook(event, args):
        if event in blocked:
            raise perm(f"sandbox: {event} is not permitted")
        if event == "object.__getattr__" and args[1] in attrs:
            raise AttributeError(f"sandbox: attribute {args[1]} is not permitted")
        if event in frame_events:
            raise ValueError(f"sandbox: {event} is not permitted")
        if event == "import" and args[0].split(".")[0] in modules:
            raise perm(f"sandbox: import of {args[0]} is not permitted")
        if event == "open":
            path, mode = args[0], args[1]
            name = path if isinstance_(path, int) else fspath(path)
            name = name.decode(errors="replace") if isinstance_(name, bytes_) else str_(name)
            if name.startswith("/proc") or realpath(name).startswith("/proc"):
                raise perm("sandbox: /proc is not readable")
            flags = args[2] if len(args) > 2 and isinstance_(args[2], int) else 0
            writes = bool(flags & write_flags) if mode is None else any(c in str_(mode) for c in "wax+")
            if writes and not inside(path):
                raise perm("sandbox: writing outside the work directory is not permitted")
            if writes:
                opened[0] += 1
                if opened[0] > MAX_WRITTEN_FILES:
                    raise perm(f"sandbox: more than {MAX_WRITTEN_FILES} files opened for writing")
        elif event in fs_events:
            for a in args:
                if isinstance_(a, (str_, bytes_)) or hasattr(a, "__fspath__"):
                    if not inside(a):
                        raise perm(f"sandbox: {event} outside the work directory is not permitted")

    return hook


def _confine(job, report_fd, workdir):
    """In the job's child: work directory, standard streams to a capped file, every other descriptor closed
    but the report pipe (returned), resource limits, empty environment."""
    os.chdir(workdir)
    out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    report = os.dup2(report_fd, 777)  # any number: the pipe is not secret, the per-job line prefix is
    os.closerange(3, report)
    os.closerange(report + 1, 65536)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # output over the cap: writes fail instead of killing
    cpu = int(job["cpu"])
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_AS, int(job["memory_mb"]) << 20)
    _limit(resource.RLIMIT_FSIZE, int(job["output_kb"]) << 10)
    _limit(resource.RLIMIT_NOFILE, int(job["files"]))
    _limit(resource.RLIMIT_NPROC, 0)
    _limit(resource.RLIMIT_CORE, 0)
    os.environ.clear()
    return report


def _restorer():
    """A function that undoes what a program may have left to fake a pass: monkeypatched builtins, trace and
    profile hooks, signal handlers and timers, pending finalizers (collected now; the collector is then off)."""
    saved, current = dict(builtins.__dict__), builtins.__dict__
    settrace, setprofile, setitimer, sig, collect, disable = (sys.settrace, sys.setprofile, signal.setitimer,
                                                               signal.signal, gc.collect, gc.disable)
    timers = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
    signals = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]

    def restore():
        for t in timers:
            setitimer(t, 0)
        for s in signals:
            try:
                sig(s, signal.SIG_IGN if s == signal.SIGXFSZ else signal.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass
        settrace(None)
        setprofile(None)
        collect()
        disable()
        current.clear()
        current.update(saved)

    return restore


def _run_untrusted(job, report_fd, workdir):
    """The job's child: confine, run the program, then each test; report each test that raised nothing."""
    report = _confine(job, report_fd, workdir)
    secret = job.pop("secret").encode()
    try:
        program_code = compile(job.pop("program"), "<program>", "exec")
        test_codes = [compile(t, f"<test {i}>", "exec") for i, t in enumerate(job.pop("tests"))]
    except BaseException:
        os._exit(0)
    write, exec_, exit_, restore = os.write, exec, os._exit, _restorer()
    for name in BLOCKED_MODULES:
        sys.modules.pop(name, None)
    sys.addaudithook(_audit_hook(workdir))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec_(program_code, namespace)
    except BaseException:
        exit_(0)  # a program that raises (or calls sys.exit) passes no test
    for i, code in enumerate(test_codes):
        try:
            restore()
            exec_(code, namespace)
        except BaseException:
            continue
        try:
            write(report, secret + b" %d\n" % i)
        except BaseException:
            exit_(0)
    exit_(0)


def _collect(read_fd, pid, secret, deadline):
    """Read report lines until B closes the pipe or the deadline passes; returns (passed indices, timed_out)."""
    buf, timed_out = b"", False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        buf = (buf + chunk)[-(1 << 20):]
    passed = set()
    for line in buf.split(b"\n"):
        head, _, index = line.partition(b" ")
        if head == secret and index.isdigit():
            passed.add(int(index))
    return passed, timed_out


def _run_job(job, root):
    secret = os.urandom(16).hex()
    job["secret"] = secret
    workdir = os.path.realpath(tempfile.mkdtemp(dir=root))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()  # one process group to kill
            _run_untrusted(job, write_fd, workdir)
        finally:
            os._exit(1)
    os.close(write_fd)
    passed, timed_out = _collect(read_fd, pid, secret.encode(), time.monotonic() + float(job["timeout"]))
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
    shutil.rmtree(workdir, ignore_errors=True)
    code = os.waitstatus_to_exitcode(status)
    n = len(job["tests"])
    status_name = "timeout" if timed_out else ("ok" if code == 0 else "killed")
    return {"passed": sorted(i for i in passed if i < n), "status": status_name}


def main():
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    features = _isolate_worker(namespaces="--no-namespaces" not in sys.argv)
    if "pid_namespace" in features:
        server = os.fork()
        if server != 0:  # this process only waits: the server is PID 1 of the namespace
            _, status = os.waitpid(server, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    gc.freeze()  # the interpreter's objects stay out of the jobs' collections: fewer copy-on-write faults
    shm = "/dev/shm"  # tmpfs: creating and removing a work directory costs microseconds instead of milliseconds
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    root = tempfile.mkdtemp(prefix="logitless-sandbox-", dir=base)
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
