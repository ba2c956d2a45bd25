"""LoRA against full fine-tuning on the default run's shape: trainer step, trainer memory, the
hand-off to the rollout worker (both ways it can apply an adapter), the checkpoint.

    batch      32 samples in groups of 8, ~50-token prompts, a default run's reply lengths
               (bench/train_step.py's mixed), settings defaults otherwise (trainer.bf16 auto,
               packed groups, decoupled PPO), one thread per process
    variants   full, lora-8, lora-32 (all-linear, alpha 16): each trainer in a fresh process of
               its own (its peak RSS is its ru_maxrss), driven one step at a time in turn, so
               the variants share the machine's background load (interleaved repeats)
    hand-off   publish (the trainer's Trained.stats publish_s; the file's bytes), then in this
               process, on the rollout's own copy of the base (rollout.dtype float32):
                 full      load_weights of the whole policy
                 merged    (a) lora.merge = true: W = W_base + alpha/r B A from a pristine copy
                 unmerged  (b) lora.merge = false: the adapter read into peft's layers
    decode     the cost (b) pays at every step: an Engine generating 32 sequences (max_batch 32)
               with the adapter merged vs unmerged, tokens/s, interleaved
    checkpoint the trainer's part of a checkpoint (Save kind checkpoint): bytes and seconds

    python bench/lora.py                   # SmolLM2-135M, 1 warm-up + 3 timed steps per variant
    python bench/lora.py --quick           # tiny-random, 8 samples, seconds
    python bench/lora.py --ranks 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio import wire  # noqa: E402
from areal_aio.settings import build_settings, cpu_cores  # noqa: E402
from areal_aio.store.safetensors_io import load_weights  # noqa: E402
from areal_aio.store.weights import SHM_BASE, WeightStore  # noqa: E402
from areal_aio.workers import lora  # noqa: E402
from areal_aio.workers.models import SMOLLM2, TINY, load_model  # noqa: E402
from areal_aio.workers.rollout.engine import Engine, Request  # noqa: E402
from bench.common import command_line, print_table, pyplot, save_figure, write_json  # noqa: E402
from bench.rollout_throughput import TEMPERATURE, prompts  # noqa: E402
from bench.train_step import GROUP, make_batch, reply_lengths  # noqa: E402

SEQS = 32
QUICK_SEQS = 8
ALPHA = 16.0
"""lora.alpha's default."""
DECODE_SEQS = 32
"""rollout.max_batch's default: one full batch of rows decoding together."""
DECODE_TOKENS = 24
QUICK_DECODE_TOKENS = 8
TARGETS = {"handoff_frac": 0.02, "checkpoint_frac": 0.05, "step_speedup": 1.3}
"""Issue 23's targets against full fine-tuning: hand-off bytes <= 2%, checkpoint <= 5%, trainer
step >= 1.3x faster (on this CPU)."""


# ---- the trainer, one process per variant ------------------------------------------------------


def variant_rank(name: str) -> int:
    return 0 if name == "full" else int(name.removeprefix("lora-"))


def child(args: argparse.Namespace) -> int:
    """A trainer of one variant behind stdin/stdout: `step`, `checkpoint DIR`, `quit` -> one JSON
    line each (anything else the libraries print goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    torch.set_num_threads(1)
    from areal_aio.workers.trainer.worker import Trainer

    rank = variant_rank(args.child)
    s = build_settings({}, (f"model.path={args.model}", f"trainer.batch_size={args.seqs}",
                            f"rollout.group_size={GROUP}", f"lora.rank={rank}", f"lora.alpha={ALPHA}"))
    model, tok = load_model(args.model, seed=0)
    torch.manual_seed(0)
    store = WeightStore.create(f"bench-lora-{args.child}", base=SHM_BASE)
    try:
        trainer = Trainer(s, store.root, model=model, tokenizer=tok)
        rss_loaded = _rss_now()
        batch = make_batch(len(tok), reply_lengths("mixed", args.seqs))
        out.write(json.dumps({"trainable": sum(p.numel() for p in trainer.params), "bf16": trainer.bf16,
                              "rss_loaded": rss_loaded}) + "\n")
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "step":
                t0 = time.perf_counter()
                reply = trainer.train(wire.Train(trainer.version, trainer.version, batch))
                wall = time.perf_counter() - t0
                store.retain([trainer.version])
                out.write(json.dumps({"wall_s": wall, "publish_s": reply.stats["publish_s"], "path": reply.path,
                                      "bytes": Path(reply.path).stat().st_size}) + "\n")
            elif cmd == "checkpoint":
                saved = trainer.save(wire.Save("checkpoint", arg))
                out.write(json.dumps({"bytes": saved.bytes, "seconds": saved.seconds}) + "\n")
            elif cmd == "quit":
                out.write(json.dumps({"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}) + "\n")
                break
    finally:
        store.close()
    return 0


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TrainerProcess:
    """The parent's handle on one variant's trainer process."""

    def __init__(self, name: str, args: argparse.Namespace, log: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", name, "--model", args.model, "--seqs", str(args.seqs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, cwd=REPO)
        self.log = log
        self.info = self.ask(None)

    def ask(self, cmd: str | None) -> dict[str, Any]:
        if cmd is not None:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} trainer died:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---- the rollout side, in this process ----------------------------------------------------------


class Rollout:
    """The rollout worker's copies of the base and their ways to take a version."""

    def __init__(self, spec: str, ranks: list[int]) -> None:
        self.full = load_model(spec, seed=0)[0]
        self.merged = {r: (load_model(spec, seed=0)[0], lora.MergedAdapter()) for r in ranks}
        self.unmerged = {r: (load_model(spec, seed=0)[0],
                             lora.UnmergedAdapter(build_settings({}, (f"lora.rank={r}", f"lora.alpha={ALPHA}")).lora, spec))
                         for r in ranks}

    def take(self, name: str, path: str) -> dict[str, float]:
        """Seconds to put the version at `path` into the rollout's model(s) of variant `name`."""
        rank = variant_rank(name)
        if rank == 0:
            return {"load_s": load_weights(self.full, path)}
        model, merged = self.merged[rank]
        model_b, unmerged = self.unmerged[rank]
        return {"merged_s": merged(model, path), "unmerged_s": unmerged(model_b, path)}


