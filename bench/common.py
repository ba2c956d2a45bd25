"""What the run-grid benchmarks share: a resumable grid of real runs, the loop, tables, plots;
and what every bench shares: the results writer, which records where a result came from.

    cells (name, overrides) --load_settings--> Settings --run_fn--> DIR/runs/<name>/summary.json

A grid runs its cells strictly one after another in one event loop (each cell
is one `Orchestrator`, which starts and stops its own worker subprocesses).
It resumes: a cell whose folder holds a `summary.json` with `"error": null`
and the same resolved settings is finished, so its summary is reused; any
other folder (an interrupted, failed or differently configured run) is
deleted and the cell is rerun from scratch. A run that raises is recorded as
failed and the grid goes on, so one bad cell does not lose a night's grid;
Ctrl-C stops the grid (the interrupted cell reruns next time).

Every results file goes through `write_json`, which adds a top-level "provenance" block
(`provenance()`): the command line, the commit and whether tracked files differed from it, the
date (UTC), the machine (CPU and its vector flags, cores, RAM, GPU and driver), the environment
variables that change figures, and the versions of python, torch and transformers. Files in
bench/results older than the writer carry a block recovered from git ("recovered": true: the
commit that added the file and its date, the machine folder; null for what is no longer known).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from areal_aio.control.stats import finished_by_itself
from areal_aio.settings import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SETTINGS = REPO / "settings.toml"
TINY_BATCH = ("model.path=embedded:tiny-random", "rollout.group_size=4", "trainer.batch_size=8",
              "rollout.max_new_tokens=8", "task.eval_size=8", "task.eval_every=2",
              "run.progress=false", "controller.reward_procs=0")
"""The --quick base: the smallest real run (tiny-random model, 2 groups of 4, 8 tokens)."""
IGNORED_FOR_RESUME = {("run", "progress"), ("run", "report_to"), ("run", "log_completions_every")}
"""Settings that do not change a run's results: a finished cell is reused whatever they are."""

ADDED_KEYS = {("rollout", "kv_on_update"): "rebuild"}
"""Settings added after grid runs were saved, with what every run did before the key existed
(not today's default, which may change): a saved run without the key is reused for that value."""

RunFn = Callable[[Settings, Path], Awaitable[dict]]


@dataclass(frozen=True, slots=True)
class Cell:
    """One run of a grid: its folder name, its settings overrides, and the labels it is grouped by."""

    name: str
    overrides: tuple[str, ...]
    labels: dict[str, Any] = field(default_factory=dict)


async def run_orchestrator(settings: Settings, folder: Path) -> dict:
    """The real run: an Orchestrator that starts the rollout and trainer subprocesses itself."""
    from areal_aio.control.controller import Orchestrator

    return await Orchestrator(settings, out_dir=folder).run()


def finished_summary(folder: Path, settings: Settings) -> dict | None:
    """The summary of a finished run of exactly these settings in `folder`, else None."""
    try:
        summary = orjson.loads((folder / "summary.json").read_bytes())
        resolved = tomllib.loads((folder / "settings.toml").read_text())
    except (OSError, orjson.JSONDecodeError, tomllib.TOMLDecodeError):
        return None
    if not finished_by_itself(summary):
        return None
    return summary if _comparable(resolved) == _comparable(settings.to_dict(), resolved) else None


def _comparable(tree: dict, saved: dict | None = None) -> dict:
    """`tree` without the keys resume ignores; given the `saved` settings of an earlier run, also
    without the keys of ADDED_KEYS it lacks whose value here is what runs did before the key
    existed: such a run stays reusable after a release adds a setting."""

    def kept(section: str, key: str, value: Any) -> bool:
        if (section, key) in IGNORED_FOR_RESUME:
            return False
        if saved is None or key in saved.get(section, {}) or (section, key) not in ADDED_KEYS:
            return True
        return value != ADDED_KEYS[section, key]

    return {section: {k: v for k, v in values.items() if kept(section, k, v)}
            for section, values in tree.items()}


