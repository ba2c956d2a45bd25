"""Workers as Ray actors against local workers: the weight hand-off and generation through the relay.

    python bench/ray_handoff.py             # SmolLM2-135M, 5 versions, 2 generation passes
    python bench/ray_handoff.py --quick     # tiny-random, seconds

One process holds, side by side, three rollout workers and one trainer, each the client
`areal_aio.fleet.placement` builds:

    local    a PipeWorker: the worker reads each version from the run's /dev/shm store
    ray      a RayWorker (ray.address = "local"): the same worker in a Ray actor on this node,
             reading the same store (ship_weights = "auto": an actor on the controller's node)
    shipped  a RayWorker with ship_weights = "always": each version's bytes go from the
             trainer's actor through Ray's object store into the actor's own /dev/shm folder,
             what a rollout actor on another node gets
    trainer  a RayWorker (the trainer's actor is the source of the shipped bytes)

For each version the trainer publishes (one Train on a fixed batch), UpdateWeights goes to
each rollout worker in turn and the hand-off is timed from the send to its WeightsLoaded:
the whole cost an update adds before the worker generates with the new weights. Then each
worker generates the same batch (groups of 8; tok/s), in turn, to show what the relay costs
per token. All on one machine: the object store's copy is the one a second node would pay,
without the network.
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
from areal_aio.settings import build_settings, cpu_cores  # noqa: E402
from areal_aio.store.weights import SHM_BASE, WeightStore  # noqa: E402
from areal_aio.workers.models import SMOLLM2, TINY, load_tokenizer  # noqa: E402
from bench.common import command_line, print_table, pyplot, save_figure, write_json  # noqa: E402
from bench.scaling import rollout_pass  # noqa: E402
from bench.train_step import GROUP, make_batch, reply_lengths  # noqa: E402

WORKERS = {"local": (), "ray": ("ray.address=local", "ray.ship_weights=auto"),
           "shipped": ("ray.address=local", "ray.ship_weights=always")}
"""rollout worker -> its settings overrides"""


async def handoff(client: WorkerClient, version: int, path: str) -> float:
    """Seconds from sending UpdateWeights to the worker's WeightsLoaded of `version`."""
    t0 = time.perf_counter()
    await client.send(wire.UpdateWeights(version, path))
    while True:
        msg = await client.recv()
        if isinstance(msg, wire.WeightsLoaded) and msg.version == version:
            return time.perf_counter() - t0
        if not isinstance(msg, (wire.WeightsLoaded, wire.Completion)):
            raise client.failure(msg)


async def measure(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    await ensure_model(spec)
    threads = max(1, (args.cores or cpu_cores()) // 2)
    base = [f"model.path={spec}", f"rollout.threads={threads}", f"trainer.threads={threads}",
            f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={args.max_new}", "trainer.batch_size=16"]
    folder = Path(tempfile.mkdtemp(prefix="ray-handoff-"))
    store = WeightStore.create(f"bench-ray-handoff-{time.time_ns()}", base=SHM_BASE)
    trainer_settings = build_settings({}, [*base, *WORKERS["ray"]])
    clients: dict[str, WorkerClient] = {"trainer": placement.trainer_client(trainer_settings, folder)}
    settings = {"trainer": trainer_settings}
    for name, extra in WORKERS.items():
        settings[name] = build_settings({}, [*base, *extra])
        (folder / name).mkdir()
        clients[name] = placement.rollout_client(settings[name], folder / name)
    times: dict[str, dict[str, list[float]]] = {name: {"handoff_s": [], "tokens_per_s": []} for name in WORKERS}
    size = 0
    import ray

    # one private cluster for the three actors (a run's "local" cluster is sized for its own two)
    ray.init(num_cpus=3 * threads, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        print(f"starting {', '.join(clients)}", file=sys.stderr, flush=True)
        await asyncio.gather(*(client.start(wire.Init("trainer" if name == "trainer" else "rollout",
                                                      settings[name].to_dict(), str(store.root)))
                               for name, client in clients.items()))  # starting is not timed
        batch = make_batch(len(load_tokenizer(spec)), reply_lengths("mixed", 16))
        for version in range(1, args.versions + 1):
            await clients["trainer"].send(wire.Train(version, version - 1, batch))
            trained = await clients["trainer"].recv()
            if not isinstance(trained, wire.Trained):
                raise clients["trainer"].failure(trained)
            size = Path(trained.path).stat().st_size
            for name in WORKERS:
                seconds = await handoff(clients[name], version, trained.path)
                times[name]["handoff_s"].append(seconds)
                print(f"  v{version} {name}: hand-off {seconds:.3f}s", file=sys.stderr, flush=True)
            store.retain([version])
        for rep in range(args.passes):
            for name in WORKERS:
                result = await rollout_pass(clients[name], settings[name], args.sequences, rep)
                times[name]["tokens_per_s"].append(result["tokens_per_s"])
                print(f"  pass {rep} {name}: {result['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for name in reversed(list(clients)):  # the trainer's actor last: the others may read from it
            await clients[name].stop()
        store.close()
        ray.shutdown()
    rows = []
    for name in WORKERS:
        h, t = times[name]["handoff_s"], times[name]["tokens_per_s"]
        rows.append({"worker": name, "handoff_s": statistics.median(h), "handoff_all": h,
                     "tokens_per_s": statistics.median(t), "tokens_per_s_all": t})
    local = rows[0]
    for r in rows:
        r["handoff_vs_local"] = r["handoff_s"] / local["handoff_s"]
        r["tokens_per_s_vs_local"] = r["tokens_per_s"] / local["tokens_per_s"]
    return {"model": spec, "file_bytes": size, "versions": args.versions, "passes": args.passes,
            "sequences": args.sequences, "threads": threads, "rows": rows}


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["worker"] for r in result["rows"]]
    for ax, key, label in ((axes[0], "handoff_s", "UpdateWeights -> WeightsLoaded (s, median)"),
                           (axes[1], "tokens_per_s", "generated tok/s (median)")):
        values = [r[key] for r in result["rows"]]
        ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:red"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.margins(y=0.2)
    fig.suptitle(title)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-random, 2 versions, 1 pass of 16 sequences")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--versions", type=int, default=None, help="versions handed off (default 5)")
    ap.add_argument("--passes", type=int, default=None, help="generation passes per worker (default 2)")
    ap.add_argument("--sequences", type=int, default=None, help="Generates per pass (default 32)")
    ap.add_argument("--max-new", type=int, default=32, help="rollout.max_new_tokens")
    ap.add_argument("--cores", type=int, default=None, help="cores to share (default: this process's)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "ray_handoff")
    args = ap.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    args.versions = args.versions or (2 if args.quick else 5)
    args.passes = args.passes or (1 if args.quick else 2)
    args.sequences = args.sequences or (16 if args.quick else 32)
    from areal_aio.app.runner import run_owned

    result = run_owned(measure(args, spec))
    write_json(args.out / "results.json", result, command=command_line(__file__, argv))
    print_table(("worker", "hand-off s", "vs local", "tok/s", "vs local"),
                [(r["worker"], f"{r['handoff_s']:.3f}", f"{r['handoff_vs_local']:.2f}x", f"{r['tokens_per_s']:.1f}",
                  f"{r['tokens_per_s_vs_local']:.2f}x") for r in result["rows"]],
                title=f"{spec}: one version's hand-off and generation, local vs Ray actors")
    plot(result, args.out / "ray_handoff.png", f"Ray actors vs local workers: {spec.split(':')[-1]}")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'ray_handoff.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
