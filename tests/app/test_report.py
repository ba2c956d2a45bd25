"""The report: run folders (finished, in progress, made by the controller) into PNGs and report.md."""

from __future__ import annotations

import itertools

import orjson
import pytest

from areal_aio.app import cli
from areal_aio.app.report import default_out, figures, read_run, read_runs
from tests.conftest import make_settings, orchestrator

STEPS = 6
STALENESS = [0, 1, 1, 2]  # of each step's four samples
STEP_S = 0.02
"""A fake training step's seconds in the busy-time check: long next to the 0.1 ms event times keep."""


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def write_run(folder, mode: str, *, finished: bool, steps: int = STEPS) -> dict:
    """A run folder with rows in the formats the controller writes (field for field).

    Events clock: workers ready at t = 2.0, so run time = t - 2. Step k trains from
    run time k - 0.5 to k (trainer busy) and the rollout worker is busy from k - 1 to k - 0.5."""
    folder.mkdir(parents=True)
    (folder / "settings.toml").write_text(make_settings(mode).to_toml())
    step_rows, samples, events, evals = [], [], [], []
    events += [{"event": "worker_ready", "role": role, "pid": 1, "load_s": 1.0, "device": "cpu", "t": t}
               for role, t in (("rollout", 1.9), ("trainer", 2.0))]
    for k in range(1, steps + 1):
        events += [{"event": "busy", "worker": "rollout", "busy": True, "t": 2.0 + k - 1},
                   {"event": "busy", "worker": "rollout", "busy": False, "t": 2.0 + k - 0.5},
                   {"event": "busy", "worker": "trainer", "busy": True, "t": 2.0 + k - 0.5}]
        if finished or k < steps:  # an unfinished run is mid-step: the trainer is still busy
            events += [{"event": "busy", "worker": "trainer", "busy": False, "t": 2.0 + k},
                       {"event": "version_commit", "version": k, "step": k, "t": 2.0 + k},
                       {"event": "queues", "in_flight": 4, "replay_groups": k % 3, "pending_groups": 1,
                        "live": 4 * k, "version": k, "t": 2.0 + k}]
            step_rows.append({
                "step": k, "version": k, "wall_s": float(k), "train_s": 0.5, "wait_s": 0.5,
                "reward_mean": k / 10, "pass_rate": k / 12, "strict_rate": k / 20, "staleness_max": 2,
                "staleness_mean": 1.0, "replay_groups": 0, "in_flight": 4, "gen_tokens_per_s": 100.0,
                "train_tokens_per_s": 50.0, "loss": 1.0 / k, "entropy": 2.0 - k / 10, "clip_frac": 0.0,
                "grad_norm": 1.0, "tokens": 16, "seqs": 4, "mismatch_kl": None, "seconds": 0.4,
                **({"spread_frac": 1 / k} if k > 1 else {})})  # the first row as an older run writes it
            samples += [{"kind": "train", "request_id": f"g{k}.{i}", "group": k, "task_id": f"t{k}",
                         "prompt": "1 + 1?", "answer": "2", "reply": "2", "reward": 1.0, "pass": True,
                         "strict": False, "reward_failed": False, "oldest_version": k - 1 - st,
                         "newest_version": k - 1, "staleness": st, "interrupts": 0, "retries": 0,
                         "dropped": None, "step": k, "tokens": 4} for i, st in enumerate(STALENESS)]
        if k % 2 == 0 or k == 1:
            row = {"step": k - 1, "version": k - 1, "wall_s": float(k - 1), "done_s": k - 0.9,
                   "pass_rate": (k - 1) / 10, "strict_rate": (k - 1) / 20, "reward_mean": 0.5,
                   "versions": [k - 1, k - 1]}
            evals.append(row)
            events.append({"event": "eval", **row, "t": 2.0 + k - 0.9})
    (folder / "steps.jsonl").write_bytes(jsonl(step_rows))
    (folder / "samples.jsonl").write_bytes(jsonl(samples))
    (folder / "events.jsonl").write_bytes(jsonl(events))
    if finished:
        (folder / "summary.json").write_bytes(orjson.dumps({
            "mode": mode, "max_staleness": 0 if mode == "sync" else 4, "steps": steps,
            "final_version": steps, "wall_s": steps + 0.2, "eval_curve": evals, "error": None,
            "time_to_threshold_s": None, "rollout_idle_frac": 0.5, "trainer_idle_frac": 0.5}))
    else:  # the writer is mid-line
        with open(folder / "steps.jsonl", "ab") as fh:
            fh.write(b'{"step": 6, "version": 6, "wall_')
        with open(folder / "events.jsonl", "ab") as fh:
            fh.write(b'{"event": "queu')
    return {"evals": evals, "steps": step_rows}