async def run_grid(cells: Sequence[Cell], out_dir: Path, *, settings_path: str | Path | None,
                   overrides: Sequence[str] = (), run_fn: RunFn = run_orchestrator,
                   log: Callable[[str], None] | None = None, run_missing: bool = True) -> list[dict]:
    """Run every cell not yet finished, one after another; one record per cell, in order.

    A record is the cell's labels plus `cell`, `folder` (relative to `out_dir`), `status` (reused | ran | failed)
    and `summary` (the run's summary; a failed run's has its error). Settings are the file,
    then `overrides`, then the cell's own overrides (so the grid's dimensions win).
    run_missing=False reports the finished cells only (no record for the others, nothing deleted).
    """
    log = log or _stderr
    records = []
    for i, cell in enumerate(cells, start=1):
        settings = load_settings(settings_path, [*overrides, *cell.overrides])
        folder = out_dir / "runs" / cell.name
        summary = finished_summary(folder, settings)
        status = "reused"
        if summary is None and not run_missing:
            log(f"[{i}/{len(cells)}] {cell.name}: not finished, left out")
            continue
        if summary is None:
            if folder.exists():
                log(f"[{i}/{len(cells)}] {cell.name}: unfinished or different settings, rerunning")
                shutil.rmtree(folder)
            else:
                log(f"[{i}/{len(cells)}] {cell.name}: running")
            try:
                summary = await run_fn(settings, folder)
                status = "ran"
            except Exception as exc:  # noqa: BLE001 - a failed cell is recorded, the grid goes on
                status = "failed"
                summary = read_summary(folder) or {}
                summary["error"] = summary.get("error") or f"{type(exc).__name__}: {exc}"
                log(f"[{i}/{len(cells)}] {cell.name}: FAILED: {summary['error'][:500]}")
        else:
            log(f"[{i}/{len(cells)}] {cell.name}: finished earlier, reusing its summary")
        records.append({**cell.labels, "cell": cell.name, "folder": f"runs/{cell.name}", "status": status,
                        "summary": summary})
    return records


def grid_parser(doc: str | None, out_name: str) -> argparse.ArgumentParser:
    """The options every grid bench shares: the settings of every run, --out (default
    bench/out/<out_name>), --max-wall-s, --quick and --report-only."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", type=Path, default=DEFAULT_SETTINGS, help="settings file of every run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                    help="settings override applied to every run (repeatable)")
    ap.add_argument("--max-wall-s", type=float, default=None, help="wall limit of one run (default: the file's)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / out_name)
    ap.add_argument("--quick", action="store_true", help="tiny-random smoke preset (about a minute)")
    ap.add_argument("--report-only", action="store_true",
                    help="table and plot of the finished cells in --out; run nothing")
    return ap


def read_summary(folder: Path) -> dict | None:
    """A run folder's summary.json (None while it runs, or where it cannot be read)."""
    try:
        return orjson.loads((folder / "summary.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine as `python -m areal_aio run` does (uvloop; SIGTERM and Ctrl-C cancel it,
    so the run in progress stops its workers and removes its /dev/shm folder); a signal ends
    the process with 143 (SIGTERM) or 130 (Ctrl-C), and rerunning resumes the grid."""
    from areal_aio.app.runner import run_owned

    try:
        return run_owned(coro)
    except asyncio.CancelledError:
        _stderr("terminated; the interrupted cell reruns next time")
        raise SystemExit(143) from None
    except KeyboardInterrupt:
        _stderr("interrupted; the interrupted cell reruns next time")
        raise SystemExit(130) from None


# ---------------------------------------------------------------------- small helpers


def shown_path(path: str | Path | None) -> str | None:
    """`path` relative to the repository when inside it (results.json files travel between
    machines), else as given."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def set_args(sets: Sequence[str]) -> list[str]:
    """["k=v", ...] -> ["--set", "k=v", ...]: overrides as a command line takes them."""
    return [part for kv in sets for part in ("--set", kv)]


def parse_list(text: str, kind: Callable[[str], Any] = str) -> list[Any]:
    """'a,b,c' -> [kind(a), kind(b), kind(c)] (blanks skipped)."""
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def eval_curve(summary: dict) -> list[dict]:
    """A run summary's evals in step order (summary.json keeps them in the order they finished)."""
    return sorted(summary.get("eval_curve") or [], key=lambda r: r["step"])


def first_reaching(curve: list[dict], threshold: float) -> dict | None:
    """The first eval of a step-ordered curve whose pass rate is at least `threshold`."""
    return next((row for row in curve if row["pass_rate"] >= threshold), None)


def final_pass_rate(summary: dict) -> float | None:
    """Pass rate of the last eval (the run's final eval), or None if it never evaluated."""
    curve = eval_curve(summary)
    return curve[-1]["pass_rate"] if curve else None


def initial_pass_rate(summary: dict) -> float | None:
    curve = eval_curve(summary)
    return curve[0]["pass_rate"] if curve else None


@dataclass(frozen=True)
class RunFiles:
    """What a finished run folder holds that the benches read: its summary, its evals in step
    order, its trained samples (samples.jsonl rows of trained steps, not dropped), its eval
    samples, and its cold start's sft/sft.json ({} for a run without one)."""

    summary: dict
    curve: list[dict]
    trained: list[dict]
    evals: list[dict]
    sft: dict


def trained(rows: list[dict]) -> list[dict]:
    """The samples.jsonl rows of samples a step trained (not dropped, not evals)."""
    return [r for r in rows if r.get("kind") == "train" and r.get("dropped") is None and r.get("step")]


def read_run(folder: Path) -> RunFiles:
    summary = orjson.loads((folder / "summary.json").read_bytes())
    samples = folder / "samples.jsonl"
    rows = [orjson.loads(line) for line in samples.read_bytes().splitlines()] if samples.exists() else []
    sft_file = folder / "sft" / "sft.json"
    return RunFiles(summary=summary, curve=eval_curve(summary), trained=trained(rows),
                    evals=[r for r in rows if r.get("kind") == "eval"],
                    sft=orjson.loads(sft_file.read_bytes()) if sft_file.exists() else {})


def stats(values: Sequence[float | None]) -> dict[str, float | None]:
    """Mean, min and max of the values that are not None (all None when there are none)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}


def mean(values: Sequence[float | None]) -> float | None:
    return stats(values)["mean"]


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> None:
    """A plain text table on stdout, columns as wide as their widest cell."""
    widths = [max([len(str(h)), *(len(str(r[i])) for r in rows)]) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w) in enumerate(zip(headers, widths, strict=True))))
    for row in rows:
        print("  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def write_json(path: Path, data: dict[str, Any], *, command: str | None = None) -> None:
    """Write a results file: `data` plus a top-level "provenance" (see `provenance`; `command`
    is the command line to record, default this process's). Every bench writes through here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**data, "provenance": provenance(command)}
    path.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
                                | orjson.OPT_NON_STR_KEYS))


