"""Trackers: metric names, the settings check, and what each backend wrote, read back."""

from __future__ import annotations

import asyncio
import struct

import orjson
import pytest

from areal_aio import settings as settings_module
from areal_aio.app import trackers
from areal_aio.app.trackers import EVAL_METRICS, STEP_METRICS, metrics, run_tracked
from areal_aio.settings import SettingsError
from tests.conftest import make_settings, need, orchestrator

WANDB_BLOCK = 32 * 1024


def rows(folder, name: str) -> list[dict]:
    return [orjson.loads(x) for x in (folder / f"{name}.jsonl").read_bytes().splitlines()]


def test_names_are_namespaced_and_unique():
    for table in (STEP_METRICS, EVAL_METRICS):
        assert len(set(table.values())) == len(table)
        assert all(name.split("/")[0] in ("train", "eval", "perf", "staleness", "queue", "process")
                   for name in table.values())
    for name in ("train/reward", "train/loss", "train/entropy", "staleness/max", "staleness/mean",
                 "perf/gen_tokens_per_s", "perf/train_tokens_per_s"):
        assert name in STEP_METRICS.values()
    assert {"eval/pass_rate", "eval/strict_rate"} <= set(EVAL_METRICS.values())


def test_metrics_keep_every_number_and_nothing_else():
    step = {"kind": "step", "step": 3, "reward_mean": 0.5, "loss": -0.1, "staleness_max": 2,
            "mismatch_kl": None, "new_thing": 7, "reward/format": 0.2, "perf/own": 1, "flag": True,
            "tags": [1]}
    assert metrics(step) == {"train/reward": 0.5, "train/loss": -0.1, "staleness/max": 2.0,
                             "train/new_thing": 7.0, "train/reward/format": 0.2, "perf/own": 1.0}
    ev = {"kind": "eval", "step": 4, "version": 4, "pass_rate": 0.25, "strict_rate": 0.125,
          "reward_mean": 0.3, "wall_s": 1.5, "done_s": 2.0, "versions": [3, 4], "extra": 1,
          "reward/format": 0.1}
    assert metrics(ev) == {"eval/version": 4.0, "eval/pass_rate": 0.25, "eval/strict_rate": 0.125,
                           "eval/reward": 0.3, "eval/wall_s": 1.5, "eval/done_s": 2.0, "eval/extra": 1.0,
                           "eval/reward/format": 0.1}


async def test_every_field_of_a_real_step_row_has_a_listed_name(tmp_path):
    """A new numeric step field lands under train/<field>; this says when the table lags."""
    await orchestrator(tmp_path, make_settings("areal", **{"run.max_steps": 2})).run()
    for row in rows(tmp_path / "run", "steps"):
        numeric = {k for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        assert numeric - {"step"} <= set(STEP_METRICS), numeric - set(STEP_METRICS)


def test_report_to_is_checked_with_the_settings(monkeypatch):
    report_to_error = settings_module.report_to_error
    assert report_to_error([]) is None
    assert "did you mean 'wandb'" in report_to_error(["wandbb"])
    monkeypatch.setitem(settings_module.TRACKERS, "wandb", "no_such_package_areal_aio")
    assert report_to_error(["wandb"]) == ("'wandb' needs the no_such_package_areal_aio package: "
                                          "pip install 'areal_aio[wandb]'")
    with pytest.raises(SettingsError, match=r"run.report_to: 'wandb' needs .* pip install"):
        make_settings("areal", **{"run.report_to": ["wandb"]})


async def test_tensorboard_gets_every_step_and_eval(tmp_path):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = make_settings("areal", **{"run.max_steps": 4, "run.report_to": ["tensorboard"]})
    orch = orchestrator(tmp_path, settings)
    summary = await run_tracked(orch)
    assert summary["steps"] == 4
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["tensors"])
    assert {"train/reward", "train/loss", "staleness/max", "perf/gen_tokens_per_s", "eval/pass_rate"} <= tags

    def series(tag):
        return [(e.step, float(e.tensor_proto.float_val[0])) for e in acc.Tensors(tag)]

    steps = rows(tmp_path / "run", "steps")
    assert series("train/reward") == [(r["step"], pytest.approx(r["reward_mean"])) for r in steps]
    assert series("staleness/max") == [(r["step"], r["staleness_max"]) for r in steps]
    evals = sorted(series("eval/pass_rate"))
    assert evals == [(r["step"], pytest.approx(r["pass_rate"])) for r in summary["eval_curve"]]


def wandb_history(path) -> list[dict]:
    """The history rows of an offline .wandb file: a 7-byte header, then 32 KiB blocks of
    LevelDB-log records (crc32, length, type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4) whose
    payloads are wandb's protobuf Records (wandb 0.31 ships no Python reader of its own)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, payload, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if (left := WANDB_BLOCK - pos % WANDB_BLOCK) < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                out.append({"/".join(i.nested_key) or i.key: orjson.loads(i.value_json)
                            for i in record.history.item})
    return out


@pytest.mark.slow
async def test_wandb_offline_writes_inside_the_run_folder(tmp_path, monkeypatch):
    need("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default here
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = make_settings("areal", **{"run.max_steps": 3, "run.report_to": ["wandb"]})
    summary = await run_tracked(orchestrator(tmp_path, settings))
    import wandb

    # finish() returns once wandb's service has the run's last record, not once its writer has
    # flushed the file; teardown waits for the service to close its streams (the CLI's exit does too)
    await asyncio.to_thread(wandb.teardown)
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history = wandb_history(files[0])
    train = [(h["train/step"], h["train/reward"]) for h in history if "train/step" in h]
    evals = sorted((h["eval/step"], h["eval/pass_rate"]) for h in history if "eval/step" in h)
    assert train == [(r["step"], pytest.approx(r["reward_mean"])) for r in rows(tmp_path / "run", "steps")]
    assert evals == [(r["step"], pytest.approx(r["pass_rate"])) for r in summary["eval_curve"]]


@pytest.mark.slow
async def test_trackio_logs_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    need("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    settings = make_settings("areal", **{"run.max_steps": 3, "run.report_to": ["trackio"]})
    await run_tracked(orchestrator(tmp_path, settings))
    logs = SQLiteStorage.get_logs(trackers.PROJECT, "run")
    rewards = [(log["step"], log["train/reward"]) for log in logs if "train/reward" in log]
    assert rewards == [(r["step"], pytest.approx(r["reward_mean"])) for r in rows(tmp_path / "run", "steps")]