def decode_tok_s(model: Any, tok: Any, ids: list[list[int]], tokens: int) -> float:
    """Tokens/s of one batch of `ids` rows decoding `tokens` tokens each (prefill included)."""
    engine = Engine(model, tok, max_batch=len(ids), seed=0)
    for i, prompt in enumerate(ids):
        engine.add(Request(str(i), prompt, tokens, TEMPERATURE, 1.0, seed=i))
    t0 = time.perf_counter()
    made = 0
    while engine.busy:
        _, done = engine.advance(8)
        made += sum(len(c.completion_ids) for c in done)
    return made / (time.perf_counter() - t0)


# ---- the report ---------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], decode: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    names = [r["variant"] for r in rows]
    panels = [("trainer step s (median)", [r["step_s"] for r in rows], False),
              ("trainer peak RSS GiB", [r["peak_rss"] / 2**30 for r in rows], False),
              ("hand-off MiB (log)", [r["handoff_bytes"] / 2**20 for r in rows], True),
              ("checkpoint MiB (log)", [r["checkpoint_bytes"] / 2**20 for r in rows], True)]
    for ax, (label, values, log) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=["#777"] + ["#4a7"] * (len(names) - 1))
        if log:
            ax.set_yscale("log")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=9)
    if decode:
        txt = "; ".join(f"r{d['rank']}: unmerged decodes at {d['unmerged_vs_merged']:.2f}x merged" for d in decode)
        fig.suptitle(f"{title}\n{txt}", fontsize=9)
    else:
        fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{TINY}, {QUICK_SEQS} samples, 1 timed step each")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--ranks", default="8,32", help="comma-separated LoRA ranks besides full fine-tuning")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps (and hand-offs) per variant")
    ap.add_argument("--seqs", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "lora")
    args = ap.parse_args(argv)
    args.model = args.model or (TINY if args.quick else SMOLLM2)
    args.seqs = args.seqs or (QUICK_SEQS if args.quick else SEQS)
    if args.child:
        return child(args)
    repeats = args.repeats or (1 if args.quick else 3)
    ranks = [int(r) for r in args.ranks.split(",")]
    names = ["full", *(f"lora-{r}" for r in ranks)]
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    trainers: dict[str, TrainerProcess] = {}
    steps: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    takes: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    ckpt: dict[str, dict[str, Any]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-lora-", dir=args.out))
    try:
        for name in names:
            trainers[name] = TrainerProcess(name, args, args.out / f"trainer-{name}.log")
        rollout = Rollout(args.model, ranks)
        for k in range(1 + repeats):  # the first round warms up every variant
            for name in names:
                st = trainers[name].ask("step")
                took = rollout.take(name, st["path"])
                if k:
                    steps[name].append(st)
                    takes[name].append(took)
                print(f"  round {k}{' (warm-up)' if not k else ''} {name}: step {st['wall_s']:.2f}s, "
                      f"hand-off {st['bytes'] / 2**20:.1f} MiB, "
                      + ", ".join(f"{key} {v:.3f}" for key, v in took.items()), file=sys.stderr, flush=True)
        for name in names:
            ckpt[name] = trainers[name].ask(f"checkpoint {scratch / name}")
            shutil.rmtree(scratch / name, ignore_errors=True)
        peaks = {name: trainers[name].ask("quit")["max_rss"] for name in names}

        # decode with the adapter each way (rows of the latest version, interleaved repeats)
        tok = load_model(args.model, seed=0)[1]
        ids = prompts(tok, DECODE_SEQS if not args.quick else 8, GROUP)
        new = QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS
        speeds: dict[tuple[int, str], list[float]] = {}
        for k in range(1 + repeats):
            for r in ranks:
                for how, (model, _) in (("merged", rollout.merged[r]), ("unmerged", rollout.unmerged[r])):
                    tok_s = decode_tok_s(model, tok, ids, new)
                    if k:
                        speeds.setdefault((r, how), []).append(tok_s)
    finally:
        for t in trainers.values():
            t.close()
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()

    full_step = statistics.median(s["wall_s"] for s in steps["full"])
    full_bytes = steps["full"][-1]["bytes"]
    rows = []
    for name in names:
        med = {key: statistics.median(t[key] for t in takes[name]) for key in takes[name][0]}
        step_s = statistics.median(s["wall_s"] for s in steps[name])
        publish_s = statistics.median(s["publish_s"] for s in steps[name])
        row = {"variant": name, "rank": variant_rank(name), "trainable": trainers[name].info["trainable"],
               "bf16": trainers[name].info["bf16"], "step_s": step_s, "step_runs": [s["wall_s"] for s in steps[name]],
               "speedup": full_step / step_s, "peak_rss": peaks[name], "rss_loaded": trainers[name].info["rss_loaded"],
               "handoff_bytes": steps[name][-1]["bytes"], "handoff_frac": steps[name][-1]["bytes"] / full_bytes,
               "publish_s": publish_s, **med, "checkpoint_bytes": ckpt[name]["bytes"],
               "checkpoint_s": ckpt[name]["seconds"], "checkpoint_frac": ckpt[name]["bytes"] / ckpt["full"]["bytes"]}
        if name == "full":
            row["handoff_s"] = publish_s + med["load_s"]
        else:
            row["handoff_merged_s"] = publish_s + med["merged_s"]
            row["handoff_unmerged_s"] = publish_s + med["unmerged_s"]
        rows.append(row)
    decode = []
    for r in ranks:
        merged, unmerged = (statistics.median(speeds[r, how]) for how in ("merged", "unmerged"))
        decode.append({"rank": r, "merged_tok_s": merged, "unmerged_tok_s": unmerged,
                       "unmerged_vs_merged": unmerged / merged,
                       "runs": {how: speeds[r, how] for how in ("merged", "unmerged")}})

    print(f"LoRA vs full fine-tuning, {args.model}: {args.seqs} samples in groups of {GROUP}, "
          f"a default run's reply lengths, 1 thread per process, median of {repeats} after 1 warm-up "
          f"(trainer.bf16 auto: {'on' if rows[0]['bf16'] else 'off'} here)")
    print(f"machine: {cpu_cores()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(shared with other jobs: compare within this run only)")
    mib = 2**20
    print_table(
        ("variant", "trainable", "step s", "vs full", "peak RSS GiB", "hand-off MiB", "of full", "publish s",
         "load s", "merge s (a)", "unmerged s (b)", "ckpt MiB", "of full", "ckpt s"),
        [(r["variant"], f"{r['trainable'] / 1e6:.2f}M", f"{r['step_s']:.2f}", f"{r['speedup']:.2f}x",
          f"{r['peak_rss'] / 2**30:.2f}", f"{r['handoff_bytes'] / mib:.1f}", f"{100 * r['handoff_frac']:.1f}%",
          f"{r['publish_s']:.3f}", f"{r.get('load_s', float('nan')):.3f}", f"{r.get('merged_s', float('nan')):.3f}",
          f"{r.get('unmerged_s', float('nan')):.3f}", f"{r['checkpoint_bytes'] / mib:.1f}",
          f"{100 * r['checkpoint_frac']:.1f}%", f"{r['checkpoint_s']:.2f}") for r in rows])
    print()
    print_table(("rank", "merged tok/s", "unmerged tok/s", "unmerged / merged"),
                [(str(d["rank"]), f"{d['merged_tok_s']:.1f}", f"{d['unmerged_tok_s']:.1f}",
                  f"{d['unmerged_vs_merged']:.2f}x") for d in decode],
                title=f"decode, {len(ids)} rows x {new} tokens (max_batch {len(ids)}), the adapter each way:")
    met = {}
    for r in rows[1:]:
        met[r["variant"]] = {"handoff": r["handoff_frac"] <= TARGETS["handoff_frac"],
                             "checkpoint": r["checkpoint_frac"] <= TARGETS["checkpoint_frac"],
                             "step": r["speedup"] >= TARGETS["step_speedup"]}
        print(f"targets {r['variant']}: hand-off <= {TARGETS['handoff_frac']:.0%} "
              f"{'met' if met[r['variant']]['handoff'] else 'MISSED'}, checkpoint <= "
              f"{TARGETS['checkpoint_frac']:.0%} {'met' if met[r['variant']]['checkpoint'] else 'MISSED'}, "
              f"step >= {TARGETS['step_speedup']}x {'met' if met[r['variant']]['step'] else 'MISSED'}")
    write_json(args.out / "results.json",
               {"model": args.model, "seqs": args.seqs, "group": GROUP, "repeats": repeats, "alpha": ALPHA,
                "threads": 1, "cores": cpu_cores(), "loadavg_before": load_before, "loadavg_after": load_after,
                "decode_rows": len(ids), "decode_tokens": new, "targets": TARGETS, "met": met,
                "rows": rows, "decode": decode},
               command=command_line(__file__, argv))
    plot(rows, decode, args.out / "lora.png", f"LoRA vs full fine-tuning ({args.model}, 1 thread)")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'lora.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
