"""A command that owns its process (app/runner.py): the first Ctrl-C or SIGTERM stops the job,
later ones do not cut its cleanup short. Each case runs in a child process: the signals are real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import orjson
import pytest

from tests.conftest import ROOT

JOB = """
import asyncio, os, signal, sys
from areal_aio.app.runner import run_owned

FIRST, LATER = signal.{first}, [signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT]

async def job():
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, os.kill, os.getpid(), FIRST)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        for i, sig in enumerate(LATER):  # the user presses Ctrl-C again, a supervisor sends SIGTERM
            loop.call_later(0.05 * (i + 1), os.kill, os.getpid(), sig)
        await asyncio.sleep(0.5)  # the cleanup: stopping workers, writing model/
        print("cleanup finished", flush=True)
        raise

try:
    run_owned(job())
except BaseException as exc:
    print("raised", type(exc).__name__, flush=True)
print("later signals ignored", signal.getsignal(signal.SIGINT) == signal.SIG_IGN
      and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True)
"""


@pytest.mark.parametrize("first,raised", [("SIGTERM", "CancelledError"), ("SIGINT", "KeyboardInterrupt")])
def test_signals_after_the_first_do_not_cut_the_cleanup_short(first, raised):
    done = subprocess.run([sys.executable, "-c", JOB.format(first=first)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == ["cleanup finished", f"raised {raised}"], done.stdout + done.stderr
    assert done.stderr.count("already stopping") == 4 and "Traceback" not in done.stderr
    # the process is ending: after run_owned a late signal must not kill it before its exit code
    assert done.stdout.splitlines()[2:] == ["later signals ignored True"], done.stdout


GC_JOB = """
import asyncio, gc
from areal_aio.app.runner import YOUNG_GC_THRESHOLD, run_owned

async def job():
    return gc.get_threshold()

async def failing():
    raise ValueError("the job failed")

before = gc.get_threshold()
during = run_owned(job())
print(before[0] < YOUNG_GC_THRESHOLD, during == (YOUNG_GC_THRESHOLD, *before[1:]), gc.get_threshold() == before)
try:
    run_owned(failing())
except ValueError:
    print("restored after a failure", gc.get_threshold() == before)
"""


def test_the_young_generation_is_collected_less_often_only_while_the_job_runs():
    done = subprocess.run([sys.executable, "-c", GC_JOB], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True True True", "restored after a failure True"], done.stdout + done.stderr


CLI_ON_FAKES = """
import sys
from areal_aio.fleet import fakes, placement
placement.rollout_client = lambda settings, folder: fakes.FakeRollout(token_delay_s=0.002)
placement.trainer_client = lambda settings, folder: fakes.FakeTrainer(step_delay_s=0.5)
from areal_aio.app.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""`python -m areal_aio run` as it is, on the fake workers: a run of steps in a second."""
FAKE_RUN = ["model.path=embedded:tiny-random", "rollout.group_size=2", "trainer.batch_size=4",
            "task.eval_size=4", "task.eval_every=1000", "controller.reward_procs=0", "run.progress=true"]


def cli_on_fakes(folder, max_steps: int, **streams) -> subprocess.Popen:
    sets = [arg for kv in [*FAKE_RUN, f"run.max_steps={max_steps}"] for arg in ("--set", kv)]
    return subprocess.Popen([sys.executable, "-c", CLI_ON_FAKES, "run", str(ROOT / "settings.toml"), *sets,
                             "--out", str(folder)], cwd=ROOT, **streams)


def events(folder) -> list[dict]:
    return [orjson.loads(x) for x in (folder / "events.jsonl").read_bytes().splitlines()]


def test_ctrl_c_on_a_run_piped_into_tee_keeps_the_model_and_the_checkpoint(tmp_path):
    """`run ... 2>&1 | tee run.txt`, Ctrl-C: the terminal's SIGINT ends tee too, so every line the
    stop prints (the step it commits, the one-line ending) meets a pipe with no reader."""
    read, write = os.pipe()
    proc = cli_on_fakes(tmp_path / "run", 100_000, stdout=write, stderr=write)
    os.close(write)
    seen, deadline = b"", time.time() + 60
    while b"\n" not in seen.partition(b"step 2/")[2]:  # tee showed two steps, a third is in flight
        assert time.time() < deadline and proc.poll() is None, seen
        seen += os.read(read, 4096)
    os.close(read)  # tee ends ...
    proc.send_signal(signal.SIGINT)  # ... with the run's Ctrl-C: the stop commits that step
    code = proc.wait(timeout=60)
    folder = tmp_path / "run"
    assert [e for e in events(folder) if e["event"] == "keep_failed"] == []
    assert code == 130
    summary = orjson.loads((folder / "summary.json").read_bytes())
    model = orjson.loads((folder / "model" / "config.json").read_bytes())  # the fake trainer's export
    assert summary["ended"] == "interrupted" and model["version"] == summary["final_version"] >= 2
    assert (folder / "checkpoints").is_dir()
    assert "interrupted; workers stopped" in (folder / "console.log").read_text()


def test_a_run_whose_stdout_reader_is_gone_still_ends_with_exit_0(tmp_path):
    """`run ... | head -1`: the summary the run prints at its end meets a closed pipe, and Python's
    own flush at exit would make that exit code 120."""
    read, write = os.pipe()
    os.close(read)
    proc = cli_on_fakes(tmp_path / "run", 2, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"Exception ignored" not in err
    assert "run folder:" in (tmp_path / "run" / "console.log").read_text()
