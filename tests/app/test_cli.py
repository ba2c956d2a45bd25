"""The command line (app/cli.py) as a user runs it, in a child process on the fake workers: a run
piped into a reader that goes away (`| tee` ended by the same Ctrl-C, `| head`), and a resume the
trainer refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from tests.conftest import ROOT

CLI_ON_FAKES = """
import sys
from areal_aio.fleet import fakes, placement
from areal_aio.fleet.client import WorkerFailed

class Trainer(fakes.FakeTrainer):
    async def start(self, init):
        if init.resume and REFUSE:  # as the real trainer answers an adapter on another base
            raise WorkerFailed("trainer", "ValueError: resume: the checkpoint's adapter was trained on "
                               "the base b (weights sha256 5a4139d9b177), this trainer loaded b "
                               "(sha256 e7d037529f03); an adapter resumes only on its own base", "Traceback")
        return await super().start(init)

REFUSE = sys.argv.pop(1) == "refuse"
placement.rollout_client = lambda settings, folder: fakes.FakeRollout(token_delay_s=0.002)
placement.trainer_client = lambda settings, folder: Trainer(step_delay_s=0.5)
from areal_aio.app.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""`python -m areal_aio` as it is, on the fake workers (a trainer step takes half a second)."""
FAKE_RUN = ["model.path=embedded:tiny-random", "sft.before_run=off", "rollout.group_size=2", "trainer.batch_size=4",
            "task.eval_size=4", "task.eval_every=1000", "controller.reward_procs=0", "run.progress=true"]


def cli_on_fakes(*args: str, refuse: bool = False, **streams) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLI_ON_FAKES, "refuse" if refuse else "-", *args],
                            cwd=ROOT, **streams)


def run_on_fakes(folder: Path, max_steps: int, *sets: str, **streams) -> subprocess.Popen:
    sets = [arg for kv in [*FAKE_RUN, f"run.max_steps={max_steps}", *sets] for arg in ("--set", kv)]
    return cli_on_fakes("run", str(ROOT / "settings.toml"), *sets, "--out", str(folder), **streams)


def events(folder: Path) -> list[dict]:
    return [orjson.loads(x) for x in (folder / "events.jsonl").read_bytes().splitlines()]


def test_ctrl_c_on_a_run_piped_into_tee_keeps_the_model_and_the_checkpoint(tmp_path):
    """`run ... 2>&1 | tee run.txt`, Ctrl-C: the terminal's SIGINT ends tee too, so every line the
    stop prints (the step it commits, the one-line ending) meets a pipe with no reader."""
    read, write = os.pipe()
    proc = run_on_fakes(tmp_path / "run", 100_000, stdout=write, stderr=write)
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
    proc = run_on_fakes(tmp_path / "run", 2, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"Exception ignored" not in err
    assert "run folder:" in (tmp_path / "run" / "console.log").read_text()


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_the_trainer_refuses_exits_2_and_leaves_the_run_as_it_was(tmp_path):
    folder = tmp_path / "run"
    done = run_on_fakes(folder, 2, "run.checkpoint_every=1", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert done.wait(timeout=60) == 0, done.stderr.read()
    with open(folder / "steps.jsonl", "ab") as fh:  # a row after the last checkpoint: a resume cuts it
        fh.write(b'{"step": 3}\n')
    before = files(folder)
    refused = cli_on_fakes("run", "--resume", str(folder), "--set", "run.max_steps=4", refuse=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = refused.communicate(timeout=60)
    assert refused.returncode == 2, err.decode()
    assert err.decode().strip().splitlines() == [
        f"error: cannot resume {folder}: the checkpoint's adapter was trained on the base b (weights sha256 "
        f"5a4139d9b177), this trainer loaded b (sha256 e7d037529f03); an adapter resumes only on its own base"]
    assert files(folder) == before  # summary.json, rows, events, settings, logs, lock: byte for byte