@pytest.fixture
def two_runs(tmp_path):
    done = write_run(tmp_path / "sync-done", "sync", finished=True)
    running = write_run(tmp_path / "areal-running", "areal", finished=False)
    return tmp_path, done, running


def test_a_run_in_progress_reads_as_far_as_it_was_written(two_runs):
    root, _, written = two_runs
    run = read_run(root / "areal-running")
    assert run.summary is None and run.state == "in progress" and run.mode == "areal"
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4, 5]
    assert run.unreadable == 2  # the half-written last lines of steps.jsonl and events.jsonl
    assert run.evals == written["evals"]  # from the eval events, there being no summary
    assert run.start_t == 2.0
    # the trainer's last stretch is still open: drawn to the last event seen (run time 5.1)
    assert run.busy_intervals("trainer")[-1] == pytest.approx((5.5, 0.0))
    assert run.busy_intervals("trainer")[:2] == [(0.5, 0.5), (1.5, 0.5)]
    assert run.busy_intervals("rollout")[:2] == [(0.0, 0.5), (1.0, 0.5)]


def test_report_command_writes_the_pictures_and_a_page_naming_every_run(two_runs, capsys):
    root, _, _ = two_runs
    assert cli.main(["report", str(root / "sync-done"), str(root / "areal-running"),
                     "--out", str(root / "out")]) == 0
    assert "report.md" in capsys.readouterr().out
    text = (root / "out" / "report.md").read_text()
    for name in ("eval", "training", "staleness", "timeline", "queues"):
        png = root / "out" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name}.png)" in text
    assert "| sync-done (sync) | completed | 0 | 6 | 6 | 6.2 |" in text
    assert "| areal-running (areal) | in progress | 4 | 5 | 5 | 5.0 |" in text
    assert "2 JSONL line(s) could not be read" in text


def test_eval_figure_overlays_runs_against_wall_time_and_steps(two_runs):
    root, done, running = two_runs
    fig = figures(read_runs([root / "sync-done", root / "areal-running"]))["eval"]
    axes = fig.axes
    assert [ax.get_xlabel().split()[0] for ax in axes] == ["wall", "wall", "step", "step"]
    assert [ax.get_ylabel() for ax in axes] == ["held-out pass rate", "held-out strict rate"] * 2
    for ax in axes:
        assert [line.get_label() for line in ax.get_lines()] == ["sync-done (sync)", "areal-running (areal)"]
    pass_by_step = axes[2].get_lines()
    assert list(pass_by_step[0].get_xdata()) == [r["step"] for r in done["evals"]]
    assert list(pass_by_step[0].get_ydata()) == [r["pass_rate"] for r in done["evals"]]
    strict_by_wall = axes[1].get_lines()[1]
    assert list(strict_by_wall.get_xdata()) == [r["wall_s"] for r in running["evals"]]
    assert list(strict_by_wall.get_ydata()) == [r["strict_rate"] for r in running["evals"]]


def test_training_staleness_timeline_and_queue_figures_plot_the_rows(two_runs):
    root, done, _ = two_runs
    figs = figures(read_runs([root / "sync-done", root / "areal-running"]))
    reward, entropy, loss, spread = figs["training"].axes
    assert [ax.get_ylabel().split()[0] for ax in (reward, entropy, loss, spread)] == [
        "reward", "entropy", "loss", "groups"]
    assert list(entropy.get_lines()[0].get_ydata()) == [r["entropy"] for r in done["steps"]]
    assert list(spread.get_lines()[0].get_xdata()) == [r["step"] for r in done["steps"][1:]]
    assert len(reward.get_lines()[1].get_xdata()) == 5  # the unfinished run: 5 whole rows

    ax = figs["staleness"].axes[0]
    bars = ax.patches
    assert len(bars) == 2 * 3  # two runs, staleness 0, 1, 2
    heights = sorted(round(b.get_height(), 3) for b in bars[:3])
    assert heights == [0.25, 0.25, 0.5]  # shares of STALENESS = [0, 1, 1, 2]

    timeline = figs["timeline"].axes
    assert [t.get_text() for t in timeline[0].get_yticklabels()] == ["rollout", "trainer"]
    bars = {c.get_label(): c for c in timeline[0].collections}
    assert [len(bars[w].get_paths()) for w in ("rollout", "trainer")] == [STEPS, STEPS]

    queues = figs["queues"].axes
    assert len(queues) == 3  # one per run, then the version commits of both
    assert [line.get_label() for line in queues[0].get_lines()] == ["in_flight", "replay_groups",
                                                                  "pending_groups"]
    versions = queues[-1].get_lines()
    assert list(versions[0].get_ydata()) == list(range(STEPS + 1))
    assert list(versions[1].get_ydata()) == list(range(STEPS))  # step 6 not committed yet


