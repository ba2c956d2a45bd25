"""Command line: `python -m areal_aio run|eval|sft|check|keys|report`.

    run SETTINGS [--set ...] [--out DIR]     train (refuses a folder that holds a run)
    run --resume RUN_DIR [--set ...]         continue a run from its newest checkpoint
    eval MODEL [SETTINGS] [--set ...] [--out FILE.json | DIR]
                                             score an HF folder, embedded spec or run folder
                                             on the held-out set (the in-run protocol); writes
                                             eval.json and its logs into DIR (or beside FILE),
                                             the run folder, or runs/eval-<time>-<pid>/; an
                                             eval.json there is overwritten, and its last line
                                             says "overwrote"
    sft SETTINGS [--set ...] [--out DIR]     fine-tune on reference replies (areal_aio/app/sft.py); writes
                                             an HF folder (DIR/model) an RL run's model.path takes
    check SETTINGS [--set ...] | keys
    report RUN_DIR [RUN_DIR ...] [--out DIR] plots and report.md of run folders, finished or not

`run` owns the process, so it owns the loop (uvloop where available) and its
signals: Ctrl-C or SIGTERM cancels the run, which finishes an eval in flight,
writes model/ and a final checkpoint, shuts both workers down and removes the
run's /dev/shm folder before exiting 130 / 143; a second signal does not cut
that stop short (app/runner.py). A run folder or checkpoint that cannot be used
is one line on stderr and exit 2. `run`, `run --resume`, `eval` and `sft` check
their inputs first (app/preflight.py), as `check` does.

Exit codes: 0 done; 1 the run failed (one line on stderr naming the cause, the
traceback in <run>/error.log); 2 an input error (settings, task file, run folder,
checkpoint, model, device: one line, found by `check` too); 130 / 143 Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from areal_aio.app.preflight import check_eval_file, preflight, sandbox_lines
from areal_aio.app.runner import close_console, exit_code, run_owned
from areal_aio.control.progress import say
from areal_aio.fleet import zygote
from areal_aio.settings import SettingsError, describe, load_settings
from areal_aio.store.checkpoint import CheckpointError

SUMMARY_KEYS = ("mode", "max_staleness", "steps", "final_version", "wall_s", "cold_start_s",
                "time_to_threshold_s", "samples_generated", "samples_accepted",
                "samples_dropped_stale", "samples_dropped_interrupt", "max_staleness_trained",
                "gen_tokens_per_s", "train_tokens_per_s", "rollout_idle_frac", "trainer_idle_frac")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m areal_aio", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "train with these settings"), ("check", "validate and print the resolved settings"),
                       ("eval", "score a model on the held-out set")):
        cmd = sub.add_parser(name, help=text)
        if name == "eval":
            cmd.add_argument("model", help="HF folder, embedded:<name>, or a run folder (its model/)")
        cmd.add_argument("settings", nargs="?" if name != "check" else None, default=None,
                         help="settings TOML file" + (" (a run folder's own by default)" if name == "eval" else ""))
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                         help="override one key (repeatable); wins over the file and the mode presets")
        if name == "run":
            cmd.add_argument("--out", default=None, help="run folder (default: run.out_dir/<name>)")
            cmd.add_argument("--resume", default=None, metavar="RUN_DIR",
                             help="continue this run from its newest checkpoint (settings come from it; "
                                  "--set may change only resumable keys)")
        if name == "eval":
            cmd.add_argument("--out", default=None,
                             help="eval.json path (a .json file; the logs go beside it) or a folder for both "
                                  "(default: the run folder scored, else run.out_dir/eval-<time>-<pid>)")
    tune = sub.add_parser("sft", help="fine-tune on reference replies before RL (the [sft] section)")
    tune.add_argument("settings", help="settings TOML file")
    tune.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one key (repeatable)")
    tune.add_argument("--out", default=None, help="folder (default: run.out_dir/<run.name or sft-<time>-<pid>>)")
    sub.add_parser("keys", help="list every settings key with its default and meaning")
    report = sub.add_parser("report", help="plots and a markdown summary of run folders (finished or not)")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders, overlaid in every plot")
    report.add_argument("--out", default=None, help="report folder (default: RUN_DIR/report for one run, "
                        "report-<time> beside the first run for several)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; stdout and stderr are flushed (or let go, when gone) before it
    returns (runner.close_console)."""
    try:
        return _command(parser().parse_args(argv))
    finally:
        close_console()


