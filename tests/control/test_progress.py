"""The live line (terminal and not) and the completions log."""

from __future__ import annotations

import io

import pytest

from areal_aio import wire
from areal_aio.control.groups import Sample
from areal_aio.control.progress import CONSOLE_LOG, Progress, pick
from areal_aio.rewards.scoring import Score
from areal_aio.tasks.task import Task
from tests.conftest import make_settings, orchestrator


def step_row(step: int, **kw) -> dict:
    row = {"step": step, "version": step, "wall_s": 2.0 * step, "reward_mean": 0.25, "loss": 0.0125,
           "staleness_mean": 1.5, "staleness_max": 3, "gen_tokens_per_s": 812.4,
           "train_tokens_per_s": 95.6}
    return {**row, **kw}


def sample(group: int, i: int, reward: float, versions: list[int]) -> Sample:
    s = Sample(f"g{group}.{i}", group, Task(f"t{group}", f"What is {group} + {group}?", str(2 * group)))
    s.completion = wire.Completion(s.request_id, [1], [2] * len(versions), [-0.1] * len(versions),
                                   versions, f"reply {group}.{i}", "stop", 0, 0.1)
    s.score = Score(reward, reward > 0)
    return s


def test_off_a_terminal_each_step_is_one_plain_line(tmp_path):
    out = io.StringIO()
    evals = [{"step": 0, "pass_rate": 0.125, "strict_rate": 0.0}]
    line = Progress(10, tmp_path, evals=evals, stream=out)
    assert not line.terminal
    line.step(step_row(1))
    line.refresh()  # nothing between steps off a terminal
    evals.append({"step": 2, "pass_rate": 0.5, "strict_rate": 0.25})
    line.step(step_row(2, reward_mean=0.75))
    line.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == [
        "step 1/10 v1 | reward 0.250 | eval 0.12/0.00 | loss 0.0125 | stale 1.5/3 | gen 812 tok/s train 96 tok/s | 2s",
        "step 2/10 v2 | reward 0.750 | eval 0.50/0.25 | loss 0.0125 | stale 1.5/3 | gen 812 tok/s train 96 tok/s | 4s"]


def test_on_a_terminal_one_bar_is_redrawn(tmp_path):
    out = io.StringIO()
    line = Progress(10, tmp_path, stream=out, terminal=True)
    line.console.width = 160  # a StringIO has no size; rich would assume 80 columns and cut the line
    assert line.terminal
    line.refresh()
    line.step(step_row(1))
    line.step(step_row(2, reward_mean=0.5))
    line.close()
    text = out.getvalue()
    assert "reward 0.500" in text and "2/10" in text and "gen 812 tok/s" in text
    assert text.count("\n") == 1 and text.count("\r") >= 2  # one line, redrawn in place


def test_quiet_prints_nothing(tmp_path):
    out = io.StringIO()
    line = Progress(10, tmp_path, show=False, stream=out, completions_every=1)
    line.step(step_row(1), [sample(0, 0, 1.0, [0])])
    assert out.getvalue() == ""
    assert "reply 0.0" in (tmp_path / "completions.md").read_text()  # the file is kept all the same


def test_pick_shows_each_groups_best_and_worst():
    samples = [sample(g, i, reward, [g, g + 1] if i else [g]) for g in range(5)
               for i, reward in enumerate([0.0, 1.2, 1.0])]
    samples.append(sample(9, 0, 1.0, [9]))
    rows = pick(samples)
    assert [(r["group"], r["reward"], r["versions"]) for r in rows] == [
        (0, 1.2, "0-1"), (0, 0.0, "0"), (1, 1.2, "1-2"), (1, 0.0, "1"), (2, 1.2, "2-3"), (2, 0.0, "2")]
    same = [sample(0, i, 1.0, [0]) for i in range(3)]
    assert len(pick(same)) == 1  # a group whose replies all score alike shows one


def test_completions_go_to_the_console_and_the_file(tmp_path):
    out = io.StringIO()
    line = Progress(10, tmp_path, stream=out, completions_every=2)
    batch = [sample(1, 0, 1.2, [1]), sample(1, 1, 0.0, [0, 1])]
    line.step(step_row(1), batch)
    assert not (tmp_path / "completions.md").exists()  # not due yet
    line.step(step_row(2), batch)
    printed = out.getvalue()
    assert "step 2 (version 2): completions" in printed
    assert "[1.20 v1] 'What is 1 + 1?' -> 'reply 1.0'" in printed
    md = (tmp_path / "completions.md").read_text()
    assert md.startswith("## step 2 (version 2, reward mean 0.250)")
    assert "| 1 | What is 1 + 1? | 2 | reply 1.1 | 0.000 | 0-1 |" in md


def test_terminal_completions_are_a_table(tmp_path):
    out = io.StringIO()
    line = Progress(10, tmp_path, stream=out, terminal=True, completions_every=1)
    line.step(step_row(1), [sample(3, 0, 1.0, [1])])
    line.close()
    text = out.getvalue()
    assert "prompt" in text and "reply 3.0" in text and "versions" in text and "┃" in text


async def test_the_controller_prints_a_line_per_step_and_logs_completions(tmp_path, capsys):
    settings = make_settings("areal", **{"run.max_steps": 4, "run.progress": True,
                                         "run.log_completions_every": 2})
    await orchestrator(tmp_path, settings).run()
    err = capsys.readouterr().err
    assert [line.split()[1] for line in err.splitlines() if line.startswith("step ") and "|" in line] == \
        ["1/4", "2/4", "3/4", "4/4"]
    assert err.count("completions") == 2
    md = (tmp_path / "run" / "completions.md").read_text()
    assert md.count("## step") == 2 and "## step 4 " in md


class Gone(io.StringIO):
    """A console whose reader is gone: `run | tee` after the Ctrl-C that ended tee."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("terminal", [False, True])
def test_a_console_that_is_gone_is_let_go_and_its_lines_go_to_the_run_folder(tmp_path, terminal):
    line = Progress(10, tmp_path, stream=Gone(), terminal=terminal, completions_every=1)
    line.step(step_row(1), [sample(0, 0, 1.0, [0]), sample(0, 1, 0.0, [0])])  # never raises
    line.refresh()
    line.step(step_row(2), [sample(1, 0, 1.0, [1])])
    line.close()
    assert line.gone
    if not terminal:  # the bar is not a line to keep; the plain lines are
        kept = (tmp_path / CONSOLE_LOG).read_text()
        assert "step 1/10" in kept and "step 2/10" in kept and "step 2 (version 2): completions" in kept
    assert "reply 1.0" in (tmp_path / "completions.md").read_text()
