"""Scale-out: generated tokens/s with 1, 2, 4 rollout workers, trainer tokens/s with 1 and 2 ranks.

    python bench/scaling.py                      # SmolLM2-135M, the machine's cores shared out
    python bench/scaling.py --quick              # tiny-random, seconds
    python bench/scaling.py --rollout 1,2,4 --ranks 1,2 --repeats 3 --cores 16
    python bench/scaling.py --device cuda --rollout 1 --ranks 1    # one GPU per worker: list more

Every configuration is the real thing the controller runs: the role's client as
`areal_aio.fleet.placement` builds it from rollout.devices / trainer.devices (worker subprocesses
over pipes; several rollout workers behind one pool, several trainer ranks as
torch.distributed ranks), started once, warmed up, then timed.

    rollout  N workers   --sequences Generates in groups of 8 (what the controller sends:
                         a group to the least-loaded worker), all sent at once; tok/s =
                         tokens generated (up to and including EOS) / wall seconds from the
                         first send to the last Completion
    trainer  N ranks     one update (Train -> Trained: prox recompute, forward/backward,
                         the gradient all-reduce, AdamW, publishing v+1) on a fixed batch of
                         32 samples in groups of 8 with a default run's reply lengths;
                         tok/s = completion tokens trained / wall seconds

Each configuration gets the machine's best honest setup: the cores (--cores, default this
process's affinity) are shared out, cores // N torch threads per worker, at least 1 (so
4 workers on 2 cores run 2 to a core: that row shows what oversubscribing costs).
All configurations are started before any is timed and their repeats are interleaved, so
each sees the same background load; compare the ratios within one run. The workers of a
configuration not being timed are idle (blocked on their pipe).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio import wire  # noqa: E402
from areal_aio.fleet import placement  # noqa: E402
from areal_aio.fleet.client import WorkerClient, ensure_model  # noqa: E402
from areal_aio.seeds import sample_seed  # noqa: E402
from areal_aio.settings import Settings, build_settings, cpu_cores  # noqa: E402
from areal_aio.store.weights import SHM_BASE, WeightStore  # noqa: E402
from areal_aio.workers.models import SMOLLM2, TINY, load_tokenizer  # noqa: E402
from bench.common import command_line, parse_list, print_table, pyplot, save_figure, write_json  # noqa: E402
from bench.rollout_throughput import QUESTIONS  # noqa: E402
from bench.train_step import GROUP, make_batch, reply_lengths  # noqa: E402

INSTRUCTION = " Give the final answer inside <answer></answer> tags."
TRAIN_SEQS = 32


def settings_for(spec: str, role: str, count: int, threads: int, device: str, max_new: int,
                 extra: list[str]) -> Settings:
    """One configuration's settings: `count` workers of `role` (cuda: cuda:0 .. cuda:N-1), then
    the command line's --set overrides (e.g. ray.address=local: the same workers as Ray actors)."""
    devices = f"{role}.devices={count}" if device == "cpu" else \
        f"{role}.devices=[{', '.join(repr(f'{device}:{i}') for i in range(count))}]"
    return build_settings({}, [f"model.path={spec}", devices, f"{role}.threads={threads}",
                               f"rollout.max_new_tokens={max_new}", f"rollout.group_size={GROUP}",
                               f"trainer.batch_size={TRAIN_SEQS}", *extra])


async def rollout_pass(client: WorkerClient, s: Settings, sequences: int, rep: int) -> dict[str, float]:
    """Send `sequences` Generates in groups (one send_many each), wait for every Completion."""
    r = s.rollout
    t0 = time.perf_counter()
    for g in range(sequences // GROUP):
        prompt = QUESTIONS[g % len(QUESTIONS)] + INSTRUCTION
        await client.send_many([wire.Generate(f"r{rep}.g{g}.{i}", prompt, r.max_new_tokens, r.temperature, r.top_p,
                                              sample_seed(rep, g, i, 0)) for i in range(GROUP)])
    tokens = done = 0
    while done < sequences:
        msg = await client.recv()
        if isinstance(msg, wire.Completion):
            done += 1
            tokens += len(msg.completion_ids)
        elif not isinstance(msg, wire.WeightsLoaded):
            raise client.failure(msg)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


async def train_pass(client: WorkerClient, batch: list[wire.TrainSample], version: int) -> tuple[dict, int]:
    t0 = time.perf_counter()
    await client.send(wire.Train(version + 1, version, batch))
    msg = await client.recv()
    if not isinstance(msg, wire.Trained):
        raise client.failure(msg)
    wall = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) for s in batch)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "worker_seconds": msg.stats["seconds"], "reduce_s": msg.stats.get("reduce_s", 0.0)}, msg.version