def _command(args: argparse.Namespace) -> int:
    if args.command in ("run", "eval", "sft"):
        zygote.warm()  # the workers' imports, once, beside this command's own start-up
    if args.command == "keys":
        say(describe(), sys.stdout)
        return 0
    if args.command == "report":
        from areal_aio.app.report import main as report

        return report(args.runs, args.out)
    if args.command == "sft":
        from areal_aio.app.sft import main as sft

        return sft(args.settings, args.overrides, args.out)
    try:
        if args.command == "eval":
            return _eval(args.model, args.settings, args.overrides, args.out)
        if args.command == "run" and args.resume:
            return _resume(args.resume, args.settings, args.overrides, args.out)
        if args.settings is None:
            raise SettingsError("a settings file is needed (or --resume RUN_DIR)")
        settings = load_settings(args.settings, args.overrides)
        rows = preflight(settings, getattr(args, "out", None))
        if args.command in ("run", "check") and settings.sft_before_run:
            folder = _warm_start_checks(settings, getattr(args, "out", None), folders=args.command == "run")
            if args.command == "run":
                args.out = str(folder)
    except SettingsError as exc:  # a bad key or value, or an input preflight rejects
        say(f"settings error: {exc}")
        return 2
    except CheckpointError as exc:
        say(f"error: {exc}")
        return 2
    for line in sandbox_lines(settings):  # stderr: check's stdout stays a settings file
        say(line)
    if args.command == "check":
        say(settings.to_toml().rstrip("\n"), sys.stdout)
        return 0
    return _run(settings, args.out, rows=rows)


def _warm_start_checks(settings, out: str | None, folders: bool = True) -> Path:
    """The run folder a cold start (sft.before_run) writes into first: sft.data must be had, and
    (`folders`) the folder must hold no run and no tuning (PreflightError, SettingsError's kind)."""
    from areal_aio.app.sft import check_data, check_folder
    from areal_aio.control.keeping import run_name

    folder = Path(out) if out is not None else Path(settings.run.out_dir) / run_name(settings)
    check_data(settings)
    if folders:
        check_folder(folder, "--out" if out is not None else "run.name")
        check_folder(folder / "sft", "--out" if out is not None else "run.name")
    return folder


def _resume(run_dir: str, settings_path: str | None, overrides: list[str], out: str | None) -> int:
    """`run --resume`: the checkpoint's settings plus resumable overrides (CheckpointError else).
    A checkpoint the trainer refuses (an adapter on another base) is an input error: exit 2,
    and the run folder is put back as it was (keeping.FolderState)."""
    from areal_aio.control.keeping import FolderState
    from areal_aio.store.checkpoint import latest, resume_settings

    if settings_path is not None or out is not None:
        raise CheckpointError("--resume takes its settings and folder from the run; "
                              "give no settings file or --out")
    ckpt = latest(Path(run_dir))
    settings = resume_settings(ckpt, overrides)
    preflight(settings, ckpt.path.parent.parent, out_key="--resume")  # its rows are read again by the run
    return _run(settings, None, ckpt, before=FolderState.at_resume(ckpt))


