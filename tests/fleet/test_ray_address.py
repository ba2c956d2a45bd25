"""A ray.address where no cluster answers (loopback ports only): `check` refuses it in one line,
a run that gets past the check fails in bounded time naming it, and SIGTERM stops such a run."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from areal_aio.app.cli import main
from tests.conftest import ROOT, alive, need

ray = need("ray")

SETTINGS = str(ROOT / "settings.toml")
TINY = ["model.path=embedded:tiny-random", "sft.before_run=off", "rollout.max_new_tokens=8", "task.eval_size=2", "run.progress=false",
        "controller.reward_procs=0", "run.max_steps=2"]


def free_port() -> int:
    """A loopback port where nothing listens (bound once, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_listener():
    """A loopback port that accepts connections and never says a word: not a Ray cluster."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_check_refuses_an_address_where_nothing_listens(capsys):
    port = free_port()
    t0 = time.perf_counter()
    assert main(["check", SETTINGS, "--set", f"ray.address=127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"settings error: ray.address: nothing listens at 127.0.0.1:{port}"), err
    assert err.count("\n") == 1 and time.perf_counter() - t0 < 10
    assert not ray.is_initialized()


def test_the_probe_names_what_is_wrong_and_passes_a_listener():
    from areal_aio.fleet.ray_workers import unreachable

    assert "not host:port" in unreachable("somewhere")
    assert unreachable("local") is None
    with silent_listener() as address:
        assert unreachable(address) is None


def run_child(address: str, tmp_path, *, connect_timeout_s: float | None = None) -> subprocess.Popen:
    """`run` on `address` in a child process of its own session (preflight passes: something listens)."""
    patch = (f"import areal_aio.fleet.ray_workers as r; r.CONNECT_TIMEOUT_S = {connect_timeout_s}; "
             if connect_timeout_s is not None else "")
    code = (f"import sys; {patch}from areal_aio.app.cli import main; "
            f"sys.exit(main(sys.argv[1:]))")
    sets = [arg for kv in [*TINY, f"ray.address={address}"] for arg in ("--set", kv)]
    return subprocess.Popen([sys.executable, "-c", code, "run", SETTINGS, *sets, "--out", str(tmp_path / "run")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Wait up to `timeout` for `proc`; one that will not stop is killed (its group too), and what it
    printed comes back either way, so a failing assert shows it."""
    t0 = time.perf_counter()
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException as exc:  # it would not stop, or the test was interrupted: end what it started
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        err = f"[still running after {timeout}s; killed]\n{proc.communicate()[1]}"
    return proc.returncode, err, time.perf_counter() - t0


@pytest.mark.slow
def test_a_run_that_cannot_join_the_cluster_fails_in_bounded_time_naming_it(tmp_path):
    with silent_listener() as address:
        proc = run_child(address, tmp_path, connect_timeout_s=3)
        code, err, _ = finish(proc, 60)
    assert code == 1, err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith(f"error: ClusterUnreachable: ray.address = '{address}': no Ray cluster answered "
                           "within 3s"), err
    assert not alive(proc.pid)


@pytest.mark.slow
def test_sigterm_stops_a_run_waiting_for_its_cluster(tmp_path):
    with silent_listener() as address:
        proc = run_child(address, tmp_path)
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "events.jsonl").exists():  # the run has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(2)  # joining the cluster now (ray.init in its thread)
        proc.terminate()
        code, err, seconds = finish(proc, 30)
    assert code == 143, err
    assert seconds < 15 and "terminated" in err


def tagged(token: str) -> list[int]:
    """Live processes whose environment holds `token` (Ray's own, its actors, the workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if token.encode() in fh.read() and alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_sigterm_stops_a_run_on_a_private_cluster_like_a_local_run(tmp_path):
    """ray.init puts in a SIGTERM handler of its own (sys.exit); the run's is put back, so SIGTERM
    stops the run the usual way: 143, model/ written, the cluster and every worker gone."""
    token = f"ray-sigterm-{os.getpid()}-{time.monotonic_ns()}"
    sets = [arg for kv in [*TINY, "run.max_steps=100000", "ray.address=local", "trainer.bf16=false",
                           "rollout.group_size=2", "trainer.batch_size=4"] for arg in ("--set", kv)]
    proc = subprocess.Popen([sys.executable, "-m", "areal_aio", "run", SETTINGS, *sets, "--out", str(tmp_path / "run")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "AREAL_AIO_TEST_TAG": token})
    steps = tmp_path / "run" / "steps.jsonl"
    deadline = time.monotonic() + 120
    while not steps.exists() or not steps.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.terminate()
    code, err, seconds = finish(proc, 60)
    assert code == 143, err
    assert (tmp_path / "run" / "model" / "config.json").exists()
    deadline = time.monotonic() + 20
    while (left := tagged(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left
