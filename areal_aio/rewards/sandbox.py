"""The sandbox: run one untrusted Python program in isolation, hand back its outputs as bytes.

    run(source, stdin) --Popen, own session, empty env-->  unshare (mount, net, pid, ipc, uts ns)
        |  code pipe, stdin pipe                                 `-- python BOOT  (pid 1 of the ns, root)
        |                                                              mounts: tmpfs over /tmp, /dev/shm,
        |                                                              /root, /home, ...; the interpreter's
        |                                                              folders bound back read-only
        |  <-- control pipe: "R" (started), "X code sig" (ended)       fork --> the program (pid 2):
        |  <-- stdout, stderr (1 MB cap)                                  rlimits, uid per run, no new privs,
        |  <-- results pipe (fd 3 in the program, 1 MB cap)              cwd /tmp/work, env: constants only
        `-- wall clock: SIGKILL the ns's init and the session from outside, reap

The program's verdict is never decided here: `run` returns what the program wrote (stdout,
and fd 3, the channel a harness writes its results to) and the caller compares that with
expected values that never enter the sandbox (rewards/code.py).

Layers, each probed once per process at first use (`layers()` says which are on):
  * session: a fresh process in its own session, killed as a group from outside on a wall clock
    (an alarm inside cannot stop `10**10**8`: it never returns to the bytecode loop); the ns's
    init also kills everything at the wall clock + grace, in case the caller itself was killed;
  * namespaces (util-linux `unshare`; needs root or unprivileged user namespaces): pid (the
    init kills and reaps everything the program started, setsid or not, when it ends), net
    (no network, not even the host's loopback), mount (fresh tmpfs over /tmp, /dev/shm and the
    other writable or private folders; the host's are invisible), ipc, uts;
  * uid: the program runs as a uid of its own, picked per run from a range no account uses
    (as root RLIMIT_NPROC is not enforced, so a fork bomb would go through; a uid per run also
    keeps one run's process count and kill(-1) away from every other process), with no
    supplementary groups and PR_SET_NO_NEW_PRIVS (no setuid binary gives root back);
  * rlimits: address space, processes (threads count), file size, CPU seconds, open files, no
    core files; output read at most MAX_OUTPUT bytes a channel (past it: killed).
Missing layers degrade to what remains; `layers().open` says what is then open; with neither namespaces nor a uid of its
own a program would run as the caller, so pre-flight refuses a run that needs the sandbox (check_sandbox).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
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

WALL_S = 4.0
"""Default wall-clock limit of one program (seconds)."""
KILL_SWEEPS = 20
"""Without a pid ns: kill(-1) sweeps as the run's uid until none of its processes is alive."""
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
"""Per-run uids are drawn from [UID_BASE, UID_BASE + UID_SPAN): no account or container uses them."""
TMPFS_MB = 64
"""Size of each fresh tmpfs (/tmp with the work folder, /dev/shm, ...)."""
HIDE = ("/tmp", "/var/tmp", "/dev/shm", "/root", "/home", "/run", "/mnt", "/media", "/srv")
"""Folders covered by an empty tmpfs in the program's mount namespace: the world-writable
ones and the ones that hold people's files. The interpreter's own folders are bound back."""
RESULTS_FD = 3
"""The program's results channel (a pipe the parent reads)."""
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
       "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
