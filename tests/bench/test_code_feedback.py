"""bench/code_feedback.sh end to end on tiny-random: every HumanEval problem gets its episode, and
the summary counts passes by reply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT as REPO


@pytest.mark.slow
def test_smoke_run_summarizes_every_problem_by_reply(tmp_path):
    env = dict(os.environ, MODEL="embedded:tiny-random", MAX_NEW="16",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = subprocess.run(["bash", "bench/code_feedback.sh", str(tmp_path), "2"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "code_feedback.json").read_text())
    assert summary["command"] == "bash bench/code_feedback.sh OUT 2" and summary["model"] == "embedded:tiny-random"
    assert summary["provenance"]["command"] == \
        f"MODEL='embedded:tiny-random' MAX_NEW='16' bash bench/code_feedback.sh '{tmp_path}' '2'"
    assert summary["problems"] == 164 and summary["turns"] == 2 and summary["max_new_tokens"] == 16
    assert list(summary["passed_by_reply"]) == ["1", "2"] and summary["episode_failures"] == 0
    # a reply that fails gets the feedback and a second reply: tiny-random never passes, so each has 2
    assert summary["passed_by_reply"] == {"1": 0, "2": 0} and summary["replies_mean"] == 2.0
    eval_rows = json.loads((tmp_path / "eval.json").read_text())["samples"]
    assert len(eval_rows) == 164  # each: a reply, the feedback on its failure, the second reply
    assert all([t["role"] for t in r["turns"]] == ["assistant", "user", "assistant"] for r in eval_rows)
