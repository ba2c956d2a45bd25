"""Workers forked from the zygote (areal_aio.fleet.zygote, workers/zygote.py): the zygote's own
child (forked, never exec'd), in the caller's folder with the caller's environment, the exit status through
the zygote, signals through the pidfd, fresh spawns where it is turned off, and no process
left when the process that started the zygote dies. The conformance tests (tests/fleet/
test_conformance.py, kind "real") run the whole worker surface on forked workers as well."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_aio import wire
from areal_aio.fleet import zygote
from areal_aio.fleet.client import PipeWorker
from areal_aio.settings import build_settings
from tests.conftest import ROOT

REPLY_TIMEOUT_S = 120.0


def parent_of(pid: int) -> int:
    """/proc/<pid>/stat's ppid (the field after the state, past the command's parentheses)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def started(tmp_path: Path) -> PipeWorker:
    settings = build_settings({}, ("model.path=embedded:tiny-random", "run.seed=3"))
    worker = PipeWorker("rollout", tmp_path / "rollout.log")
    await worker.prepare(settings.model.path)
    ready = await asyncio.wait_for(worker.start(wire.Init("rollout", settings.to_dict(), str(tmp_path))),
                                   REPLY_TIMEOUT_S)
    assert isinstance(ready, wire.Ready) and ready.pid == worker.pid
    return worker


@pytest.fixture
def fresh_zygote(monkeypatch):
    """A zygote of this test's own, started after the test's environment changes."""
    monkeypatch.delenv(zygote.FRESH_ENV, raising=False)
    zygote.stop()
    yield
    zygote.stop()


@pytest.mark.slow
async def test_a_forked_worker_is_the_zygotes_child_in_the_callers_folder_and_environment(
        tmp_path, monkeypatch, fresh_zygote):
    parent = await asyncio.to_thread(zygote.shared)
    assert parent is not None, zygote.state()
    assert zygote.state().startswith("forked")
    monkeypatch.chdir(tmp_path)
    worker = await started(tmp_path)
    try:
        assert isinstance(worker.proc, zygote.ForkedProcess)
        assert parent_of(worker.pid) == parent.proc.pid
        assert Path(f"/proc/{worker.pid}/cwd").resolve() == tmp_path.resolve()
        assert os.getsid(worker.pid) == worker.pid  # a session of its own: a Ctrl-C misses it
        # forked, never exec'd: its command line is the zygote's, its modules the zygote's imports
        assert "areal_aio.workers.zygote" in Path(f"/proc/{worker.pid}/cmdline").read_text()
    finally:
        await worker.stop()
    assert worker.proc.returncode == 0 and not alive(worker.pid)


@pytest.mark.slow
async def test_a_killed_forked_worker_reports_its_signal_and_a_terminated_one_too(tmp_path, fresh_zygote):
    for sig in (signal.SIGKILL, signal.SIGTERM):
        worker = await started(tmp_path)
        worker.proc.send_signal(sig)
        assert await asyncio.wait_for(worker.proc.wait(), 30) == -sig
        assert await worker.recv() is None
        assert f"exited with code {-sig}" in str(worker.failure(None))
        worker.proc.kill()  # after its end: nothing is signalled (its pid may be another's now)
        await worker.stop()


async def test_a_workers_environment_is_the_callers_now_with_its_cores_and_its_controller(monkeypatch):
    """What a fork request carries (the child replaces its environment with it; /proc/<pid>/environ
    shows only the zygote's, from its exec, so the handover itself is read off the request)."""
    monkeypatch.setenv("AREAL_AIO_TEST_MARK", "set after any zygote started")
    env = zygote.worker_env(3)
    assert env["AREAL_AIO_TEST_MARK"] == "set after any zygote started"
    assert env[zygote.CONTROLLER_ENV] == str(os.getpid()) and env["OMP_NUM_THREADS"] == "3"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


async def test_fresh_workers_where_the_zygote_is_turned_off(monkeypatch):
    monkeypatch.setenv(zygote.FRESH_ENV, "1")
    zygote.stop()
    try:
        assert await asyncio.to_thread(zygote.shared) is None
        assert zygote.state() == f"fresh ({zygote.FRESH_ENV}=1)"
    finally:
        zygote.stop()


@pytest.mark.slow
def test_the_zygote_and_its_workers_end_with_the_process_that_started_them(tmp_path):
    """kill -9 of the controller's process: the zygote's lifeline ends, it exits at once, and the
    forked worker, reparented, ends on its pipe and removes the run's /dev/shm folder."""
    shm = Path("/dev/shm/areal_aio") / f"zygote-test-{os.getpid()}"
    script = f"""
import asyncio, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from areal_aio import wire
from areal_aio.fleet import zygote
from areal_aio.fleet.client import PipeWorker
from areal_aio.settings import build_settings

async def main():
    shm = Path({str(shm)!r})
    shm.mkdir(parents=True, exist_ok=True)
    (shm / "owner.pid").write_text(str(os.getpid()))
    settings = build_settings({{}}, ("model.path=embedded:tiny-random",))
    worker = PipeWorker("rollout", Path({str(tmp_path / "rollout.log")!r}))
    await worker.start(wire.Init("rollout", settings.to_dict(), str(shm)))
    print(zygote.shared().proc.pid, worker.pid, flush=True)
    time.sleep(600)

asyncio.run(main())
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line, "the controller died before its worker was ready"
        zygote_pid, worker_pid = map(int, line.split())
        assert parent_of(worker_pid) == zygote_pid and parent_of(zygote_pid) == proc.pid
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while (alive(zygote_pid) or alive(worker_pid) or shm.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(zygote_pid) and not alive(worker_pid)
    assert not shm.exists()
