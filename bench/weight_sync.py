"""Weight sync through /dev/shm: publish + load of a model vs a raw copy of the same bytes.

    trainer model --publish--> v<N>.safetensors (tmpfs) --load_weights--> rollout model
    raw: bytes buffer --write--> file (tmpfs) --readinto--> bytes buffer

The raw copy is the floor (one write, one read of the same number of bytes with
plain file IO); the store should cost at most ~1.5x of it. Two cases: the
rollout generates in float32 (file = the fp32 weights) or in bfloat16 (the
trainer casts while publishing, the rollout model is bf16).

    python -m bench.weight_sync            # SmolLM2-135M, 7 repeats
    python -m bench.weight_sync --quick    # tiny-random, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.store.safetensors_io import load_weights  # noqa: E402
from areal_aio.store.weights import SHM_BASE, WeightStore  # noqa: E402
from areal_aio.workers.models import SMOLLM2, TINY, load_model  # noqa: E402
from bench.common import command_line, pyplot, save_figure, write_json  # noqa: E402

TARGET_RATIO = 1.5
"""(publish + load) / (raw write + raw read): above this the store adds copies it should not."""
IO_CHUNK = 64 << 20
"""Raw copy in 64 MiB pieces: big enough that syscall overhead is invisible."""


def raw_copy(path: Path, buf: bytearray, out: bytearray) -> tuple[float, float]:
    """(write s, read s) of `buf` through a file at `path` with plain file IO."""
    view, back = memoryview(buf), memoryview(out)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for i in range(0, len(view), IO_CHUNK):
            fh.write(view[i:i + IO_CHUNK])
    t1 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        got = 0
        while got < len(back):
            n = fh.readinto(back[got:got + IO_CHUNK])
            if not n:
                raise RuntimeError("short read")
            got += n
    t2 = time.perf_counter()
    path.unlink()
    return t1 - t0, t2 - t1


def run_case(store: WeightStore, src: Any, dst: Any, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """Median publish/load/raw seconds over `repeats` after one warm-up of each."""
    rows = {"publish_s": [], "load_s": [], "raw_write_s": [], "raw_read_s": []}
    path = store.publish(src, 0, dtype=dtype)
    nbytes = path.stat().st_size
    load_weights(dst, path)
    buf, out = bytearray(os.urandom(1 << 20)) * (nbytes >> 20 or 1), bytearray(0)
    buf = buf[:nbytes] if len(buf) >= nbytes else buf + bytearray(nbytes - len(buf))
    out = bytearray(nbytes)
    raw_copy(store.root / "raw.bin", buf, out)  # warm-up
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        path = store.publish(src, v, dtype=dtype)
        t1 = time.perf_counter()
        load_weights(dst, path)
        t2 = time.perf_counter()
        store.retain([])
        w, r = raw_copy(store.root / "raw.bin", buf, out)
        rows["publish_s"].append(t1 - t0)
        rows["load_s"].append(t2 - t1)
        rows["raw_write_s"].append(w)
        rows["raw_read_s"].append(r)
    med = {k: statistics.median(v) for k, v in rows.items()}
    # the loaded copy must be the published weights (bit-exact in the file's dtype)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        if not torch.equal(a.detach().to(dtype), b):
            raise AssertionError(f"{name}: loaded weights differ from the published ones")
    store_s = med["publish_s"] + med["load_s"]
    raw_s = med["raw_write_s"] + med["raw_read_s"]
    return {"dtype": str(dtype).removeprefix("torch."), "bytes": nbytes, **med,
            "store_s": store_s, "raw_s": raw_s, "ratio": store_s / raw_s,
            "store_gb_s": 2 * nbytes / store_s / 1e9, "raw_gb_s": 2 * nbytes / raw_s / 1e9,
            "samples": rows}


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [r["dtype"] for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["publish_s"] for r in results], 0.4, label="store: publish")
    ax.bar([i - 0.2 for i in x], [r["load_s"] for r in results], 0.4,
           bottom=[r["publish_s"] for r in results], label="store: load")
    ax.bar([i + 0.2 for i in x], [r["raw_write_s"] for r in results], 0.4, label="raw: write")
    ax.bar([i + 0.2 for i in x], [r["raw_read_s"] for r in results], 0.4,
           bottom=[r["raw_write_s"] for r in results], label="raw: read")
    for i, r in enumerate(results):
        ax.text(i, max(r["store_s"], r["raw_s"]) * 1.02, f"{r['ratio']:.2f}x", ha="center")
    ax.set_xticks(list(x), [f"rollout {lbl}\n{r['bytes'] / 2**20:.0f} MiB" for lbl, r in zip(labels, results, strict=True)])
    ax.set_ylabel("seconds (median)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-random model, 3 repeats")
    ap.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; {TINY} with --quick)")
    ap.add_argument("--random-weights", action="store_true",
                    help="--model is a folder of config + tokenizer: weights drawn at random (the shape is what is timed)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's share)")
    ap.add_argument("--device", default="cpu",
                    help="where both models live: cpu | cuda (then publish and load include the copies off and onto the GPU)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "weight_sync")
    args = ap.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    src, _ = load_model(spec, seed=0, device=args.device, random_weights=args.random_weights)
    store = WeightStore.create("bench-weight-sync", base=SHM_BASE)
    results = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            dst, _ = load_model(spec, seed=1, dtype=str(dtype).removeprefix("torch."), device=args.device,
                                random_weights=args.random_weights)
            results.append(run_case(store, src, dst, dtype, repeats))
            del dst
    finally:
        store.close()
    print(f"weight sync, {spec} on {args.device}, {repeats} repeats (median), threads={args.threads}, "
          f"store in {SHM_BASE}")
    print(f"{'rollout dtype':<14}{'MiB':>8}{'publish s':>11}{'load s':>9}{'raw w s':>9}"
          f"{'raw r s':>9}{'store GB/s':>11}{'raw GB/s':>10}{'ratio':>8}")
    for r in results:
        print(f"{r['dtype']:<14}{r['bytes'] / 2**20:>8.1f}{r['publish_s']:>11.4f}{r['load_s']:>9.4f}"
              f"{r['raw_write_s']:>9.4f}{r['raw_read_s']:>9.4f}{r['store_gb_s']:>11.2f}"
              f"{r['raw_gb_s']:>10.2f}{r['ratio']:>7.2f}x")
    ok = all(r["ratio"] <= TARGET_RATIO for r in results)
    print(f"target: ratio <= {TARGET_RATIO}: {'met' if ok else 'MISSED'}")
    write_json(args.out / "results.json",
        {"model": spec, "device": args.device, "repeats": repeats, "threads": args.threads, "target_ratio": TARGET_RATIO,
         "met": ok, "cases": results},
        command=command_line(__file__, argv))
    plot(results, args.out / "weight_sync.png", f"weight sync through /dev/shm ({spec})")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'weight_sync.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