def _eval(model: str, settings_path: str | None, overrides: list[str], out: str | None) -> int:
    """`eval`: preflight as `run` (MODEL named as such; eval.json's path must not be a folder),
    then the held-out set; writes eval.json and the logs where evaluation.eval_file says, and
    says where in its last line: "overwrote" when an eval.json was there."""
    from areal_aio.control.evaluation import eval_file, evaluate_model, model_settings

    settings, spec, run_folder = model_settings(model, settings_path, overrides)
    target = eval_file(settings, run_folder, out)
    out_key = "--out" if out is not None else ("MODEL" if run_folder is not None else "run.out_dir")
    check_eval_file(target, out_key)
    preflight(settings, target.parent, model_key="MODEL", ray=False, out_key=out_key)
    replaced = target.is_file()
    try:
        result = run_owned(evaluate_model(settings, target))
    except BaseException as exc:  # noqa: BLE001 - exit_code re-raises what is not a job's end
        return exit_code(exc, target.parent)
    failed, n = result.get("episode_failures", 0), result["n"]
    wrote = f"{'overwrote' if replaced else 'wrote'} {target} (the eval's logs beside it)"
    if n and failed == n:  # no episode played to its end: there is no score to show
        say(f"{wrote}\n{spec}: all {n} episodes failed (each scored 0; their turns are in eval.json): no score",
            sys.stdout, target.parent)
        return 1
    said = f"; {failed} of {n} episodes failed, scored 0" if failed else ""
    say(f"{spec}: pass {result['pass_rate']:.3f}  strict {result['strict_rate']:.3f}  "
        f"reward {result['reward_mean']:.3f}  ({n} held-out prompts{said})\n{wrote}", sys.stdout, target.parent)
    return 0


def _run(settings, out: str | None, resume=None, rows=None, before=None) -> int:
    """Train; `rows`: the task file's rows preflight read (handed on, not read again); `before`:
    a resumed run folder's keeping.FolderState, put back if the trainer refuses the checkpoint."""
    from areal_aio.app.trackers import run_tracked
    from areal_aio.control.controller import Orchestrator
    from areal_aio.control.keeping import refused_resume
    from areal_aio.control.sources import eval_tasks, training_tasks

    if resume is None and settings.sft_before_run:  # out: the run folder (_warm_start_checks)
        from areal_aio.app.sft import warm_start

        say(f"cold start: {settings.sft.steps} sft steps on {settings.sft.data} replies, into {Path(out) / 'sft'}",
            folder=Path(out))
        try:
            settings = run_owned(warm_start(settings, Path(out) / "sft"))
        except BaseException as exc:  # noqa: BLE001 - exit_code re-raises what is not a run's end
            return exit_code(exc, Path(out))
    given = {} if rows is None else {"tasks": training_tasks(settings, rows=rows),
                                     "eval_set": eval_tasks(settings, rows=rows)}
    try:
        orchestrator = Orchestrator(settings, out_dir=out, resume=resume, **given)
    except SettingsError as exc:  # what it reads first (the eval set, the episode) cannot be had
        say(f"settings error: {exc}")
        return 2
    try:
        summary = run_owned(run_tracked(orchestrator))
    except CheckpointError as exc:  # the folder holds a run, or another run is using it
        say(f"error: {exc}")
        return 2
    except BaseException as exc:  # noqa: BLE001 - exit_code re-raises what is not a run's end
        refusal = refused_resume(exc) if before is not None else None
        if refusal is None:
            return exit_code(exc, orchestrator.folder)
        before.restore()
        say(f"error: cannot resume {orchestrator.folder}: {refusal}")
        return 2
    say("")  # the progress line ends
    say(ending(summary, orchestrator.folder), sys.stdout, orchestrator.folder)
    return 0


def ending(summary: dict, folder: Path) -> str:
    """What a finished run prints: its main figures, the eval curve, where its folder and model are."""
    lines = [orjson.dumps({k: summary.get(k) for k in SUMMARY_KEYS}, option=orjson.OPT_INDENT_2).decode(),
             "eval curve (step, wall_s, pass, strict):",
             *(f"  {row['step']:4d} {row['wall_s']:8.1f}s  {row['pass_rate']:.3f}  {row['strict_rate']:.3f}"
               for row in summary["eval_curve"]),
             f"run folder: {folder}"]
    if summary.get("final_version"):
        lines.append(f"model: {folder / 'model'}")
    return "\n".join(lines)
