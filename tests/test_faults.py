"""Fault injection: a real run (`python -m areal_aio run`, tiny-random) loses one of its
processes to SIGKILL; the run ends with the right status and a one-line cause, and leaves
no process and no /dev/shm folder behind. Each test prints the time from the fault to the
controller's exit and to the last process gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_aio.rewards.pool import BREAK_WINDOW_S, MAX_BREAKS
from tests.conftest import ROOT as ROOT
from tests.conftest import alive

pytestmark = pytest.mark.slow

SHM = Path(os.environ.get("AREAL_AIO_SHM", "/dev/shm/areal_aio"))
TINY = ["model.path=embedded:tiny-random", "sft.before_run=off", "rollout.max_new_tokens=12", "rollout.group_size=4",
        "trainer.batch_size=8", "task.eval_size=8", "task.eval_every=2", "run.progress=false",
        "trainer.bf16=false", "controller.reward_procs=1", "run.max_steps=100000"]
START_TIMEOUT_S = 120.0
GONE_TIMEOUT_S = 20.0
ROLES = {"areal_aio.workers.rollout": "rollout", "areal_aio.workers.trainer": "trainer", "areal_aio.rewards.pool": "reward"}
"""A process's role by its command line; a worker forked from the zygote shares the zygote's
command line and is known by its name (/proc/<pid>/comm, workers/common.name_process)."""
NAMES = {"areal-rollout": "rollout", "areal-trainer": "trainer", "areal-zygote": "zygote"}


def descendants(root: int) -> dict[int, str]:
    """Every live process below `root` (by parent pid), with its role from the command line."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found and alive(child):
                found[child] = role_of(child)
                frontier.append(child)
    return found


def role_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "gone"
    return NAMES.get(name) or next((role for needle, role in ROLES.items() if needle in cmd), cmd)


class Run:
    """One CLI run in its own session, started and waited for until it has trained a step."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.name = f"{name}-{os.getpid()}"
        self.folder = tmp_path / name
        sets = [arg for kv in TINY + [f"run.name={self.name}"] for arg in ("--set", kv)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_aio", "run", str(ROOT / "settings.toml"), *sets,
             "--out", str(self.folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, cwd=tmp_path)
        self.wait_for_steps(1)
        self.children = self.wait_for_roles({"rollout", "trainer", "reward"})

    def steps(self) -> int:
        path = self.folder / "steps.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_for_steps(self, n: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.steps() < n:
            assert self.proc.poll() is None, self.proc.communicate()[1]
            assert time.monotonic() < deadline, f"no step {n} within {START_TIMEOUT_S:.0f}s"
            time.sleep(0.1)

    def wait_for_roles(self, roles: set[str]) -> dict[int, str]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not roles <= set((found := descendants(self.proc.pid)).values()):
            assert time.monotonic() < deadline, found
            time.sleep(0.1)
        return found

    def pid(self, role: str) -> int:
        return next(pid for pid, r in self.children.items() if r == role)

    def shm(self) -> list[Path]:
        return sorted(SHM.glob(f"{self.name}-*")) if SHM.is_dir() else []

    def kill_and_time(self, pid: int) -> tuple[int, str, float, float]:
        """SIGKILL `pid`; (exit status, stderr, seconds to the controller's exit, seconds until
        every process of the run and its /dev/shm folder are gone)."""
        everyone = set(descendants(self.proc.pid)) | {self.proc.pid}
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        _, err = self.proc.communicate(timeout=60)
        exited = time.perf_counter() - t0
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while (any(alive(p) for p in everyone) or self.shm()) and time.monotonic() < deadline:
            time.sleep(0.02)
        gone = time.perf_counter() - t0
        assert not [p for p in everyone if alive(p)], {p: role_of(p) for p in everyone if alive(p)}
        assert not self.shm(), self.shm()
        return self.proc.returncode, err, exited, gone

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


def report(capsys, what: str, exited: float, gone: float) -> None:
    with capsys.disabled():
        print(f"\n[fault] {what}: controller exited {exited:.2f}s after the kill, "
              f"every process and /dev/shm gone after {gone:.2f}s")


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_a_killed_worker_ends_the_run_with_one_line(tmp_path, capsys, role):
    run = Run(tmp_path, f"fault-{role}")
    try:
        code, err, exited, gone = run.kill_and_time(run.pid(role))
    finally:
        run.close()
    report(capsys, f"kill -9 {role} worker", exited, gone)
    assert code == 1, err
    line = last_line(err)
    # the pipe's end may be read before the exit code is known: either names the cause
    assert re.match(rf"error: {role} worker failed: (exited with code -9|closed its pipe|pipe closed while sending); see \S+error.log$",
                    line), err
    assert "Traceback" not in err
    log = (run.folder / "error.log").read_text()
    assert "Traceback" in log and "WorkerFailed" in log


def test_a_killed_controller_takes_every_process_and_its_shm_folder_with_it(tmp_path, capsys):
    run = Run(tmp_path, "fault-controller")
    try:
        assert run.shm()
        code, err, exited, gone = run.kill_and_time(run.proc.pid)
    finally:
        run.close()
    report(capsys, "kill -9 controller", exited, gone)
    assert code == -signal.SIGKILL


def test_a_killed_reward_process_is_replaced_and_one_that_keeps_dying_ends_the_run(tmp_path, capsys):
    run = Run(tmp_path, "fault-reward")
    try:
        killed = [run.pid("reward")]
        first = time.monotonic()
        os.kill(killed[0], signal.SIGKILL)  # once: healed, the run goes on
        run.wait_for_steps(run.steps() + 2)
        window = 1  # deaths that count towards the break: those within BREAK_WINDOW_S of the last
        if time.monotonic() - first > BREAK_WINDOW_S / 2:
            # a loaded machine took so long to heal that the first death could leave the window
            # before the last: wait until it has, and stop the run with deaths after the check
            time.sleep(max(0.0, first + BREAK_WINDOW_S + 2 - time.monotonic()))
            window = 0
        while window < MAX_BREAKS - 1:
            killed.append(new_reward_process(run, killed))
            os.kill(killed[-1], signal.SIGKILL)
            window += 1
        code, err, exited, gone = run.kill_and_time(new_reward_process(run, killed))
    finally:
        run.close()
    report(capsys, f"kill -9 reward process ({MAX_BREAKS} deaths within the window)", exited, gone)
    assert code == 1, err
    line = last_line(err)
    assert line.startswith(f"error: RewardPoolBroken: reward pool broke {MAX_BREAKS} times"), err
    assert "Traceback" not in err and "could not write" not in err, err
    assert (run.folder / "model" / "model.safetensors").exists()  # the trainer was alive: what it learned is kept


def new_reward_process(run: Run, killed: list[int]) -> int:
    """The pool process that replaced the killed ones (the run must still be going)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert run.proc.poll() is None, run.proc.communicate()[1]
        found = [p for p, role in descendants(run.proc.pid).items() if role == "reward" and p not in killed]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no new reward process"
        time.sleep(0.05)
