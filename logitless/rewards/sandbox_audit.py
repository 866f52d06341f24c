"""The sandbox's audit hook: what untrusted Python code may not do, checked inside the interpreter.

Loaded by `sandbox_worker.py` from this file (the worker runs in isolated mode, without this package on its
path) and installed in each job's child before any untrusted code runs; it cannot be removed. It is defence in
depth behind the kernel's limits, and what keeps the harness's state out of reach: no frame, no trace or profile
hook, no code object built from bytes, no ctypes. The hook and its helpers look up no global or builtin name
(a program can edit those while the hook runs for it) and use the system calls themselves, never a Python module
a program could edit (os.path, pathlib).
"""

import _stat
import os
import pathlib
import posix
import types

MAX_WRITTEN_FILES = 100  # per job; each file is also capped by RLIMIT_FSIZE
BLOCKED_EVENTS = frozenset((  # audit events refused to untrusted code (defence in depth behind the OS limits)
    "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.exec", "os.spawn", "os.system",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
    "socket.connect", "socket.bind", "socket.getaddrinfo", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "os.chroot", "os.setuid", "os.unshare", "os.setns", "sys.addaudithook", "sys.remote_exec",
    "_thread.start_new_thread", "_thread.start_joinable_thread",
    # hooks that hand out frames, and every other way to a frame (the harness's state lives in frames)
    "sys.settrace", "sys.setprofile", "sys._settraceallthreads", "sys._setprofileallthreads",
    "sys.monitoring.register_callback", "sys._current_frames", "sys._current_exceptions",
    # code objects built from bytes, which can read and write any memory (compile() is allowed)
    "code.__new__", "marshal.loads", "marshal.load",
))
# Refused as AttributeError / ValueError, which the standard library already handles where it asks for a
# caller's frame (collections.namedtuple, typing, enum).
FRAME_ATTRS = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"))
FRAME_EVENTS = frozenset(("sys._getframe", "sys._getframemodulename"))
BLOCKED_MODULES = ("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_xxinterpchannels",
                   "_interpreters", "_interpchannels", "_interpqueues", "gc", "_posixshmem", "_multiprocessing",
                   "_test", "_xxtestfuzz")  # a module is refused when its name starts with one of these
# file-system changes: the positions of their path arguments, each of which must be in the work directory
FS_EVENTS = types.MappingProxyType({
    "os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,), "os.symlink": (0, 1),
    "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
    "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.copytree": (1,),
})
READ_EVENTS = frozenset((  # their first argument must not be in /proc
    "os.listdir", "os.scandir", "os.walk", "os.fwalk", "glob.glob", "shutil.copyfile", "shutil.copymode",
    "shutil.copystat", "shutil.copytree",
))


def path_reader():
    """A function giving the path string of a path argument, or None for a descriptor; it refuses any other
    type, and path objects whose string a program could change between the audit hook's look and the call's."""
    type_, str_, bytes_, int_, perm = type, str, bytes, int, PermissionError
    pure = pathlib.PurePath
    fspath, pure_str, slot = pure.__fspath__, pure.__str__, getattr(pure, "_str", None)
    path_types = (pathlib.PurePosixPath, pathlib.PosixPath) if slot is not None else ()

    def read(path):
        t = type_(path)
        if t is str_:
            return path
        if t is bytes_:
            return path.decode("utf-8", "surrogateescape")
        if t is int_ or path is None:
            return None
        if t in path_types and t.__fspath__ is fspath and t.__str__ is pure_str and t._str is slot:
            return fspath(path)  # genuine code all the way: the string is cached, the call will see the same
        raise perm(f"sandbox: a path of type {t.__name__} is not permitted")

    return read


