"""Run Python code as an unprivileged uid, the way most users run the sandbox (the tests run
as root). The child is a real uid with no capability; only its mount namespace is its own, so
that an interpreter installed where that uid cannot enter (pyenv's default, under root's home)
is reachable: the folder it cannot enter is covered by a tmpfs with the interpreter's and the
project's folders bound back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

NOBODY = 65534

LAUNCH = r'''
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def check(rc, what):
    if rc != 0:
        raise OSError(ctypes.get_errno(), what)
fds = [(p, os.open(p, os.O_PATH)) for p in cfg["keep"]]
for closed in cfg["closed"]:
    check(libc.mount(b"tmpfs", closed.encode(), b"tmpfs", 0, b"mode=755"), "cover " + closed)
for path, fd in fds:
    if not os.path.exists(path):
        os.makedirs(path) if os.path.isdir("/proc/self/fd/%d" % fd) else open(path, "w").close()
    check(libc.mount(("/proc/self/fd/%d" % fd).encode(), path.encode(), None, 4096 | 16384, None), "bind " + path)
os.setgroups([])
os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
os.chdir(cfg["cwd"])
os.execve(sys.executable, [sys.executable, "-c", cfg["code"]], cfg["env"])
'''


def _closed_ancestors(path: str, uid: int) -> list[str]:
    """Folders above `path` that `uid` (no group, not the owner) cannot enter."""
    out = []
    p = Path(path)
    for parent in reversed(p.parents):
        st = parent.stat()
        if st.st_uid != uid and not st.st_mode & 0o001:
            out.append(str(parent))
    return out


def run_as(code: str, *, uid: int = NOBODY, cwd: str = "/tmp", timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` with this interpreter (its venv and the project importable) as `uid`."""
    project = str(Path(__file__).resolve().parents[2])
    keep = sorted({os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix), sys.prefix, project})
    closed = sorted({c for k in keep for c in _closed_ancestors(k, uid)})
    cfg = {"keep": keep, "closed": closed, "uid": uid, "cwd": cwd, "code": code,
           "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "PYTHONPATH": project,
                   "LANG": "C.UTF-8", **(env or {})}}
    unshare = shutil.which("unshare") or "unshare"
    return subprocess.run([unshare, "--mount", "--propagation", "private", "--", sys.executable, "-c", LAUNCH,
                           json.dumps(cfg)], capture_output=True, timeout=timeout, check=False)


def json_as(code: str, **kw) -> object:
    """run_as, then the JSON its last stdout line holds (AssertionError with its output otherwise)."""
    done = run_as(code, **kw)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    return json.loads(lines[-1])