"""The program's whole environment: constants, nothing of the parent's. A fixed hash seed
keeps set and dict orders (and so a reference solution's outputs) the same run to run; one
BLAS thread keeps numpy inside RLIMIT_NPROC."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of one program (per process; `procs` counts threads too)."""

    memory_mb: int = 1024  # RLIMIT_AS
    procs: int = 32  # RLIMIT_NPROC of the run's own uid (threads count)
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write
    open_files: int = 256  # RLIMIT_NOFILE
    cpu_s: int | None = None  # RLIMIT_CPU; None: the wall limit rounded up, + 1


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one program did. `status`: exited (on its own; see exit_code / signal), timeout
    (killed at the wall limit), output_limit (killed: wrote more than MAX_OUTPUT to stdout or
    its results channel) or infra (the sandbox did not start; not the program's fault)."""

    status: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    results: bytes = b""
    wall_s: float = 0.0
    error: str = ""  # why, for infra
    uid: int | None = None  # the run's own uid (None: not switched)
    pid: int | None = None  # the session leader (its pid is the session and group id)

    @property
    def infra(self) -> bool:
        return self.status == "infra"


@dataclass(frozen=True, slots=True)
class Layers:
    """Which isolation layers are on in this process; `open` says what is open without them."""

    unshare: str | None  # the unshare binary used, None: no namespaces
    namespaces: tuple[str, ...]  # of pid, net, mount, ipc, uts, user
    uid: bool  # a uid of its own per run
    rlimits: bool = True
    hidden: tuple[str, ...] = ()  # folders covered by a fresh tmpfs
    kept: tuple[str, ...] = ()  # the interpreter's folders inside hidden ones, bound back read-only
    open: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return {"unshare": self.unshare, "namespaces": list(self.namespaces), "uid": self.uid,
                "rlimits": self.rlimits, "hidden": list(self.hidden), "kept": list(self.kept), "open": list(self.open),
                "notes": list(self.notes)}


# ------------------------------------------------------------------------- the ns's init

BOOT = r'''
import ctypes, json, os, resource, select, signal, sys
cfg = json.loads(sys.argv[1])
ctl = cfg["control"]
libc = ctypes.CDLL(None, use_errno=True)
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
try:
    chunks = []
    while True:
        chunk = os.read(cfg["code"], 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(cfg["code"])
    code = b"".join(chunks)
    uid = cfg["uid"]
    work = cfg["work"]
    if cfg["mount"]:
        keep = [(p, os.open(p, os.O_PATH)) for p in cfg["keep"]]
        for d in cfg["hide"]:
            check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4 | 8,
                             ("size=%dm,mode=%s" % (cfg["tmpfs_mb"], "1777" if d in ("/tmp", "/var/tmp", "/dev/shm") else "755")).encode()),
                  "mount tmpfs on " + d)
        for path, fd in keep:
            os.makedirs(path, exist_ok=True)
            check(libc.mount(("/proc/self/fd/%d" % fd).encode(), path.encode(), None, 4096 | 16384, None), "bind " + path)
            check(libc.mount(None, path.encode(), None, 4096 | 32 | 1 | 2 | 4, None), "read-only " + path)
            os.close(fd)
        os.mkdir(work, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
    if not cfg["pidns"]:
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
except SystemExit:
    raise
except BaseException as exc:
    fail("%s: %s" % (type(exc).__name__, exc))
pid = os.fork()
if pid == 0:
    status = 1
    try:
        os.close(ctl)
        if cfg["results"] != 3:
            os.dup2(cfg["results"], 3)
        os.closerange(4, 1 << 16)
        os.setpgid(0, 0)
        lim = cfg["limits"]
        for name, value in (("RLIMIT_AS", lim["as"]), ("RLIMIT_NPROC", lim["nproc"]),
                            ("RLIMIT_FSIZE", lim["fsize"]), ("RLIMIT_CPU", lim["cpu"]),
                            ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", lim["nofile"])):
            resource.setrlimit(getattr(resource, name), (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no core, no ptrace of this process
        os.chdir(work)
        os.environ.clear()
        os.environ.update(cfg["env"], HOME=work, TMPDIR=work)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.argv = ["<program>"]
        del cfg, chunks, libc
        program = compile(code, "<program>", "exec")
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
for fd in (0, 1, 2, cfg["results"]):
    try:
        os.close(fd)
    except OSError:
        pass
say("R")
pidfd = os.pidfd_open(pid)
ready, _, _ = select.select([pidfd], [], [], cfg["deadline_s"])
late = not ready
def children():
    try:
        with open("/proc/self/task/%d/children" % os.getpid()) as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []
st = None
def reap(flags):
    global st
    try:
        p, status = os.waitpid(-1, flags)
    except ChildProcessError:
        return False
    if p == pid:
        st = status
    return p != 0
if cfg["pidns"]:
    os.kill(-1, signal.SIGKILL)  # every process of the ns but this one
else:
    if uid is not None and os.fork() == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # every process of the run's uid
        finally:
            os._exit(0)
    for _ in range(10000):  # orphans come to us (subreaper): kill what is there until none is
        kids = children()
        if not kids:
            break
        for p in kids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        reap(0)
while reap(0):
    pass
code = os.waitstatus_to_exitcode(st) if st is not None else 0
say("X %d %d" % (max(code, 0), max(-code, 0) if not late else -1))
os._exit(0)
'''


# ----------------------------------------------------------------------------- layers

_layers: Layers | None = None
_layers_lock = threading.Lock()


def layers() -> Layers:
    """The isolation layers that work here (probed once per process, on first use)."""
    global _layers
    with _layers_lock:
        if _layers is None:
            _layers = _probe()
        return _layers


def _keep_paths() -> list[str]:
    """The interpreter's folders (and sys.path's), which must stay readable inside."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable)}
    paths |= {p for p in sys.path if p and os.path.isdir(p)}
    real = {os.path.realpath(p) for p in paths} | paths
    hidden = [d for d in HIDE if os.path.isdir(d)]
    under = sorted({p for p in real if os.path.isdir(p) and any(p.startswith(d + "/") for d in hidden)})
    # a folder inside another kept one comes along with it
    return [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]


PROBE = r'''
import json, os, socket
out = {"uid": os.getuid(), "pid": os.getpid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=0.5)
    out["net"] = "connected"
except OSError as exc:
    out["net"] = type(exc).__name__ + ":" + str(exc.errno)
import decimal, fractions  # modules the interpreter has not loaded yet: its folders are readable
out["tmp"] = sorted(os.listdir("/tmp"))
out["marker"] = os.path.exists(%r)
os.write(3, json.dumps(out).encode())
'''


def _probe() -> Layers:
    """Try the strongest configuration first, then weaker ones; the first that runs a probe
    program and shows its isolation is used."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    ns = ("pid", "net", "mount", "ipc", "uts")
    candidates: list[tuple[str | None, tuple[str, ...], bool]] = []
    if unshare:
        if root:
            candidates.append((unshare, ns, True))
        else:
            candidates.append((unshare, ("user", *ns), False))
    if root:
        candidates.append((None, (), True))
    candidates.append((None, (), False))
    notes = []
    with tempfile.TemporaryDirectory(prefix="areal_aio-probe-") as host:
        marker = os.path.join(host, "host-marker")
        Path(marker).write_text("host")
        for tool, spaces, uid in candidates:
            mount = "mount" in spaces
            trial = Layers(tool, spaces, uid, hidden=tuple(d for d in HIDE if os.path.isdir(d)) if mount else (),
                           kept=tuple(_keep_paths()) if mount else ())
            out = _run(PROBE % marker, b"", 5.0, Limits(), trial)
            if out.status != "exited" or out.exit_code != 0:
                notes.append(f"{'+'.join(spaces) or 'no namespaces'}, uid {'on' if uid else 'off'}: "
                             f"{out.status} {out.error or out.stderr[-300:].decode(errors='replace')}".strip())
                continue
            seen = json.loads(out.results)
            ok = (not uid or seen["uid"] == out.uid) and ("pid" not in spaces or seen["pid"] == 2) \
                and ("net" not in spaces or seen["net"] != "connected") \
                and ("mount" not in spaces or not seen["marker"])
            if not ok:
                notes.append(f"{'+'.join(spaces)}: started but not isolated: {seen}")
                continue
            # the probe imported modules the interpreter had not loaded, as the run's uid: its
            # folders are readable there (bound back over a hidden /root, or readable as they are)
            return dataclasses.replace(trial, open=_open_without(trial), notes=tuple(notes))
    return Layers(None, (), False, open=("nothing isolates programs here: the sandbox cannot start",),
                  notes=tuple(notes))


def _open_without(lay: Layers) -> tuple[str, ...]:
    """What a program can still do with these layers (README, Untrusted code)."""
    out = []
    if "net" not in lay.namespaces:
        out.append("network: no net namespace, the program can connect to the host and beyond")
    if "pid" not in lay.namespaces:
        out.append("processes: no pid namespace, the program sees the host's processes; its "
                   "own are killed by uid" + (" (uid layer on)" if lay.uid else ": NOT AT ALL without the uid layer"))
    if "mount" not in lay.namespaces:
        out.append("files: no mount namespace, the program sees the host's /tmp and every "
                   "world-readable file, and may write world-writable folders")
    if not lay.uid:
        out.append("uid: the program runs as the caller's uid: RLIMIT_NPROC counts the caller's "
                   "processes, kill(-1) reaches them, files the caller can write it can write")
    out.append("memory: bounded per process (address space x processes), not as a whole (no cgroup)")
    out.append("files: every world-readable file outside the hidden folders can be read")
    return tuple(out)


# ------------------------------------------------------------------------------- run

CONCURRENCY = max(2, os.cpu_count() or 2)
"""Programs at once: per process (a semaphore) and machine-wide (flock-ed slot files)."""
_SLOTS = threading.BoundedSemaphore(CONCURRENCY)


@contextlib.contextmanager
def _machine_slot():
    """One of cpu_count slot files, flock-ed for the run (machine-wide cap across the reward
    pool's processes; a lock dies with its process)."""
    folder = Path(tempfile.gettempdir()) / "areal_aio-sandbox-slots"
    folder.mkdir(exist_ok=True)
    n = CONCURRENCY
    start = secrets.randbelow(n)
    for k in [*range(start, n), *range(start)]:
        fh = open(folder / f"slot-{k}", "a")  # noqa: SIM115 - released in finally
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            continue
        try:
            yield
        finally:
            fh.close()
        return
    fh = open(folder / f"slot-{start}", "a")  # noqa: SIM115 - every slot is busy: wait for one
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()


def run(source: str, stdin: bytes = b"", *, wall_s: float = WALL_S, limits: Limits = Limits()) -> Outcome:
    """Run `source` as a Python program (__main__) in the sandbox; it may write results to fd 3.
    Blocks until it ends or is killed; never raises for anything the program does."""
    lay = layers()
    with _SLOTS, _machine_slot():
        return _run(source, stdin, wall_s, limits, lay)


def _run(source: str, stdin: bytes, wall_s: float, limits: Limits, lay: Layers) -> Outcome:
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if lay.uid else None
    mount = "mount" in lay.namespaces
    host_work = None if mount else tempfile.mkdtemp(prefix="areal_aio-sbx-")
    if host_work and uid is not None:
        os.chown(host_work, uid, uid)
    cpu = limits.cpu_s if limits.cpu_s is not None else int(wall_s) + 2
    pipes = {name: os.pipe() for name in ("code", "stdin", "stdout", "stderr", "results", "control")}
    child_fds = {"code": pipes["code"][0], "results": pipes["results"][1], "control": pipes["control"][1]}
    cfg = {"code": child_fds["code"], "results": child_fds["results"], "control": child_fds["control"],
           "uid": uid, "mount": mount, "pidns": "pid" in lay.namespaces, "hide": list(lay.hidden),
           "keep": list(lay.kept), "tmpfs_mb": TMPFS_MB,
           "work": "/tmp/work" if mount else host_work, "deadline_s": wall_s + GRACE_S,
           "limits": {"as": limits.memory_mb << 20, "nproc": limits.procs, "fsize": limits.file_mb << 20,
                      "cpu": cpu, "nofile": limits.open_files}, "env": ENV}
    argv = [sys.executable, "-s", "-B", "-P", "-c", BOOT, json.dumps(cfg)]
    if lay.unshare:
        flags = [f"--{n}" for n in lay.namespaces if n != "user"]
        if "user" in lay.namespaces:
            flags = ["--user", "--map-root-user", *flags]
        if "pid" in lay.namespaces:
            flags += ["--fork", "--kill-child"] + (["--mount-proc"] if mount else [])
        argv = [lay.unshare, *flags, "--", *argv]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=pipes["stdin"][0], stdout=pipes["stdout"][1],
                                stderr=pipes["stderr"][1], pass_fds=tuple(child_fds.values()),
                                env=dict(ENV), cwd="/", start_new_session=True)
    except OSError as exc:
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
        _remove(host_work)
        return Outcome("infra", error=f"cannot start the sandbox: {exc}", uid=uid)
    for name, (r, w) in pipes.items():  # the child's ends are the child's now
        os.close(r if name in ("code", "stdin") else w)
    mine = {name: (w if name in ("code", "stdin") else r) for name, (r, w) in pipes.items()}
    try:
        got = _exchange(proc, mine, source.encode(), stdin, wall_s)
    finally:
        _kill(proc, lay, uid)
        for fd in mine.values():  # each closed once: a second close could hit another thread's fd
            os.close(fd)
        _remove(host_work)
    wall = time.monotonic() - t0
    control = got["control"].decode(errors="replace").splitlines()
    kw = dict(stdout=got["stdout"], stderr=got["stderr"], results=got["results"], wall_s=wall, uid=uid,
              pid=proc.pid)
    error = next((line[2:] for line in control if line.startswith("E ")), "")
    if "R" not in control:
        why = error or got["stderr"][-500:].decode(errors="replace").strip() or f"exit status {proc.returncode}"
        if got["why"] == "timeout" and not error:
            why = f"did not start within {START_TIMEOUT_S:g}s"
        return Outcome("infra", error=f"the sandbox did not start: {why}", **kw)
    if got["why"]:
        return Outcome(got["why"], **kw)
    end = next((line.split() for line in control if line.startswith("X ")), None)
    if end is None:
        return Outcome("infra", error=f"the sandbox's init ended without a report (status {proc.returncode})", **kw)
    code, sig = int(end[1]), int(end[2])
    if sig == -1:
        return Outcome("timeout", **kw)
    return Outcome("exited", exit_code=code, signal=sig or None, **kw)


