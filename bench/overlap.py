"""Overlap: how much the two workers slow each other down when they run at the same time.

    python bench/overlap.py [--model SPEC] [--device cpu|cuda] [--updates 3] [--rollout-quantize int8]
        [--turn-threads N] [--out DIR] [--quick]

`areal` mode wins by running generation and training at once, `sync` by giving each the
machine in turn. What overlap buys therefore depends on the hardware: two cores that share
memory bandwidth, or two workers on one GPU, may each run slower beside the other. This
measures it directly, with the real engine and trainer (one thread each, as in a run):

    trainer alone     seconds per update (bench/train_step.py's batch: 32 samples in groups
                      of 8, ~50-token prompts, --completion-tokens replies, bf16)
    rollout alone     seconds per batch of 32 sequences (4 prompts x 8, up to --completion-tokens
                      new tokens each, the same prompts every batch)
    both at once      the rollout generates batches back to back in a child process while the
                      parent times the same trainer updates; the child reports its own rate

    turns, every core  on a CPU, trainer and rollout alone again with --turn-threads threads
                      (default: every core), as `sync` mode gives each worker the machine in turn

and from them the best step-time ratio a perfectly overlapped run could reach over one that
takes turns, with and without the slowdown, and against turns that use every core:

    ideal      = (train_alone + gen_alone) / max(train_alone, gen_alone)
    achievable = (train_alone + gen_alone) / max(train_both, gen_both)
    vs_honest_sync = (train_all_cores + gen_all_cores) / max(train_both, gen_both)

(evals and weight hand-offs left out: they favour overlap further, since `sync` waits for
both). --quick: tiny-random, 1 update, a few seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.common import command_line, print_table, pyplot, save_figure, write_json  # noqa: E402

SEQS, GROUP = 32, 8
COMPLETION_TOKENS = 16
"""Replies of a run that has learned the default task are ~9-20 tokens."""


def _gen_batch(engine: Any, ids: list[list[int]], tokens: int, tag: str) -> int:
    from areal_aio.workers.rollout.engine import Request

    for i, prompt in enumerate(ids):
        engine.add(Request(f"{tag}.{i}", prompt, tokens, 0.7, 1.0))
    done = 0
    while engine.busy:
        done += sum(len(c.completion_ids) for c in engine.step())
    return done


def rollout_child(spec: str, device: str, dtype: str, tokens: int, ready: Any, stop: Any, out: Any,
                  threads: int = 1, quantize: str = "off") -> None:
    """Generate batches back to back until `stop`, at least one (a phase shorter than a batch
    still measures one); report (batches, tokens, seconds)."""
    sys.path.insert(0, str(REPO))
    from areal_aio.workers.common import configure_torch
    from areal_aio.workers.models import load_model
    from areal_aio.workers.rollout.engine import Engine
    from bench.rollout_throughput import prompts

    configure_torch(device, threads)
    model, tok = load_model(spec, seed=0, dtype=dtype, device=device)
    if quantize == "int8":
        from areal_aio.workers.rollout import int8

        int8.quantize(model)
    engine = Engine(model, tok, max_batch=SEQS, seed=0)
    ids = prompts(tok, SEQS, GROUP)
    _gen_batch(engine, ids, 4, "warm")
    ready.set()
    batches = gen_tokens = 0
    t0 = time.perf_counter()
    while not batches or not stop.is_set():
        gen_tokens += _gen_batch(engine, ids, tokens, f"b{batches}")
        batches += 1
    out.put((batches, gen_tokens, time.perf_counter() - t0))


def time_updates(trainer: Any, batch: list, n: int, device: str) -> list[float]:
    from areal_aio import wire
    from bench.train_step import sync_device

    times = []
    for _ in range(n):
        sync_device(device)
        t0 = time.perf_counter()
        trainer.train(wire.Train(step=trainer.version, version=trainer.version, samples=batch))
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return times


def run_rollout(spec: str, device: str, dtype: str, tokens: int, threads: int = 1,
                quantize: str = "off") -> tuple[Any, Any, Any, Any]:
    """Start the generating child; (process, ready, stop, out)."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=rollout_child, args=(spec, device, dtype, tokens, ready, stop, out, threads,
                                                   quantize), daemon=True)
    proc.start()
    return proc, ready, stop, out


