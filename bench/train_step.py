"""One trainer update: seconds and tokens/s of fp32 and bf16 autocast, each unpacked and packed.

    batch: 32 sequences (8 with --quick) in groups of 8, ~50-token prompts (random ids,
           fixed seed), replies of one of two length mixes (--lengths, default both):
             uniform  every reply --completion-tokens long (64)
             mixed    a default run's replies, 2 to 64 tokens in one group (MIXED_REPLY_TOKENS)
    update: Trainer.train = prox recompute + forward/backward + AdamW step + publish (all in)

    fp32         fp32 forward/backward, each row is prompt + completion
    fp32-shared  fp32, and each group is one packed row: its prompt once, then its
                 completions (trainer.share_prompts, workers/trainer/microbatch.py); the default
                 on a CPU without native bf16 (trainer.bf16 = auto)
    bf16         bf16 autocast (fp32 master weights), each row is prompt + completion
    bf16-shared  bf16, and each group is one packed row: its prompt once, then its
                 completions (trainer.share_prompts, workers/trainer/microbatch.py)

A uniform mix hides what padding costs: a run's replies in one group differ by up
to 30x, so a layout that pads rows to the longest computes up to 3x their tokens.
`computed` is the token positions the update's forward ran on (padding included)
over the completion tokens it trained.

The trainers run interleaved, repeat by repeat, so all see the same background
load of a shared machine; compare them only within one run. 1 thread is a
trainer's share of a 2-core box (the rollout worker has the other core).

    python bench/train_step.py             # SmolLM2-135M, 1 warm-up + 2 timed updates each
    python bench/train_step.py --quick     # tiny-random, seconds
    python bench/train_step.py --threads 1 --lengths mixed
    python bench/train_step.py --threads 1 --variants fp32,fp32-shared
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
from areal_aio.store.weights import SHM_BASE, WeightStore  # noqa: E402
from areal_aio.workers.models import SMOLLM2, TINY, load_model  # noqa: E402
from areal_aio.workers.trainer.worker import Trainer  # noqa: E402
from bench.common import command_line, pyplot, save_figure, write_json  # noqa: E402

SEQS = 32
QUICK_SEQS = 8
"""--quick: a quarter of the batch, so the smoke run stays short on a busy machine."""
PROMPT_TOKENS = (45, 55)
"""Prompt lengths are drawn from this range: ~50, varied so padding to the longest is exercised."""
COMPLETION_TOKENS = 64
BEHAV_LOGPROB = -2.0
"""Behaviour log-prob of every token: its value changes the loss, not the work of an update."""
GROUP = 8
MIXED_REPLY_TOKENS = ((7, 25, 8, 24, 17, 64, 8, 8), (48, 8, 30, 64, 23, 48, 14, 8),
                      (64, 22, 3, 27, 37, 64, 2, 20))
"""Reply lengths of three groups of a default run (`python -m areal_aio run settings.toml`,
areal mode, SmolLM2-135M, max 64 new tokens; the samples of step 5): the batch's group k takes
row k mod 3. Mean 26.8 tokens, 161-243 per group of 8 where padding to the longest makes 512."""
LENGTH_MIXES = ("uniform", "mixed")


VARIANTS = {"fp32": ("false", "off"), "fp32-shared": ("false", "on"), "bf16": ("true", "off"),
            "bf16-shared": ("true", "on")}
"""name -> (trainer.bf16, trainer.share_prompts)"""


def reply_lengths(mix: str, seqs: int, completion_tokens: int = COMPLETION_TOKENS) -> list[int]:
    """Reply length of each of `seqs` samples: uniform, or the run's groups (MIXED_REPLY_TOKENS)."""
    if mix == "uniform":
        return [completion_tokens] * seqs
    if mix == "mixed":
        return [MIXED_REPLY_TOKENS[(i // GROUP) % len(MIXED_REPLY_TOKENS)][i % GROUP] for i in range(seqs)]
    raise ValueError(f"length mix {mix!r}; choose one of {', '.join(LENGTH_MIXES)}")


def make_batch(vocab: int, lengths: list[int], seed: int = 0) -> list[wire.TrainSample]:
    """Groups of GROUP samples sharing one random prompt, as a GRPO batch has them; sample i
    has a reply of lengths[i] tokens."""
    rng = random.Random(seed)
    out = []
    prompt: list[int] = []
    for i, n in enumerate(lengths):
        if i % GROUP == 0:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
        completion = [rng.randrange(vocab) for _ in range(n)]
        out.append(wire.TrainSample(prompt_ids=prompt, completion_ids=completion,
                                    logprobs=[BEHAV_LOGPROB] * n, versions=[0] * n,
                                    reward=float(rng.random() < 0.5), group=i // GROUP))
    return out


def sync_device(device: str) -> None:
    """Wait for queued GPU work, so a wall-clock time covers it (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    cases = sorted({(r["threads"], r["lengths"]) for r in rows},
                   key=lambda c: (c[0], LENGTH_MIXES.index(c[1])))
    fig, ax = plt.subplots(figsize=(3 + 2 * len(cases), 4))
    names = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    width = 0.8 / len(names)
    for k, variant in enumerate(names):
        sel = [next(r for r in rows if (r["threads"], r["lengths"]) == c and r["variant"] == variant)
               for c in cases]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, [r["seconds"] for r in sel], width, label=variant)
        for x, r in zip(xs, sel, strict=True):
            ax.text(x, r["seconds"] * 1.01, f"{r['tokens_per_s']:.0f} tok/s", ha="center", fontsize=8)
    ax.set_xticks(range(len(cases)), [f"{t} thread{'s' if t > 1 else ''}, {mix} replies" for t, mix in cases])
    ax.set_ylabel("seconds per update (median)")
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path, dpi=120)


def _ratio(x: float | None) -> str:
    return f"{'-':>9}" if x is None else f"{x:>8.2f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny-random model, {QUICK_SEQS} sequences, 1 timed update each")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="timed updates per configuration")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--micro-tokens", type=int, default=None,
                    help="trainer.micro_tokens (default: the settings default)")
    ap.add_argument("--lengths", choices=(*LENGTH_MIXES, "both"), default="both",
                    help="reply lengths: uniform (--completion-tokens each), mixed (a default "
                         "run's, MIXED_REPLY_TOKENS) or both, interleaved")
    ap.add_argument("--completion-tokens", type=int, default=COMPLETION_TOKENS,
                    help="tokens per completion of the uniform mix (prompts are ~50)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)} (bf16 is slow on a CPU "
                         "without native bf16: leave it out there to save time)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "train_step")
    args = ap.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    repeats = args.repeats or (1 if args.quick else 2)
    thread_counts = [int(t) for t in args.threads.split(",")]
    mixes = LENGTH_MIXES if args.lengths == "both" else (args.lengths,)
    variants = {v: VARIANTS[v] for v in args.variants.split(",")}  # KeyError names a bad one

    seqs = QUICK_SEQS if args.quick else SEQS
    base, tok = load_model(spec, seed=0)
    batches = {mix: make_batch(len(tok), reply_lengths(mix, seqs, args.completion_tokens)) for mix in mixes}
    overrides = [f"model.path={spec}", f"trainer.batch_size={seqs}", f"rollout.group_size={GROUP}",
                 f"trainer.device={args.device}", f"rollout.device={args.device}"]
    if args.micro_tokens:
        overrides.append(f"trainer.micro_tokens={args.micro_tokens}")
    stores, trainers = [], {}
    try:
        for variant, (bf16, share) in variants.items():
            s = build_settings({}, (*overrides, f"trainer.bf16={bf16}", f"trainer.share_prompts={share}"))
            store = WeightStore.create(f"bench-train-step-{variant}", base=SHM_BASE)
            stores.append(store)
            model = base if not trainers else load_model(spec, seed=0)[0]
            trainers[variant] = Trainer(s.to_dict(), store.root, model=model, tokenizer=tok)
        samples: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            # warm-up: every batch shape once, then one update at each new thread count
            warm = list(batches.values())[0 if threads == thread_counts[0] else -1:]
            for tr in trainers.values():
                for batch in warm:
                    tr.train(wire.Train(step=tr.version, version=tr.version, samples=batch))
            for _ in range(repeats):
                for mix, batch in batches.items():
                    for variant, tr in trainers.items():
                        sync_device(args.device)
                        t0 = time.perf_counter()
                        reply = tr.train(wire.Train(step=tr.version, version=tr.version, samples=batch))
                        sync_device(args.device)
                        st = dict(reply.stats, wall_s=time.perf_counter() - t0)
                        samples.setdefault((threads, mix, variant), []).append(st)
                        print(f"  threads={threads} {mix} {variant}: {st['wall_s']:.2f}s",
                              file=sys.stderr, flush=True)
    finally:
        for store in stores:
            store.close()

    shapes = {mix: {"completion_tokens": sum(len(s.completion_ids) for s in batch),
                    "all_tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch),
                    "reply_lengths": [len(s.completion_ids) for s in batch]}
              for mix, batch in batches.items()}
    rows = []
    for (threads, mix, variant), runs in samples.items():
        sec = statistics.median(r["wall_s"] for r in runs)
        shape = shapes[mix]
        rows.append({"threads": threads, "lengths": mix, "variant": variant, "seconds": sec,
                     "tokens_per_s": shape["completion_tokens"] / sec,
                     "all_tokens_per_s": shape["all_tokens"] / sec,
                     "computed_tokens": runs[0]["computed_tokens"],
                     "computed_per_token": runs[0]["computed_tokens"] / shape["completion_tokens"],
                     "prox_s": statistics.median(r["prox_s"] for r in runs),
                     "publish_s": statistics.median(r["publish_s"] for r in runs),
                     "runs": [r["wall_s"] for r in runs]})
    for r in rows:
        same = {x["variant"]: x["seconds"] for x in rows
                if (x["threads"], x["lengths"]) == (r["threads"], r["lengths"])}
        r["speedup_vs_fp32"] = same["fp32"] / r["seconds"] if "fp32" in same else None
        r["speedup_vs_bf16"] = same["bf16"] / r["seconds"] if "bf16" in same else None

    print(f"train step, {spec} on {args.device}: {seqs} seqs in groups of {GROUP}, "
          f"~{sum(PROMPT_TOKENS) // 2}-token prompts, median of {repeats} after 1 warm-up")
    for mix, shape in shapes.items():
        lengths = shape["reply_lengths"]
        print(f"  {mix:<8} replies {min(lengths)}-{max(lengths)} tokens, "
              f"{shape['completion_tokens']} in all")
    print(f"{'threads':>7}  {'lengths':<9}{'variant':<12}{'s/update':>10}{'compl tok/s':>13}"
          f"{'all tok/s':>11}{'computed':>10}{'prox s':>9}{'publish s':>11}{'vs fp32':>9}{'vs bf16':>9}")
    order = list(variants)
    for r in sorted(rows, key=lambda r: (r["threads"], LENGTH_MIXES.index(r["lengths"]),
                                         order.index(r["variant"]))):
        print(f"{r['threads']:>7}  {r['lengths']:<9}{r['variant']:<12}{r['seconds']:>10.2f}"
              f"{r['tokens_per_s']:>13.1f}{r['all_tokens_per_s']:>11.1f}"
              f"{r['computed_per_token']:>9.2f}x{r['prox_s']:>9.2f}{r['publish_s']:>11.3f}"
              f"{_ratio(r['speedup_vs_fp32'])}{_ratio(r['speedup_vs_bf16'])}")
    print("computed: token positions the forward ran on (padding included) per completion token")
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak_gib:.1f} GiB (all trainers)")
    write_json(args.out / "results.json",
        {"model": spec, "seqs": seqs, "mixes": shapes, "repeats": repeats,
         "micro_tokens": next(iter(trainers.values())).cfg.micro_tokens, "device": args.device,
         "completion_tokens_each": args.completion_tokens, "peak_rss_gib": peak_gib, "rows": rows},
        command=command_line(__file__, argv))
    plot(rows, args.out / "train_step.png", f"one trainer update on {args.device} ({spec})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'train_step.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
