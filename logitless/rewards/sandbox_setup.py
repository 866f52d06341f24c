"""Sandbox worker setup: enter new user, network, PID and mount namespaces, then replace this process by the worker.

Run by `logitless.rewards.sandbox` as `python -I -S -B sandbox_setup.py WORKER [--no-namespaces]` with an empty
environment. It is the only sandbox code that loads `ctypes` (for `unshare`, which Python 3.11's `os` lacks);
it then `exec`s `python -I -S -B WORKER [FEATURE ...]`, so the worker, and every process that runs untrusted
code, starts from a fresh interpreter image in which `ctypes` was never loaded: no foreign-function object, type
or library handle exists there for a program to find.

Namespaces (when the kernel permits unprivileged user namespaces):
- as root: a helper process still outside the new user namespace maps uid/gid 0 and 65534 (`nobody`) into it,
  so the worker keeps root's read access to the interpreter's files while it imports, then drops to `nobody`;
- otherwise: the caller's own uid and gid are mapped (setgroups denied), the only mapping the kernel allows.
The worker is `exec`ed either way: a non-root uid keeps no capabilities across `exec`, and root's go when the
worker drops to `nobody`.

In the new mount namespace (private to the worker and its jobs; the trainer's view is unchanged) every mount is
made read-only (`mount_setattr`, Linux >= 5.12), `/proc` and `/tmp` are hidden under empty read-only tmpfs
mounts (`/tmp` is left alone when the interpreter or the worker lives below it), and `/dev/shm`, where the worker
makes the jobs' work directories, becomes a fresh private tmpfs: the kernel refuses a job every write outside it.
The features granted are passed to the worker as arguments.
"""

import ctypes
import ctypes.util
import os
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWNS = 0x10000000, 0x40000000, 0x20000000, 0x00020000
NOBODY = 65534
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 1, 2, 4, 0x4000, 1 << 18
# mount_setattr's number where it is 442 (the syscall numbers shared since Linux 5.1); elsewhere not attempted
MOUNT_SETATTR_442 = ("x86_64", "i686", "i386", "aarch64", "armv7l", "armv8l", "riscv64", "ppc64le", "ppc64", "s390x")
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
WORK_TMPFS_MB = 512  # size cap of the private tmpfs holding the jobs' work directories (pages are used lazily)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _mapped(name, ids):
    """Whether every id in `ids` is mapped in this process's user namespace (/proc/self/uid_map or gid_map)."""
    try:
        with open(f"/proc/self/{name}") as f:
            ranges = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return all(any(inside <= i < inside + count for inside, _, count in ranges) for i in ids)


def _unshare(libc, flags):
    """unshare(flags) in this process, with uid/gid maps written; True on success."""
    pid, uid, gid = os.getpid(), os.geteuid(), os.getegid()
    if uid == 0 and not (_mapped("uid_map", (0, NOBODY)) and _mapped("gid_map", (0, NOBODY))):
        return False  # e.g. a container mapping too few ids: no namespaces rather than a root without `nobody`
    if uid != 0:
        if libc.unshare(flags) != 0:
            return False
        try:  # without a map the process keeps its uid outside and appears as the overflow uid inside: no more
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError:
            pass
        return True
    # root: only a process in the parent user namespace may map more than its own uid, so a helper writes them
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(go_w)
            if os.read(go_r, 1) != b"1":
                os._exit(1)
            for name in ("uid_map", "gid_map"):
                _write(f"/proc/{pid}/{name}", f"0 0 1\n{NOBODY} {NOBODY} 1\n")
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(go_r)
    ok = libc.unshare(flags) == 0
    os.write(go_w, b"1" if ok else b"0")
    os.close(go_w)
    _, status = os.waitpid(helper, 0)
    if ok and status != 0:
        sys.exit("sandbox setup: the user namespace was created but its uid map could not be written")
    return ok


def _below(path, root):
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _mounts(libc, worker):
    """In the new mount namespace: a private tmpfs on /dev/shm for the work directories, /proc and /tmp hidden,
    then every other mount read-only. Returns the features in place."""
    work = f"size={WORK_TMPFS_MB}m,mode=1777".encode()
    if (not os.path.isdir("/dev/shm") or libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0
            or libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, work) != 0):
        return []  # nothing changed that the worker would notice
    keep = [sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, worker]
    hidden = ["/proc"] + [d for d in ("/tmp",) if not any(_below(k, d) for k in keep)]
    empty = b"size=4k,mode=0555"
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV
    features = ["mount_namespace"] if all(libc.mount(b"tmpfs", d.encode(), b"tmpfs", flags, empty) == 0
                                          for d in hidden if os.path.isdir(d)) else []
    if os.uname().machine not in MOUNT_SETATTR_442:
        return features
    readonly, writable = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0), _MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)
    size = ctypes.sizeof(readonly)
    if libc.syscall(442, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(readonly), size) == 0:
        if libc.syscall(442, AT_FDCWD, b"/dev/shm", 0, ctypes.byref(writable), size) != 0:
            sys.exit("sandbox setup: /dev/shm could not be made writable again after the read-only remount")
        features.append("read_only_root")
    return features


def main():
    worker, namespaces = sys.argv[1], "--no-namespaces" not in sys.argv[2:]
    features = []
    if namespaces:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        for flags, names in ((CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS,
                              ["net_namespace", "pid_namespace"]),
                             (CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS, ["net_namespace"])):
            if _unshare(libc, flags):
                features += names + _mounts(libc, worker)
                break
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", worker] + features)


if __name__ == "__main__":
    main()
