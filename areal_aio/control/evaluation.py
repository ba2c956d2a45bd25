"""Held-out evaluation: one protocol, used inside a run and by `python -m areal_aio eval`.

    eval set (tasks.eval_tasks: the held-out prompts of the run's task settings)
      -> one greedy Generate per prompt (temperature 0, rollout.max_new_tokens, same engine)
      -> the run's scorer (what task.reward names: AnswerReward with task.format_bonus by default)
      -> pass rate, strict rate (tagged and correct), mean reward

Inside a run the controller sends the requests and routes the answers (its rollout reader
owns the pipe); `evaluate_model` starts a rollout worker of its own (one per rollout.devices
entry, as a run would), so any HF folder, embedded spec or run folder is scored exactly as the
run scored its versions. It writes eval.json, and its workers' logs beside it, where `eval_file`
says: --out, the run folder scored, or runs/eval-<time>-<pid>/.

An in-run eval is a PendingEval from its first request to its row, kept in the run's Evals
(not in the task that awaits it): a stop can finish it (controller._finish_evals).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import orjson

from areal_aio import wire
from areal_aio.fleet.client import PipeWorker, WorkerClient
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.rewards.scoring import AnswerReward, Score, Scorer, component_means, load_rewards
from areal_aio.settings import Settings, SettingsError, load_settings, resolved_settings
from areal_aio.tasks.sources import eval_tasks
from areal_aio.tasks.task import Task


def requests(eval_set: list[Task], step: int, settings: Settings) -> list[wire.Generate]:
    """The greedy requests of the eval at `step` (ids eval<step>.<i>)."""
    r = settings.rollout
    return [wire.Generate(f"eval{step}.{i}", task.text, r.max_new_tokens, 0.0, 1.0, messages=task.messages)
            for i, task in enumerate(eval_set)]


async def score(scorer: Scorer, eval_set: list[Task], completions: list[wire.Completion]) -> list[Score]:
    return list(await asyncio.gather(*(scorer.score(t, c.text)
                                       for t, c in zip(eval_set, completions, strict=True))))


def rates(scores: list[Score]) -> dict[str, float]:
    """pass_rate, strict_rate, reward_mean and, for a weighted set of rewards, reward/<name>."""
    n = len(scores)
    return {"pass_rate": sum(s.passed for s in scores) / n, "strict_rate": sum(s.strict for s in scores) / n,
            "reward_mean": sum(s.reward for s in scores) / n, **component_means(scores)}


def sample_rows(step: int, eval_set: list[Task], completions: list[wire.Completion],
                scores: list[Score]) -> list[dict[str, Any]]:
    """One samples.jsonl row per prompt (kind "eval")."""
    return [{"kind": "eval", "step": step, "task_id": task.id, "prompt": task.prompt, "answer": task.answer,
             "reply": c.text, "reward": s.reward, "pass": s.passed, "strict": s.strict,
             **({"rewards": s.components} if s.components else {}), "tokens": len(c.completion_ids)}
            for task, c, s in zip(eval_set, completions, scores, strict=True)]


class PendingEval:
    """One in-run eval from its first request to its row. It lives in `Evals`, not in the task
    that runs it, so a stop that cancels that task can still finish it (the controller's
    _finish_evals): which requests are sent, which answers are in."""

    def __init__(self, step: int, version: int, requests: list[wire.Generate]) -> None:
        self.step, self.version, self.requests = step, version, requests
        self.sent = 0  # requests[:sent] are with the rollout workers
        self.answers: list[wire.Completion] = [None] * len(requests)  # type: ignore[list-item]
        self.missing = len(requests)
        self.answered = asyncio.Event()  # set once every answer is in


class Evals:
    """The run's evals in flight, by step; `deliver` hands each eval answer to its eval (the
    rollout reader calls it for every Completion)."""

    def __init__(self) -> None:
        self.open: dict[int, PendingEval] = {}
        self._of: dict[str, tuple[PendingEval, int]] = {}  # request id -> (its eval, its index)

    def begin(self, step: int, version: int, requests: list[wire.Generate]) -> PendingEval:
        pending = self.open[step] = PendingEval(step, version, requests)
        self._of.update((msg.request_id, (pending, i)) for i, msg in enumerate(requests))
        return pending

    def deliver(self, msg: wire.Completion) -> bool:
        """Take an eval request's answer (True), or leave any other request's (False)."""
        found = self._of.pop(msg.request_id, None)
        if found is None:
            return False
        pending, i = found
        pending.answers[i] = msg
        pending.missing -= 1
        if not pending.missing:
            pending.answered.set()
        return True

    def end(self, pending: PendingEval) -> None:
        """Its row is written: no longer in flight."""
        self.open.pop(pending.step, None)
        for msg in pending.requests:
            self._of.pop(msg.request_id, None)


# ---------------------------------------------------------------- the eval command


RUN_MARKERS = ("summary.json", "steps.jsonl", "events.jsonl")
"""Beside settings.toml, any of these makes a folder a run folder (a model folder has none)."""


def model_settings(model: str, settings_path: str | None,
                   overrides: list[str]) -> tuple[Settings, str, Path | None]:
    """(settings, model.path, the run folder MODEL is or None) for `eval MODEL`.

    A run folder (settings.toml beside its rows) is scored by its model/ with its own settings
    unless a settings file is given; a run folder without model/ is a SettingsError naming it.
    Anything else is a model spec (an HF folder, embedded:NAME, a hub id), checked by preflight."""
    folder = Path(model)
    if (folder / "settings.toml").is_file() and any((folder / name).exists() for name in RUN_MARKERS):
        spec = str(folder / "model")
        if not (folder / "model" / "config.json").is_file():
            raise SettingsError(f"MODEL: {model} is a run folder without model/ (the run committed no "
                                "update, was killed before writing it, or model/ was removed); "
                                "`run --resume` it to write one, or give a model folder")
        if settings_path is None:
            import tomllib

            try:
                tree = tomllib.loads((folder / "settings.toml").read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise SettingsError(f"MODEL: {folder / 'settings.toml'} is not a settings file ({exc})") from None
            return resolved_settings(tree, [*overrides, f"model.path={_quoted(spec)}"]), spec, folder
        return load_settings(settings_path, [*overrides, f"model.path={_quoted(spec)}"]), spec, folder
    return load_settings(settings_path, [*overrides, f"model.path={_quoted(model)}"]), model, None


def eval_file(settings: Settings, run_folder: Path | None, out: str | None) -> Path:
    """Where `eval` writes eval.json (its logs go beside it): `--out` (a .json file, else a
    folder), else the run folder scored, else a folder of its own under run.out_dir
    (eval-<time>-<pid>), never the current folder."""
    if out is not None:
        path = Path(out)
        return path if path.suffix == ".json" else path / "eval.json"
    if run_folder is not None:
        return run_folder / "eval.json"
    return Path(settings.run.out_dir) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" / "eval.json"


def _quoted(text: str) -> str:
    return orjson.dumps(text).decode()


def eval_rollout(settings: Settings, log: Path) -> WorkerClient:
    """The eval's own rollout client, placed as a run places its rollout workers: one worker
    (its log: `log`), or a RolloutPool of one per rollout.devices entry (eval-rollout-0.log ...)."""
    devices, threads = settings.rollout_devices, settings.rollout.threads
    if devices == [settings.rollout.device]:
        return PipeWorker("rollout", log, threads)
    logs = [log] if len(devices) == 1 else [log.with_name(f"{log.stem}-{i}{log.suffix}") for i in range(len(devices))]
    return RolloutPool([PipeWorker("rollout", path, threads) for path in logs], devices)


async def greedy_completions(settings: Settings, tasks: list[Task], log: Path,
                             rollout: WorkerClient | None = None) -> list[wire.Completion]:
    """settings.model.path's greedy replies to `tasks` (the eval requests), from a rollout
    client of its own (default: eval_rollout's, logging to `log`), in the order of `tasks`."""
    worker = rollout or eval_rollout(settings, log)
    try:
        await worker.prepare(settings.model.path)
        await worker.start(wire.Init("rollout", settings.to_dict(), ""))
        for msg in requests(tasks, 0, settings):  # one by one: a pool spreads them over its workers
            await worker.send(msg)
        answers: dict[str, wire.Completion] = {}
        while len(answers) < len(tasks):
            msg = await worker.recv()
            if not isinstance(msg, wire.Completion):
                raise worker.failure(msg)
            answers[msg.request_id] = msg
    finally:
        await worker.stop()
    return [answers[f"eval0.{i}"] for i in range(len(tasks))]


async def evaluate_model(settings: Settings, out_file: Path) -> dict[str, Any]:
    """Score settings.model.path on the held-out set with the in-run protocol; write `out_file`."""
    eval_set = await asyncio.to_thread(eval_tasks, settings)  # code items: sandbox runs, off the loop
    reward = load_rewards(settings.task)
    builtin = all(type(r.fn) is AnswerReward for r in (reward if isinstance(reward, list) else [reward]))
    scorer = Scorer(reward, timeout_s=settings.controller.reward_timeout_s,
                    procs=0 if builtin else settings.controller.reward_procs,
                    log_path=out_file.with_name("eval-reward.log"))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        completions = await greedy_completions(settings, eval_set, out_file.with_name("eval-rollout.log"))
        scores = await score(scorer, eval_set, completions)
    finally:
        await scorer.aclose()
    result = {"model": settings.model.path, **rates(scores), "n": len(eval_set),
              "eval_seed": settings.task.eval_seed, "max_new_tokens": settings.rollout.max_new_tokens,
              "seconds": round(time.perf_counter() - t0, 3),
              "samples": sample_rows(0, eval_set, completions, scores)}
    out_file.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result
