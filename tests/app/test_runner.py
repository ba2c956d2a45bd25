"""A command that owns its process (app/runner.py): the first Ctrl-C or SIGTERM stops the job,
later ones do not cut its cleanup short. Each case runs in a child process: the signals are real."""

from __future__ import annotations

import subprocess
import sys

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