def _exchange(proc: subprocess.Popen, mine: dict[str, int], code: bytes, stdin: bytes, wall_s: float) -> dict:
    """Feed the code and stdin, read every channel (capped) until all end, a cap is passed, or
    the clock runs out: START_TIMEOUT_S until the init says it started, then wall_s. `mine`:
    the parent's ends; one closed here is removed from it."""
    sel = selectors.DefaultSelector()
    out = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray(), "control": bytearray()}
    pending = {"code": memoryview(code), "stdin": memoryview(stdin)}
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


def _kill(proc: subprocess.Popen, lay: Layers, uid: int | None) -> None:
    """Nothing of the run outlives this. With a pid ns: SIGKILL the ns's init (the kernel kills
    the ns, unshare reaps the init). Without one: first every process of the run's uid (the
    init, a subreaper, reaps them while it lives), then the init's children. Then the session
    while its leader is unreaped (a reaped leader's pid may be someone else's by now); reap."""
    if "pid" not in lay.namespaces and uid is not None:
        for _ in range(KILL_SWEEPS):  # a fork bomb forks while a sweep runs: sweep until none is left
            if not _kill_uid(uid):
                break
    if proc.poll() is None:
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
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


def _kill_uid(uid: int) -> bool:
    """kill(-1, SIGKILL) as `uid` (every process of the run's own uid, wherever it went);
    whether any was alive."""
    if not any(_uid_of(pid) == uid for pid in _live_pids()):
        return False
    subprocess.run(["/bin/kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[], env={},
                   capture_output=True, check=False)
    return True


def _live_pids() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(entry))
            except (OSError, IndexError):
                continue
    return out


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return int(next(line.split()[1] for line in fh if line.startswith("Uid:")))
    except (OSError, StopIteration, ValueError):
        return None


def _remove(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def processes_of(outcome: Outcome) -> list[int]:
    """Processes of a finished run still there, zombies included (tests): its uid's, or those
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
        if (outcome.uid is not None and _uid_of(int(entry)) == outcome.uid) or (outcome.pid and session == outcome.pid):
            found.append(int(entry))
    return found