# ---------------------------------------------------------------------- provenance

RESULT_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
"""Environment variables that change a bench's figures without showing on its command line
(an ISA cap, a thread count, the GPUs seen): recorded when set."""
CPU_FLAGS = re.compile(r"avx.*|amx.*|fma|f16c")
"""The CPU flags kept (the vector and matrix units the matmul kernels pick from); the rest are counted."""
PROBE_TIMEOUT_S = 10
"""git and nvidia-smi are asked once per results file; a hung one must not hold the bench's results back."""


def provenance(command: str | None = None) -> dict[str, Any]:
    """Where a result came from: the command line (`command`, default this process's; paths
    inside the repository made relative, as a results file travels between machines), the git
    commit and whether tracked files differed from it, the date (UTC), the machine, the
    environment variables of RESULT_ENV that are set, and the versions of python, torch and
    transformers. Imports neither torch nor transformers (a package not installed is None)."""
    commit, dirty = _git_state()
    command = command_line(sys.argv[0], sys.argv[1:]) if command is None else command
    return {"command": command.replace(f"{REPO}{os.sep}", ""),
            "commit": commit, "dirty": dirty,
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": machine(),
            "env": {name: os.environ[name] for name in RESULT_ENV if name in os.environ},
            "versions": {"python": platform.python_version(), "torch": _version("torch"),
                         "transformers": _version("transformers")}}


def command_line(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """`python SCRIPT ARGV...` as a shell takes it, SCRIPT relative to the repository; argv
    defaults to this process's (a bench's main(argv) passes the argv it parsed)."""
    return shlex.join(["python", str(shown_path(script)), *(sys.argv[1:] if argv is None else argv)])


def machine() -> dict[str, Any]:
    """The CPU (model, the flags of CPU_FLAGS, how many flags in all), cores (all, and those this
    process may use), RAM and the GPUs (name, count, driver; None and 0 without any)."""
    cpu, flags = _cpu_info()
    gpus, driver = _gpus()
    return {"cpu": cpu, "cpu_flags": sorted(f for f in flags if CPU_FLAGS.fullmatch(f)) if flags else None,
            "cpu_flag_count": len(flags) if flags else None,
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "ram_gib": _ram_gib(),
            "gpu": ", ".join(sorted(set(gpus))) or None, "gpu_count": len(gpus), "gpu_driver": driver}


def _git_state() -> tuple[str | None, bool | None]:
    """(HEAD's hash, whether tracked files differ from it), or (None, None) outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head, bool(status.strip())


def _cpu_info() -> tuple[str | None, list[str]]:
    """(the CPU's model name, its flags) from /proc/cpuinfo; elsewhere platform's name and no flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine() or None, []
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    cpu = fields.get("model name") or fields.get("Hardware") or platform.machine() or None
    return cpu, (fields.get("flags") or fields.get("Features") or "").split()


def _ram_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, OSError, ValueError):
        return None


def _gpus() -> tuple[list[str], str | None]:
    """(the GPUs' names, the driver's version) from nvidia-smi; without it, the names torch sees
    if the bench imported torch (the driver then unknown); ([], None) without a GPU."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True).stdout
            rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
            if rows:
                return [r[0] for r in rows], rows[0][-1]
        except (OSError, subprocess.SubprocessError):
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], None
    return [], None


def _version(package: str) -> str | None:
    """The version of `package`: the imported module's when imported, else the installed
    distribution's (so torch is not imported to name it); None when not installed."""
    module = sys.modules.get(package)
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close a matplotlib figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    fig.clf()
    pyplot().close(fig)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
