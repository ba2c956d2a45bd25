"""One trainer update: seconds and tokens/s of fp32, bf16 autocast, and bf16 with shared prompts.

    batch: 32 sequences (8 with --quick) in groups of 8, ~50 prompt + 64 completion tokens
           (random ids, fixed seed; --completion-tokens 16 is closer to a run's replies)
    update: Trainer.train = prox recompute + forward/backward + AdamW step + publish (all in)

    fp32         fp32 forward/backward, each row is prompt + completion
    bf16         bf16 autocast (fp32 master weights), each row is prompt + completion
    bf16-shared  bf16, and each group's prompt runs once (trainer.share_prompts)

The trainers run interleaved, repeat by repeat, so all see the same background
load of a shared machine; compare them only within one run. 1 thread is a
trainer's share of a 2-core box (the rollout worker has the other core).

    python bench/train_step.py             # SmolLM2-135M, 1 warm-up + 2 timed updates each
    python bench/train_step.py --quick     # tiny-random, seconds
    python bench/train_step.py --device cuda --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio import wire  # noqa: E402
from areal_aio.settings import build_settings  # noqa: E402
from areal_aio.weight_store import SHM_BASE, WeightStore  # noqa: E402
from bench.common import pyplot, save_figure, write_json  # noqa: E402
from workers.models import SMOLLM2, TINY, load_model  # noqa: E402
from workers.trainer import Trainer  # noqa: E402

SEQS = 32
QUICK_SEQS = 8
"""--quick: a quarter of the batch, so the smoke run stays short on a busy machine."""
PROMPT_TOKENS = (45, 55)
"""Prompt lengths are drawn from this range: ~50, varied so padding to the longest is exercised."""
COMPLETION_TOKENS = 64
BEHAV_LOGPROB = -2.0
"""Behaviour log-prob of every token: its value changes the loss, not the work of an update."""
GROUP = 8


VARIANTS = {"fp32": ("false", "off"), "bf16": ("true", "off"), "bf16-shared": ("true", "on")}
"""name -> (trainer.bf16, trainer.share_prompts)"""


def make_batch(vocab: int, seqs: int = SEQS, seed: int = 0,
               completion_tokens: int = COMPLETION_TOKENS) -> list[wire.TrainSample]:
    """Groups of GROUP samples sharing one random prompt, as a GRPO batch has them."""
    rng = random.Random(seed)
    out = []
    prompt: list[int] = []
    for i in range(seqs):
        if i % GROUP == 0:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
        completion = [rng.randrange(vocab) for _ in range(completion_tokens)]
        out.append(wire.TrainSample(prompt_ids=prompt, completion_ids=completion,
                                    logprobs=[BEHAV_LOGPROB] * completion_tokens,
                                    versions=[0] * completion_tokens,
                                    reward=float(rng.random() < 0.5), group=i // GROUP))
    return out


def sync_device(device: str) -> None:
    """Wait for queued GPU work, so a wall-clock time covers it (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    threads = sorted({r["threads"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(VARIANTS)
    for k, variant in enumerate(VARIANTS):
        sel = [next(r for r in rows if r["threads"] == t and r["variant"] == variant) for t in threads]
        xs = [i + (k - (len(VARIANTS) - 1) / 2) * width for i in range(len(threads))]
        ax.bar(xs, [r["seconds"] for r in sel], width, label=variant)
        for x, r in zip(xs, sel, strict=True):
            ax.text(x, r["seconds"] * 1.01, f"{r['tokens_per_s']:.0f} tok/s", ha="center", fontsize=8)
    ax.set_xticks(range(len(threads)), [f"{t} thread{'s' if t > 1 else ''}" for t in threads])
    ax.set_ylabel("seconds per update (median)")
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny-random model, {QUICK_SEQS} sequences, 1 timed update each")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed updates per configuration")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--micro-tokens", type=int, default=None,
                    help="trainer.micro_tokens (default: the settings default)")
    ap.add_argument("--completion-tokens", type=int, default=COMPLETION_TOKENS,
                    help="tokens per completion (prompts are ~50)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "train_step")
    args = ap.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    repeats = args.repeats or (1 if args.quick else 2)
    thread_counts = [int(t) for t in args.threads.split(",")]

    seqs = QUICK_SEQS if args.quick else SEQS
    base, tok = load_model(spec, seed=0)
    batch = make_batch(len(tok), seqs, completion_tokens=args.completion_tokens)
    overrides = [f"model.path={spec}", f"trainer.batch_size={seqs}", f"rollout.group_size={GROUP}",
                 f"trainer.device={args.device}", f"rollout.device={args.device}"]
    if args.micro_tokens:
        overrides.append(f"trainer.micro_tokens={args.micro_tokens}")
    stores, trainers = [], {}
    try:
        for variant, (bf16, share) in VARIANTS.items():
            s = build_settings({}, (*overrides, f"trainer.bf16={bf16}", f"trainer.share_prompts={share}"))
            store = WeightStore.create(f"bench-train-step-{variant}", base=SHM_BASE)
            stores.append(store)
            model = base if not trainers else load_model(spec, seed=0)[0]
            trainers[variant] = Trainer(s.to_dict(), store.root, model=model, tokenizer=tok)
        samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for tr in trainers.values():  # warm-up at this thread count
                tr.train(wire.Train(step=tr.version, version=tr.version, samples=batch))
            for _ in range(repeats):
                for variant, tr in trainers.items():
                    sync_device(args.device)
                    t0 = time.perf_counter()
                    reply = tr.train(wire.Train(step=tr.version, version=tr.version, samples=batch))
                    sync_device(args.device)
                    st = dict(reply.stats, wall_s=time.perf_counter() - t0)
                    samples.setdefault((threads, variant), []).append(st)
                    print(f"  threads={threads} {variant}: {st['wall_s']:.2f}s", file=sys.stderr, flush=True)
    finally:
        for store in stores:
            store.close()

    completion = seqs * args.completion_tokens
    all_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch)
    rows = []
    for (threads, variant), runs in samples.items():
        sec = statistics.median(r["wall_s"] for r in runs)
        rows.append({"threads": threads, "variant": variant, "seconds": sec,
                     "tokens_per_s": completion / sec, "all_tokens_per_s": all_tokens / sec,
                     "prox_s": statistics.median(r["prox_s"] for r in runs),
                     "publish_s": statistics.median(r["publish_s"] for r in runs),
                     "runs": [r["wall_s"] for r in runs]})
    for r in rows:
        same = {x["variant"]: x["seconds"] for x in rows if x["threads"] == r["threads"]}
        r["speedup_vs_fp32"] = same["fp32"] / r["seconds"]
        r["speedup_vs_bf16"] = same["bf16"] / r["seconds"]

    print(f"train step, {spec} on {args.device}: {seqs} seqs in groups of {GROUP} x "
          f"(~{sum(PROMPT_TOKENS) // 2} prompt + {args.completion_tokens} completion) tokens, "
          f"median of {repeats} after 1 warm-up")
    print(f"{'threads':>7}  {'variant':<12}{'s/update':>10}{'compl tok/s':>13}{'all tok/s':>11}"
          f"{'prox s':>9}{'publish s':>11}{'vs fp32':>9}{'vs bf16':>9}")
    order = list(VARIANTS)
    for r in sorted(rows, key=lambda r: (r["threads"], order.index(r["variant"]))):
        print(f"{r['threads']:>7}  {r['variant']:<12}{r['seconds']:>10.2f}{r['tokens_per_s']:>13.1f}"
              f"{r['all_tokens_per_s']:>11.1f}{r['prox_s']:>9.2f}{r['publish_s']:>11.3f}"
              f"{r['speedup_vs_fp32']:>8.2f}x{r['speedup_vs_bf16']:>8.2f}x")
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak_gib:.1f} GiB (all trainers)")
    write_json(args.out / "results.json",
        {"model": spec, "seqs": seqs, "completion_tokens": completion, "all_tokens": all_tokens,
         "repeats": repeats, "micro_tokens": trainers["fp32"].cfg["micro_tokens"],
         "device": args.device, "completion_tokens_each": args.completion_tokens,
         "peak_rss_gib": peak_gib, "rows": rows})
    plot(rows, args.out / "train_step.png", f"one trainer update on {args.device} ({spec})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'train_step.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
