"""The run-grid benchmarks (time to threshold, staleness ablation) and the controller overhead bench:
their pure aggregation on hand-made summaries, the resumable grid on fake workers, and the
--quick presets end to end."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from areal_aio.app import runner
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.settings import load_settings
from areal_aio.tasks.arithmetic import arithmetic_prompt
from areal_aio.tasks.task import Task
from bench import controller_overhead, staleness_ablation, time_to_threshold
from bench.common import Cell, finished_summary, run_grid, stats
from tests.conftest import ROOT as REPO


def summary(ttt: float | None, final: float = 0.5, initial: float = 0.1, **extra) -> dict:
    return {"time_to_threshold_s": ttt, "error": None, "wall_s": 100.0, "steps": 10,
            "eval_curve": [{"step": 10, "wall_s": 90.0, "pass_rate": final},
                           {"step": 0, "wall_s": 0.0, "pass_rate": initial}],
            "reward_per_1k_tokens": 2.0, "gen_tokens_per_s": 50.0, "train_tokens_per_s": 20.0,
            "rollout_idle_frac": 0.1, "trainer_idle_frac": 0.5, "max_staleness_trained": 1, **extra}


def record(mode: str, seed: int, ttt: float | None, objective: str = "decoupled_ppo", **kw) -> dict:
    return {"mode": mode, "objective": objective, "seed": seed, "cell": f"{mode}-{objective}-s{seed}",
            "status": "ran", "summary": summary(ttt, **kw)}


# ---------------------------------------------------------------------- pure aggregation


def test_time_to_threshold_aggregate_speedup_spread_and_reached():
    records = [record("sync", 0, 100.0), record("sync", 1, 120.0), record("sync", 2, None),
               record("areal", 0, 50.0, final=0.8), record("areal", 1, None, final=0.6),
               record("areal", 2, 40.0, final=0.7),
               record("one_step", 0, None), record("one_step", 1, None), record("one_step", 2, None)]
    failed = record("areal", 3, 10.0)
    failed["status"], failed["summary"]["error"] = "failed", "WorkerFailed: boom"
    agg = time_to_threshold.aggregate([*records, failed])
    g = agg["groups"]
    assert set(g) == {"sync/decoupled_ppo", "areal/decoupled_ppo", "one_step/decoupled_ppo"}
    areal = g["areal/decoupled_ppo"]
    assert areal["time_to_threshold_s"] == {"0": 50.0, "1": None, "2": 40.0}
    assert (areal["reached"], areal["n_runs"]) == (2, 3)
    assert (areal["ttt_mean"], areal["ttt_min"], areal["ttt_max"]) == (45.0, 40.0, 50.0)
    # only seed 0 reached in both sync and areal: 100 / 50
    assert areal["speedup_vs_sync"] == pytest.approx(2.0) and areal["speedup_seeds"] == [0]
    assert areal["final_pass_mean"] == pytest.approx(0.7) and areal["initial_pass_mean"] == pytest.approx(0.1)
    assert areal["baseline"] == "sync/decoupled_ppo"
    sync = g["sync/decoupled_ppo"]
    assert sync["speedup_vs_sync"] == pytest.approx(1.0) and sync["speedup_seeds"] == [0, 1]
    assert sync["reached"] == 2 and sync["ttt_mean"] == pytest.approx(110.0)
    none = g["one_step/decoupled_ppo"]
    assert none["reached"] == 0 and none["ttt_mean"] is None and none["speedup_vs_sync"] is None
    assert none["speedup_seeds"] == []
    assert agg["failed"] == [{"cell": "areal-decoupled_ppo-s3", "error": "WorkerFailed: boom"}]
    assert "both" in agg["speedup_rule"]
    json.dumps(agg)  # results.json-ready


def test_speedup_falls_back_to_the_only_sync_objective_and_never_divides_by_zero():
    agg = time_to_threshold.aggregate([record("sync", 0, 60.0, objective="ppo"),
                                       record("areal", 0, 30.0), record("one_step", 0, 0.0, objective="ppo")])
    assert agg["groups"]["areal/decoupled_ppo"]["baseline"] == "sync/ppo"
    assert agg["groups"]["areal/decoupled_ppo"]["speedup_vs_sync"] == pytest.approx(2.0)
    assert agg["groups"]["one_step/ppo"]["speedup_vs_sync"] is None  # reached at step 0
    no_sync = time_to_threshold.aggregate([record("areal", 0, 30.0)])
    assert no_sync["groups"]["areal/decoupled_ppo"]["speedup_vs_sync"] is None


def test_lower_thresholds_are_read_off_the_eval_curve():
    # summary(): step 0 at 0.1, step 10 (90 s) at the final rate
    agg = time_to_threshold.aggregate([record("sync", 0, None, final=0.4), record("areal", 0, None, final=0.6)], 0.3)
    assert agg["groups"]["sync/decoupled_ppo"]["time_to_threshold_s"] == {"0": 90.0}
    assert agg["groups"]["areal/decoupled_ppo"]["speedup_vs_sync"] == pytest.approx(1.0)
    assert time_to_threshold.time_at(summary(None, final=0.4, initial=0.1), 0.05) == 0.0
    assert time_to_threshold.time_at(summary(None, final=0.4), 0.5) is None


def test_stats_ignores_missing_values():
    assert stats([None, 2.0, 4.0]) == {"mean": 3.0, "min": 2.0, "max": 4.0}
    assert stats([None]) == {"mean": None, "min": None, "max": None}


def test_time_to_threshold_cells_name_the_resolved_objective():
    settings = REPO / "settings.toml"
    own = time_to_threshold.cells(["sync", "areal"], [None], [0, 1], settings, [])
    assert [c.name for c in own] == ["sync-decoupled_ppo-s0", "areal-decoupled_ppo-s0",
                                     "sync-decoupled_ppo-s1", "areal-decoupled_ppo-s1"]
    chosen = time_to_threshold.cells(["areal"], ["ppo"], [2], settings, [])
    assert chosen[0].name == "areal-ppo-s2" and "trainer.objective=ppo" in chosen[0].overrides
    assert time_to_threshold.cells(["sync"], [None], [0], settings, ["trainer.objective=pg"])[0].name == "sync-pg-s0"


def test_staleness_aggregate_orders_etas_and_relates_throughput_to_eta0():
    def rec(eta: int, objective: str, seed: int, final: float, tps: float) -> dict:
        return {"eta": eta, "objective": objective, "seed": seed, "cell": f"eta{eta}-{objective}-s{seed}",
                "status": "ran", "summary": summary(None, final=final, train_tokens_per_s=tps,
                                                    max_staleness_trained=max(eta, 0))}

    records = [rec(-1, "ppo", 0, 0.2, 40.0), rec(0, "ppo", 0, 0.6, 10.0), rec(0, "ppo", 1, 0.4, 12.0),
               rec(4, "ppo", 0, 0.5, 30.0), rec(0, "decoupled_ppo", 0, 0.6, 11.0)]
    agg = staleness_ablation.aggregate(records)
    rows = [(r["objective"], r["eta_label"]) for r in agg["rows"]]
    assert rows == [("decoupled_ppo", "0"), ("ppo", "0"), ("ppo", "4"), ("ppo", "inf")]
    ppo0 = agg["rows"][1]
    assert ppo0["final_pass_mean"] == pytest.approx(0.5) and ppo0["final_pass_min"] == 0.4
    assert ppo0["train_tokens_per_s"] == pytest.approx(11.0) and ppo0["throughput_vs_eta0"] == pytest.approx(1.0)
    assert agg["rows"][3]["throughput_vs_eta0"] == pytest.approx(40.0 / 11.0)
    assert staleness_ablation.parse_eta("unbounded") == -1 == staleness_ablation.parse_eta("-1")
    grid = staleness_ablation.cells([0, -1], ["ppo"], [0], unbounded_as=40)
    assert [c.name for c in grid] == ["eta0-ppo-s0", "etainf-ppo-s0"]
    pairs = staleness_ablation.cells([0, 4], ["ppo", "decoupled_ppo"], [0])
    assert [c.name for c in pairs] == ["eta0-ppo-s0", "eta0-decoupled_ppo-s0", "eta4-ppo-s0",
                                       "eta4-decoupled_ppo-s0"]
    assert "controller.max_staleness=40" in grid[1].overrides and grid[1].labels["eta"] == -1
    assert "controller.max_staleness=-1" in staleness_ablation.cells([-1], ["ppo"], [0])[0].overrides


# ---------------------------------------------------------------------- the resumable grid


def fake_tasks():
    i = 0
    while True:
        yield Task(f"t{i}", arithmetic_prompt(f"Calculate {i % 10} + {(i * 3) % 10}."), str(i % 10 + (i * 3) % 10))
        i += 1


BASE = ["model.path=embedded:tiny-random", "run.max_steps=4", "rollout.group_size=2", "trainer.batch_size=4",
        "task.eval_every=2", "run.progress=false", "controller.reward_procs=0"]
CELLS = [Cell("a", ("run.mode=sync",), {"mode": "sync"}), Cell("b", ("run.mode=areal",), {"mode": "areal"})]


def fake_runner(calls: list[str], token_delay_s: dict[str, float] | None = None):
    async def run_fn(settings, folder):
        calls.append(folder.name)
        delay = (token_delay_s or {}).get(folder.name, 0.0)
        eval_set = [Task(f"e{i}", arithmetic_prompt(f"Calculate {i} + 1."), str(i + 1)) for i in range(4)]
        return await Orchestrator(settings, tasks=fake_tasks(), eval_set=eval_set, out_dir=folder,
                                  rollout=FakeRollout(token_delay_s=delay), trainer=FakeTrainer()).run()
    return run_fn


async def test_grid_skips_finished_cells_and_reruns_unfinished_ones(tmp_path):
    calls: list[str] = []
    first = await run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE, run_fn=fake_runner(calls),
                           log=lambda _: None)
    assert calls == ["a", "b"] and [r["status"] for r in first] == ["ran", "ran"]
    assert first[1]["mode"] == "areal" and first[1]["summary"]["steps"] == 4

    # b was killed mid-run: its folder holds rows but no summary
    b = tmp_path / "runs" / "b"
    (b / "summary.json").unlink()
    (b / "leftover").write_text("from the killed run")
    calls.clear()
    second = await run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE, run_fn=fake_runner(calls),
                            log=lambda _: None)
    assert calls == ["b"] and [r["status"] for r in second] == ["reused", "ran"]
    assert second[0]["summary"] == first[0]["summary"]

    # report only: the finished cells, nothing run, nothing deleted
    (b / "summary.json").unlink()
    calls.clear()
    report = await run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE, run_fn=fake_runner(calls),
                            log=lambda _: None, run_missing=False)
    assert calls == [] and [r["cell"] for r in report] == ["a"] and b.exists()
    await run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE, run_fn=fake_runner(calls),
                   log=lambda _: None)
    assert calls == ["b"]
    (b / "leftover").write_text("from the killed run")
    (b / "summary.json").unlink()
    calls.clear()
    second = await run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE, run_fn=fake_runner(calls),
                            log=lambda _: None)
    assert calls == ["b"]
    assert not (b / "leftover").exists(), "an unfinished cell is rerun from an empty folder"

    # other settings for the same cell: not the same run, so rerun (progress alone does not count)
    calls.clear()
    await run_grid(CELLS, tmp_path, settings_path=None, overrides=[*BASE, "run.progress=true"],
                   run_fn=fake_runner(calls), log=lambda _: None)
    assert calls == []
    # a run saved before a setting existed ran as its default: reused while the setting holds it
    text = (b / "settings.toml").read_text()
    (b / "settings.toml").write_text(re.sub(r"(?m)^kv_on_update = .*\n", "", text, count=1))
    assert "kv_on_update" not in (b / "settings.toml").read_text()
    assert finished_summary(b, load_settings(None, BASE)) is not None
    assert finished_summary(b, load_settings(None, [*BASE, "rollout.kv_on_update=keep"])) is None
    await run_grid(CELLS, tmp_path, settings_path=None, overrides=[*BASE, "run.max_steps=2"],
                   run_fn=fake_runner(calls), log=lambda _: None)
    assert calls == ["a", "b"]


async def test_grid_reruns_a_cancelled_cell_and_records_failures(tmp_path):
    calls: list[str] = []
    grid = asyncio.create_task(run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE,
                                        run_fn=fake_runner(calls, {"b": 0.5}), log=lambda _: None))
    while "b" not in calls:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    grid.cancel()
    with pytest.raises(asyncio.CancelledError):
        await grid
    b = tmp_path / "runs" / "b"
    cancelled = orjson.loads((b / "summary.json").read_bytes())
    assert cancelled["ended"] == "interrupted" and cancelled["error"] is None and cancelled["steps"] < 4
    assert finished_summary(b, load_settings(None, [*BASE, "run.mode=areal"])) is None

    calls.clear()
    records = await run_grid(CELLS, tmp_path, settings_path=None, overrides=BASE, run_fn=fake_runner(calls),
                             log=lambda _: None)
    assert calls == ["b"] and [r["status"] for r in records] == ["reused", "ran"]
    assert records[1]["summary"]["error"] is None and records[1]["summary"]["steps"] == 4

    async def broken(settings, folder):
        raise RuntimeError("worker exploded")

    cells = [*CELLS, Cell("c", ("run.mode=one_step",), {"mode": "one_step"})]
    records = await run_grid(cells, tmp_path, settings_path=None, overrides=BASE, run_fn=broken, log=lambda _: None)
    assert [r["status"] for r in records] == ["reused", "reused", "failed"]
    assert "worker exploded" in records[2]["summary"]["error"]


# ---------------------------------------------------------------------- the programs


def test_controller_overhead_quick_reports_a_positive_rate(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "YOUNG_GC_THRESHOLD", runner.YOUNG_GC_THRESHOLD)  # --young-gc sets it
    assert controller_overhead.main(["--quick", "--young-gc", "700", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["young_gc_threshold"] == 700
    assert res["trajectories_per_s_median"] > 0 and len(res["runs"]) == controller_overhead.QUICK_REPEATS
    assert all(r["samples_accepted"] == controller_overhead.QUICK_STEPS * controller_overhead.BATCH
               for r in res["runs"])
    assert res["loop_lag_max_ms"] >= 0 and "meets_target" in res
    assert (tmp_path / "controller_overhead.png").stat().st_size > 1000
    assert "trajectories/s" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def bench(script: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, f"bench/{script}.py", "--quick", "--out", str(out), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_time_to_threshold_and_staleness_ablation_quick_end_to_end(tmp_path):
    out = tmp_path / "ttt"
    proc = bench("time_to_threshold", out)
    res = json.loads((out / "results.json").read_text())
    assert set(res["groups"]) == {"sync/decoupled_ppo", "one_step/decoupled_ppo", "areal/decoupled_ppo"}
    for g in res["groups"].values():
        assert g["time_to_threshold_s"] == {"0": None} and g["reached"] == 0  # tiny-random never reaches it
        assert g["speedup_vs_sync"] is None and g["final_pass_mean"] is not None
        assert g["train_tokens_per_s_mean"] > 0 and g["steps_mean"] == 4
    assert res["speedup_rule"] and res["failed"] == [] and res["threshold"] == time_to_threshold.QUICK_THRESHOLD
    assert (out / "time_to_threshold.png").stat().st_size > 1000
    assert "x sync" in proc.stdout
    again = bench("time_to_threshold", out)  # the grid resumes: every cell is reused, no worker starts
    assert "running" not in again.stderr
    assert {r["status"] for r in json.loads((out / "results.json").read_text())["runs"]} == {"reused"}

    out = tmp_path / "ablation"
    proc = bench("staleness_ablation", out, "--etas", "0,-1")  # the bounded eta of --quick: a run too many here
    res = json.loads((out / "results.json").read_text())
    rows = {(r["objective"], r["eta_label"]) for r in res["rows"]}
    assert rows == {(o, e) for o in ("ppo", "decoupled_ppo") for e in ("0", "inf")}
    for r in res["rows"]:
        assert r["final_pass_mean"] is not None and r["train_tokens_per_s"] > 0
        assert r["steps"] == staleness_ablation.QUICK_STEPS
    assert res["failed"] == [] and (out / "staleness_ablation.png").stat().st_size > 1000
    assert "x eta0" in proc.stdout