def resolver():
    """A function giving the absolute path of a path string with every symbolic link resolved (missing
    components kept, like os.path.realpath): the genuine system calls only, never a module a program can edit."""
    lstat, getcwd, readlink, is_link, oserror, perm = posix.lstat, posix.getcwd, posix.readlink, _stat.S_ISLNK, \
        OSError, PermissionError

    def resolve(path):
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        todo = path.split("/")
        todo.reverse()
        out = []
        hops = 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                if out:
                    out.pop()
                continue
            out.append(part)
            try:
                mode = lstat("/" + "/".join(out)).st_mode
            except oserror:
                continue
            if is_link(mode):
                hops += 1
                if hops > 40:
                    raise perm("sandbox: too many levels of symbolic links")
                target = readlink("/" + "/".join(out))
                out.pop()
                if target.startswith("/"):
                    out.clear()
                more = target.split("/")
                more.reverse()
                todo.extend(more)
        return "/" + "/".join(out)

    return resolve


def audit_hook(workdir):
    """Refuse process and thread creation, signals to other processes, sockets, every way to a frame, trace and
    profile hooks, code objects built from bytes, /proc, changes outside `workdir`, directories outside it as
    descriptors, and leaving it as the current directory. Uses no global or builtin name: a program can edit
    those while the hook runs for it."""
    blocked, fs_events, read_events = BLOCKED_EVENTS, FS_EVENTS, READ_EVENTS
    attrs, frame_events, modules = FRAME_ATTRS, FRAME_EVENTS, BLOCKED_MODULES
    most = MAX_WRITTEN_FILES
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    read_path, resolve = path_reader(), resolver()
    stat, fstat, is_dir, oserror = posix.stat, posix.fstat, _stat.S_ISDIR, OSError
    type_, str_, int_ = type, str, int
    perm, attr_error, value_error = PermissionError, AttributeError, ValueError
    root = workdir.rstrip("/") + "/"
    here = stat(workdir)
    opened = [0]

    def inside(path):
        text = read_path(path)
        if text is None:
            return True  # a descriptor: only ones for the work directory can exist (see "open" below)
        full = resolve(text)
        return full == workdir or full.startswith(root)

    def proc(path):
        text = read_path(path)
        return text is not None and (text.startswith("/proc") or resolve(text).startswith("/proc"))

    def hook(event, args):
        if event in blocked or event.startswith("ctypes."):
            raise perm(f"sandbox: {event} is not permitted")
        if event == "object.__getattr__":
            if args[1] in attrs:
                raise attr_error(f"sandbox: attribute {args[1]} is not permitted")
        elif event in frame_events:
            raise value_error(f"sandbox: {event} is not permitted")
        elif event == "import":
            name = args[0]
            if type_(name) is not str_ or name.startswith(modules):
                raise perm(f"sandbox: import of {name} is not permitted")
        elif event == "open":
            path, mode, flags = args[0], args[1], args[2] if args[2:] else 0
            if proc(path):
                raise perm("sandbox: /proc is not readable")
            if mode is None:
                writes = type_(flags) is not int_ or (flags & write_flags) != 0
            else:
                writes = type_(mode) is not str_ or "w" in mode or "a" in mode or "x" in mode or "+" in mode
            text = read_path(path)
            if text is not None and not inside(path):
                if writes:
                    raise perm("sandbox: writing outside the work directory is not permitted")
                try:
                    directory = is_dir(stat(text).st_mode)
                except oserror:
                    directory = False
                if directory:  # a descriptor of it would let relative paths escape the checks above
                    raise perm("sandbox: opening a directory outside the work directory is not permitted")
            if writes:
                opened[0] += 1
                if opened[0] > most:
                    raise perm(f"sandbox: more than {most} files opened for writing")
        elif event == "os.chdir":
            target = args[0]
            try:
                st = fstat(target) if type_(target) is int_ else stat(resolve(read_path(target)))
            except oserror:
                raise perm("sandbox: changing the current directory is not permitted") from None
            if (st.st_ino, st.st_dev) != (here.st_ino, here.st_dev):
                raise perm("sandbox: the current directory stays the work directory")
        else:
            if event in read_events and args and proc(args[0]):
                raise perm("sandbox: /proc is not readable")
            for i in fs_events.get(event, ()):
                if not inside(args[i]):
                    raise perm(f"sandbox: {event} outside the work directory is not permitted")

    return hook