def test_runs_with_the_same_folder_name_are_told_apart(tmp_path):
    write_run(tmp_path / "a" / "run", "sync", finished=True)
    write_run(tmp_path / "b" / "run", "sync", finished=True)
    assert [r.label for r in read_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"])] == \
        ["a/run (sync)", "b/run (sync)"]


async def test_report_on_a_run_the_controller_wrote(tmp_path):
    """The controller's own rows (fake workers): every figure has data, busy events included: they
    give each worker's stretches of work, in order, never overlapping, adding up to the busy time
    behind the summary's idle fraction, and the timeline draws each."""
    from areal_aio.fleet.fakes import FakeTrainer

    settings = make_settings("areal", **{"run.max_steps": 4})
    summary = await orchestrator(tmp_path, settings, trainer=FakeTrainer(step_delay_s=STEP_S)).run()
    run = read_run(tmp_path / "run")
    assert run.state == "completed" and len(run.steps) == 4 and run.unreadable == 0
    assert [r["step"] for r in run.evals] == [0, 2, 4]
    assert len(run.staleness) == 16
    figs = figures([run])
    drawn = {c.get_label(): len(c.get_paths()) for c in figs["timeline"].axes[0].collections}
    for worker in ("trainer", "rollout"):
        stretches = run.busy_intervals(worker)
        assert stretches and drawn[worker] == len(stretches), worker
        assert all(start + length <= after for (start, length), (after, _) in itertools.pairwise(stretches)), worker
        busy_s = (1 - summary[f"{worker}_idle_frac"]) * summary["wall_s"]
        # event times are kept to 0.1 ms, wall_s to 1 ms
        assert abs(sum(length for _, length in stretches) - busy_s) < 2e-3 + 2e-4 * len(stretches), worker
    assert sum(length >= 0.95 * STEP_S for _, length in run.busy_intervals("trainer")) >= 4  # each step's
    assert len(figs["training"].axes[0].get_lines()[0].get_xdata()) == 4
    assert list(figs["queues"].axes[-1].get_lines()[0].get_ydata()) == [0, 1, 2, 3, 4]


async def test_an_interrupted_run_reads_as_interrupted_not_failed(tmp_path):
    """Its summary says how it ended (`ended`); a summary from before `ended` says it by its error."""
    import asyncio

    from areal_aio.fleet.fakes import FakeTrainer

    orch = orchestrator(tmp_path, make_settings("areal", **{"run.max_steps": 1000}),
                        trainer=FakeTrainer(step_delay_s=0.005))
    task = asyncio.create_task(orch.run())
    while orch.step < 2:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    run = read_run(tmp_path / "run")
    assert run.state == "interrupted"
    assert "| run (areal) | interrupted |" in (cli.main(["report", str(tmp_path / "run")]) == 0
                                                and (tmp_path / "run" / "report" / "report.md").read_text())
    for summary, state in (({"error": "CancelledError"}, "interrupted"), ({"error": None}, "completed"),
                           ({"error": "boom"}, "failed: boom"),
                           ({"ended": "failed: trainer worker failed: exited with code -9", "error": "x"},
                            "failed: trainer worker failed: exited with code -9")):
        (tmp_path / "run" / "summary.json").write_bytes(orjson.dumps(summary))
        assert read_run(tmp_path / "run").state == state


def test_report_folder_defaults_and_a_folder_that_is_not_a_run(two_runs, capsys):
    root, _, _ = two_runs
    assert default_out([root / "sync-done"]) == root / "sync-done" / "report"
    assert default_out([root / "sync-done", root / "areal-running"]).parent == root
    (root / "empty").mkdir()
    assert cli.main(["report", str(root / "empty")]) == 2
    assert "not a run folder" in capsys.readouterr().err