def finish(proc: Any, stop: Any, out: Any) -> tuple[int, int, float]:
    """Stop the child after its current batch; its (batches, tokens, seconds)."""
    stop.set()
    result = out.get(timeout=600)
    proc.join(timeout=60)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model spec (default SmolLM2-135M; tiny-random with --quick)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (both workers on it)")
    ap.add_argument("--updates", type=int, default=None, help="timed trainer updates per phase (default 3)")
    ap.add_argument("--completion-tokens", type=int, default=COMPLETION_TOKENS)
    ap.add_argument("--rollout-dtype", default="float32", help="rollout.dtype: float32 | bfloat16")
    ap.add_argument("--rollout-quantize", default="off", choices=("off", "int8"), help="rollout.quantize")
    ap.add_argument("--turn-threads", type=int, default=None,
                    help="threads of each worker taking turns, as sync mode gives them (default: every core; "
                         "0 = skip; CPU only)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "overlap")
    ap.add_argument("--quick", action="store_true", help="tiny-random, 1 update per phase")
    args = ap.parse_args(argv)

    import torch

    from areal_aio.settings import build_settings
    from areal_aio.store.weights import SHM_BASE, WeightStore
    from areal_aio.workers.common import configure_torch
    from areal_aio.workers.models import SMOLLM2, TINY, load_model
    from areal_aio.workers.trainer.worker import Trainer
    from bench.train_step import make_batch, reply_lengths

    spec = args.model or (TINY if args.quick else SMOLLM2)
    n = args.updates or (1 if args.quick else 3)
    tokens = args.completion_tokens
    configure_torch(args.device, 1)
    model, tok = load_model(spec, seed=0, device=args.device)
    batch = make_batch(len(tok), reply_lengths("uniform", SEQS, tokens))
    s = build_settings({}, (f"model.path={spec}", f"trainer.batch_size={SEQS}", f"rollout.group_size={GROUP}",
                            f"trainer.device={args.device}", f"rollout.device={args.device}"))
    store = WeightStore.create("bench-overlap", base=SHM_BASE)
    try:
        trainer = Trainer(s.to_dict(), store.root, model=model, tokenizer=tok)
        time_updates(trainer, batch, 1, args.device)  # warm-up
        train_alone = time_updates(trainer, batch, n, args.device)
        print(f"  trainer alone: {statistics.median(train_alone):.2f} s/update", file=sys.stderr, flush=True)

        quantize = args.rollout_quantize

        def rollout_alone(threads: int, seconds: float) -> tuple[int, int, float]:
            """The child generating alone for about `seconds` (the trainer's timed phase)."""
            proc, ready, stop, out = run_rollout(spec, args.device, args.rollout_dtype, tokens, threads, quantize)
            ready.wait(timeout=600)
            time.sleep(max(seconds, 2.0))
            return finish(proc, stop, out)

        gen_alone = rollout_alone(1, sum(train_alone))
        print(f"  rollout alone: {gen_alone[2] / max(gen_alone[0], 1):.2f} s/batch", file=sys.stderr, flush=True)

        # both at once
        proc, ready, stop, out = run_rollout(spec, args.device, args.rollout_dtype, tokens, 1, quantize)
        ready.wait(timeout=600)
        train_both = time_updates(trainer, batch, n, args.device)
        gen_both = finish(proc, stop, out)

        # taking turns with every core (sync mode's preset on a CPU)
        turn_threads = 0 if args.device != "cpu" else (
            args.turn_threads if args.turn_threads is not None else os.cpu_count() or 1)
        train_all = gen_all = None
        if turn_threads:
            torch.set_num_threads(turn_threads)
            time_updates(trainer, batch, 1, args.device)
            train_all = time_updates(trainer, batch, n, args.device)
            torch.set_num_threads(1)
            gen_all = rollout_alone(turn_threads, sum(train_all))
            print(f"  turns with {turn_threads} threads: trainer {statistics.median(train_all):.2f} s/update, "
                  f"rollout {gen_all[2] / max(gen_all[0], 1):.2f} s/batch", file=sys.stderr, flush=True)
    finally:
        store.close()

    def per_batch(r: tuple[int, int, float]) -> float | None:
        return r[2] / r[0] if r[0] else None

    t_alone, t_both = statistics.median(train_alone), statistics.median(train_both)
    g_alone, g_both = per_batch(gen_alone), per_batch(gen_both)
    ideal = (t_alone + g_alone) / max(t_alone, g_alone) if g_alone else None
    achievable = (t_alone + g_alone) / max(t_both, g_both) if g_alone and g_both else None
    t_all = statistics.median(train_all) if train_all else None
    g_all = per_batch(gen_all) if gen_all else None
    vs_honest = (t_all + g_all) / max(t_both, g_both) if t_all and g_all and g_both else None
    rows = [{"worker": "trainer", "alone_s": t_alone, "both_s": t_both, "slowdown": t_both / t_alone,
             "unit": "s/update"},
            {"worker": "rollout", "alone_s": g_alone, "both_s": g_both,
             "slowdown": g_both / g_alone if g_alone and g_both else None, "unit": "s/batch",
             "tok_s_alone": gen_alone[1] / gen_alone[2], "tok_s_both": gen_both[1] / gen_both[2]}]
    print_table(["worker", "alone", "both at once", "slowdown"],
                [[r["worker"], f"{r['alone_s']:.2f} {r['unit']}" if r["alone_s"] else "-",
                  f"{r['both_s']:.2f} {r['unit']}" if r["both_s"] else "-",
                  f"{r['slowdown']:.2f}x" if r["slowdown"] else "-"] for r in rows],
                title=f"\noverlap on {args.device}, {spec} (rollout {args.rollout_dtype}, quantize {args.rollout_quantize}): {SEQS} samples in groups of {GROUP}, "
                      f"{tokens}-token replies, one thread per worker")
    print(f"overlapped step vs taking turns: ideal {ideal:.2f}x, with the slowdown {achievable:.2f}x"
          if ideal and achievable else "overlapped step vs taking turns: not measured (no batch finished)")
    if vs_honest:
        print(f"taking turns with {turn_threads} threads each: trainer {t_all:.2f} s/update "
              f"({t_alone / t_all:.2f}x one thread), rollout {g_all:.2f} s/batch ({g_alone / g_all:.2f}x); "
              f"overlapped step vs these turns (honest sync): {vs_honest:.2f}x")
    results = {"model": spec, "device": args.device, "rollout_dtype": args.rollout_dtype,
               "rollout_quantize": args.rollout_quantize, "seqs": SEQS, "group": GROUP,
               "completion_tokens": tokens, "updates": n, "rows": rows, "ideal_ratio": ideal,
               "achievable_ratio": achievable, "turn_threads": turn_threads, "train_all_cores_s": train_all,
               "gen_all_cores": dict(zip(("batches", "tokens", "seconds"), gen_all, strict=True)) if gen_all else None,
               "vs_honest_sync_ratio": vs_honest,
               "train_alone_s": train_alone, "train_both_s": train_both,
               "gen_alone": dict(zip(("batches", "tokens", "seconds"), gen_alone, strict=True)),
               "gen_both": dict(zip(("batches", "tokens", "seconds"), gen_both, strict=True))}
    write_json(args.out / "results.json", results, command=command_line(__file__, argv))
    plot(rows, ideal, achievable, args.out / "overlap.png", f"overlap on {args.device} ({spec})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'overlap.png'}", file=sys.stderr)
    return 0


def plot(rows: list[dict], ideal: float | None, achievable: float | None, path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, (key, label) in enumerate((("alone_s", "alone"), ("both_s", "both at once"))):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(rows))]
        ax.bar(xs, [r[key] or 0.0 for r in rows], 0.38, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['worker']} ({r['unit']})" for r in rows])
    ax.set_ylabel("seconds (median)")
    if ideal and achievable:
        title += f"\noverlap vs turns: ideal {ideal:.2f}x, with the slowdown {achievable:.2f}x"
    ax.set_title(title, fontsize=10)
    ax.legend()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
