"""One trainer update on CPU: seconds and tokens/s, fp32 vs bf16 autocast, 1 and 2 threads.

    batch: 32 sequences (8 with --quick) of ~50 prompt + 64 completion tokens (random ids, fixed seed)
    update: Trainer.train = prox recompute + forward/backward + AdamW step + publish (all in)

The two trainers (fp32 and bf16 autocast, both with fp32 master weights) run
interleaved, repeat by repeat, so both see the same background load of a
shared machine; compare them only within one run. 1 thread is a trainer's
share of a 2-core box (the rollout worker has the other core).

    python -m bench.train_step             # SmolLM2-135M, 1 warm-up + 2 timed updates each
    python -m bench.train_step --quick     # tiny-random, seconds
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from areal_aio import wire
from areal_aio.settings import build_settings
from areal_aio.weight_store import SHM_BASE, WeightStore
from workers.models import SMOLLM2, TINY, load_model
from workers.trainer import Trainer

SEQS = 32
QUICK_SEQS = 8
"""--quick: a quarter of the batch, so the smoke run stays short on a busy machine."""
PROMPT_TOKENS = (45, 55)
"""Prompt lengths are drawn from this range: ~50, varied so padding to the longest is exercised."""
COMPLETION_TOKENS = 64
BEHAV_LOGPROB = -2.0
"""Behaviour log-prob of every token: its value changes the loss, not the work of an update."""
GROUP = 8


def make_batch(vocab: int, seqs: int = SEQS, seed: int = 0) -> list[wire.TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(seqs):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
        completion = [rng.randrange(vocab) for _ in range(COMPLETION_TOKENS)]
        out.append(wire.TrainSample(prompt_ids=prompt, completion_ids=completion,
                                    logprobs=[BEHAV_LOGPROB] * COMPLETION_TOKENS,
                                    versions=[0] * COMPLETION_TOKENS,
                                    reward=float(rng.random() < 0.5), group=i // GROUP))
    return out


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, precision in enumerate(("fp32", "bf16")):
        sel = [next(r for r in rows if r["threads"] == t and r["precision"] == precision) for t in threads]
        xs = [i + (k - 0.5) * 0.38 for i in range(len(threads))]
        ax.bar(xs, [r["seconds"] for r in sel], 0.38, label=precision)
        for x, r in zip(xs, sel, strict=True):
            ax.text(x, r["seconds"] * 1.01, f"{r['tokens_per_s']:.0f} tok/s", ha="center", fontsize=8)
    ax.set_xticks(range(len(threads)), [f"{t} thread{'s' if t > 1 else ''}" for t in threads])
    ax.set_ylabel("seconds per update (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny-random model, {QUICK_SEQS} sequences, 1 timed update each")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed updates per configuration")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--micro-tokens", type=int, default=None,
                    help="trainer.micro_tokens (default: the settings default)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/train_step"))
    args = ap.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    repeats = args.repeats or (1 if args.quick else 2)
    thread_counts = [int(t) for t in args.threads.split(",")]

    seqs = QUICK_SEQS if args.quick else SEQS
    base, tok = load_model(spec, seed=0)
    batch = make_batch(len(tok), seqs)
    overrides = [f"model.path={spec}", f"trainer.batch_size={seqs}", f"rollout.group_size={GROUP}"]
    if args.micro_tokens:
        overrides.append(f"trainer.micro_tokens={args.micro_tokens}")
    stores, trainers = [], {}
    try:
        for precision in ("fp32", "bf16"):
            s = build_settings({}, (*overrides, f"trainer.bf16={'true' if precision == 'bf16' else 'false'}"))
            store = WeightStore.create(f"bench-train-step-{precision}", base=SHM_BASE)
            stores.append(store)
            model = base if precision == "bf16" else load_model(spec, seed=0)[0]
            trainers[precision] = Trainer(s.to_dict(), store.root, model=model, tokenizer=tok)
        samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for tr in trainers.values():  # warm-up at this thread count
                tr.train(wire.Train(step=tr.version, version=tr.version, samples=batch))
            for _ in range(repeats):
                for precision, tr in trainers.items():
                    t0 = time.perf_counter()
                    reply = tr.train(wire.Train(step=tr.version, version=tr.version, samples=batch))
                    st = dict(reply.stats, wall_s=time.perf_counter() - t0)
                    samples.setdefault((threads, precision), []).append(st)
                    print(f"  threads={threads} {precision}: {st['wall_s']:.2f}s", file=sys.stderr, flush=True)
    finally:
        for store in stores:
            store.close()

    completion = seqs * COMPLETION_TOKENS
    all_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch)
    rows = []
    for (threads, precision), runs in samples.items():
        sec = statistics.median(r["wall_s"] for r in runs)
        rows.append({"threads": threads, "precision": precision, "seconds": sec,
                     "tokens_per_s": completion / sec, "all_tokens_per_s": all_tokens / sec,
                     "prox_s": statistics.median(r["prox_s"] for r in runs),
                     "publish_s": statistics.median(r["publish_s"] for r in runs),
                     "runs": [r["wall_s"] for r in runs]})
    for r in rows:
        fp32 = next(x for x in rows if x["threads"] == r["threads"] and x["precision"] == "fp32")
        r["speedup_vs_fp32"] = fp32["seconds"] / r["seconds"]

    print(f"train step, {spec}: {seqs} seqs x (~{sum(PROMPT_TOKENS) // 2} prompt + {COMPLETION_TOKENS} "
          f"completion) tokens, median of {repeats} after 1 warm-up")
    print(f"{'threads':>7}  {'precision':<9}{'s/update':>10}{'compl tok/s':>13}{'all tok/s':>11}"
          f"{'prox s':>9}{'publish s':>11}{'vs fp32':>9}")
    for r in sorted(rows, key=lambda r: (r["threads"], r["precision"] != "fp32")):
        print(f"{r['threads']:>7}  {r['precision']:<9}{r['seconds']:>10.2f}{r['tokens_per_s']:>13.1f}"
              f"{r['all_tokens_per_s']:>11.1f}{r['prox_s']:>9.2f}{r['publish_s']:>11.3f}"
              f"{r['speedup_vs_fp32']:>8.2f}x")
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak_gib:.1f} GiB (both trainers)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"model": spec, "seqs": seqs, "completion_tokens": completion, "all_tokens": all_tokens,
         "repeats": repeats, "micro_tokens": trainers["fp32"].cfg["micro_tokens"],
         "peak_rss_gib": peak_gib, "rows": rows}, indent=2))
    plot(rows, args.out / "train_step.png", f"one trainer update on CPU ({spec})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'train_step.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