async def measure(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    await ensure_model(spec)
    cores = args.cores or cpu_cores()
    folder = Path(tempfile.mkdtemp(prefix="scaling-"))
    store = WeightStore.create(f"bench-scaling-{time.time_ns()}", base=SHM_BASE)
    configs: list[dict[str, Any]] = []
    try:
        for role, counts in (("rollout", args.rollout), ("trainer", args.ranks)):
            for n in counts:
                threads = args.threads or (max(1, cores // n) if args.device == "cpu" else 1)
                s = settings_for(spec, role, n, threads, args.device, args.max_new, args.overrides)
                make = placement.rollout_client if role == "rollout" else placement.trainer_client
                client = make(s, folder / f"{role}-{n}")
                (folder / f"{role}-{n}").mkdir()
                configs.append({"role": role, "workers": n, "threads_each": threads, "settings": s,
                                "client": client, "version": 0, "runs": []})
        names = ", ".join(f"{c['role']} x{c['workers']}" for c in configs)
        print(f"starting {names}", file=sys.stderr)
        await asyncio.gather(*(c["client"].start(wire.Init(c["role"], c["settings"].to_dict(), str(store.root)))
                               for c in configs))  # starting is not timed
        tok = load_tokenizer(spec)
        batch = make_batch(len(tok), reply_lengths("mixed", TRAIN_SEQS))
        for rep in range(-1, args.repeats):  # rep -1: warm-up, not recorded
            for c in configs:
                if c["role"] == "rollout":
                    result = await rollout_pass(c["client"], c["settings"], args.sequences, rep + 1)
                else:
                    result, c["version"] = await train_pass(c["client"], batch, c["version"])
                if rep >= 0:
                    c["runs"].append(result)
                print(f"  {'warm-up' if rep < 0 else f'rep {rep}'} {c['role']} x{c['workers']}: "
                      f"{result['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        await asyncio.gather(*(c["client"].stop() for c in configs), return_exceptions=True)
        store.close()
    rows = []
    for c in configs:
        base = next(b for b in configs if b["role"] == c["role"] and b["workers"] == min(
            x["workers"] for x in configs if x["role"] == c["role"]))
        median = statistics.median(r["tokens_per_s"] for r in c["runs"])
        base_median = statistics.median(r["tokens_per_s"] for r in base["runs"])
        rows.append({"role": c["role"], "workers": c["workers"], "threads_each": c["threads_each"],
                     "tokens_per_s": median, "speedup": median / base_median,
                     "seconds": statistics.median(r["seconds"] for r in c["runs"]),
                     "reduce_s": statistics.median(r.get("reduce_s", 0.0) for r in c["runs"]),
                     "per_repeat": [round(r["tokens_per_s"], 2) for r in c["runs"]], "runs": c["runs"]})
    return {"model": spec, "device": args.device, "cores": cores, "sequences": args.sequences,
            "max_new_tokens": args.max_new, "train_batch": TRAIN_SEQS, "repeats": args.repeats, "rows": rows}


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, role, what in ((axes[0], "rollout", "generated tokens/s"), (axes[1], "trainer", "trained tokens/s")):
        rows = [r for r in result["rows"] if r["role"] == role]
        ax.bar([str(r["workers"]) for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
        for i, r in enumerate(rows):
            ax.text(i, r["tokens_per_s"], f"{r['tokens_per_s']:.0f}\n({r['speedup']:.2f}x)", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xlabel(f"{role} {'workers' if role == 'rollout' else 'ranks'} (threads each: "
                      f"{', '.join(str(r['threads_each']) for r in rows)})")
        ax.set_ylabel(what)
        ax.margins(y=0.25)
    fig.suptitle(title)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-random, 16 sequences, 1 repeat")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--rollout", default="1,2,4", help="rollout worker counts")
    ap.add_argument("--ranks", default="1,2", help="trainer rank counts")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes per configuration (default 3)")
    ap.add_argument("--sequences", type=int, default=None, help="Generates per rollout pass (default 64)")
    ap.add_argument("--max-new", type=int, default=48, help="rollout.max_new_tokens")
    ap.add_argument("--cores", type=int, default=None, help="cores to share out (default: this process's)")
    ap.add_argument("--threads", type=int, default=None, help="threads per worker (default cores // N)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (N workers take cuda:0 .. cuda:N-1)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                    help="settings override of every configuration (repeatable)")
    ap.add_argument("--machine", default="", help="the machine, for the title (e.g. '2-core x86 VM')")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "scaling")
    args = ap.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    args.rollout, args.ranks = parse_list(args.rollout, int), parse_list(args.ranks, int)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.sequences = args.sequences or (16 if args.quick else 64)
    if args.sequences % GROUP:
        ap.error(f"--sequences must be a multiple of {GROUP}")
    from areal_aio.app.runner import run_owned

    result = run_owned(measure(args, spec))
    result.update(machine=args.machine, overrides=args.overrides)
    write_json(args.out / "results.json", result, command=command_line(__file__, argv))
    print_table(("role", "workers", "threads each", "tok/s (median)", "speedup", "s per pass", "all-reduce s",
                 "per repeat"),
                [(r["role"], str(r["workers"]), str(r["threads_each"]), f"{r['tokens_per_s']:.1f}",
                  f"{r['speedup']:.2f}x", f"{r['seconds']:.2f}",
                  f"{r['reduce_s']:.2f}" if r["role"] == "trainer" else "-",
                  " ".join(f"{x:.1f}" for x in r["per_repeat"])) for r in result["rows"]],
                title=f"{spec} on {args.machine or args.device}, {result['cores']} cores shared out")
    plot(result, args.out / "scaling.png", f"Scale-out on {args.machine or args.device}: {spec.split(':')[-1]}")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'scaling.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
