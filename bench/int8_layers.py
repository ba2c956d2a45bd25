"""The int8 rollout's parts (areal_aio/workers/rollout/int8.py), one by one, on this CPU.

    python bench/int8_layers.py [--quick] [--out DIR]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/int8_layers.py   # as an AVX2 CPU

One thread. Three tables:

    matmul   one decode step's product for SmolLM2-135M's layer shapes (32 rows): float32
             x @ W^T against torch._int_mm on int8, median microseconds of each
    drift    KL(float32 || int8) per position, teacher-forced over sampled replies (T = 1, the
             whole distribution), for int8 without the rotation and with it, and for the
             weights rounded alone (inputs float32): what each part of the scheme costs
    refresh  seconds to requantize every layer after a load (what each version adds)

The weight bits are the CPU's (int8.weight_qmax: 8 where it sums int8 products exactly, else 7).
--quick: tiny-random, a few repeats (a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.workers.common import configure_torch  # noqa: E402
from areal_aio.workers.models import SMOLLM2, TINY, encode_prompt, load_model  # noqa: E402
from areal_aio.workers.rollout import int8  # noqa: E402
from bench.common import command_line, print_table, write_json  # noqa: E402
from bench.rollout_throughput import INSTRUCTION, QUESTIONS  # noqa: E402

SHAPES = [(32, 576, 1536), (32, 1536, 576), (32, 576, 576), (32, 576, 49152)]
"""(rows, in, out): gate/up, down, q/o, the output layer of SmolLM2-135M at max_batch 32."""


def time_us(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def matmuls(repeats: int) -> list[dict]:
    rows = []
    for m, k, n in SHAPES:
        x, w = torch.randn(m, k), torch.randn(n, k)
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        wq = torch.randint(-int8.weight_qmax(), int8.weight_qmax() + 1, (n, k), dtype=torch.int8).t()
        fp32 = time_us(lambda x=x, w=w: x @ w.T, repeats)
        i8 = time_us(lambda xq=xq, wq=wq: torch._int_mm(xq, wq), repeats)
        rows.append({"shape": [m, k, n], "fp32_us": fp32, "int8_us": i8, "speedup": fp32 / i8})
    return rows


class _WeightsOnly(torch.nn.Module):
    """The weight rounded as Int8Linear rounds it, the input left in float32."""

    def __init__(self, layer: int8.Int8Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.layer.packed.float().T * self.layer.scale[:, None]  # [N, K], rotated
        return self.layer.rotate(x) @ w.T


def variant(model: Any, kind: str) -> Any:
    out = copy.deepcopy(model)
    if kind == "no rotation":
        for parent in list(out.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, int8.Int8Linear(child, torch.ones(1, 1)))
        return out
    int8.quantize(out)
    if kind == "weights alone":
        for parent in list(out.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, int8.Int8Linear):
                    setattr(parent, name, _WeightsOnly(child))
    return out


def drift(model: Any, tok: Any, replies: int, new_tokens: int) -> list[dict]:
    torch.manual_seed(0)
    seqs = []
    with torch.inference_mode():
        for q in QUESTIONS[:replies]:
            ids = torch.tensor([encode_prompt(tok, q + INSTRUCTION)])
            seqs.append(model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.7,
                                       top_k=0, max_new_tokens=new_tokens)[0])
        ref = [torch.log_softmax(model(s[None]).logits[0].float(), -1) for s in seqs]
        rows = []
        for kind in ("no rotation", "rotation", "weights alone"):
            other = variant(model, kind)
            kls = [(p.exp() * (p - torch.log_softmax(other(s[None]).logits[0].float(), -1))).sum(-1)
                   for s, p in zip(seqs, ref, strict=True)]
            rows.append({"variant": kind, "kl_per_position": float(torch.cat(kls).mean())})
    return rows


def refresh_s(model: Any, repeats: int) -> float:
    layers = int8.quantize(copy.deepcopy(model))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in layers:
            layer.refresh()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-random, a few repeats")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "int8_layers")
    args = ap.parse_args(argv)
    configure_torch("cpu", 1)
    model, tok = load_model(TINY if args.quick else SMOLLM2, seed=0)
    mm = matmuls(5 if args.quick else 200)
    dr = drift(model, tok, 2 if args.quick else 8, 8 if args.quick else 48)
    rs = refresh_s(model, 1 if args.quick else 3)
    print_table(["shape (rows, in, out)", "fp32 us", "int8 us", "int8 speed-up"],
                [[str(tuple(r["shape"])), f"{r['fp32_us']:.0f}", f"{r['int8_us']:.0f}", f"{r['speedup']:.2f}x"]
                 for r in mm], title=f"\nmatmul, one thread, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print_table(["variant", "KL per position"], [[r["variant"], f"{r['kl_per_position']:.4f}"] for r in dr],
                title=f"\ndrift from float32 ({int8.weight_qmax().bit_length() + 1}-bit weights)")
    print(f"\nrequantizing every layer after a load: {rs:.2f} s")
    write_json(args.out / "results.json", {
        "model": TINY if args.quick else SMOLLM2, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "weight_qmax": int8.weight_qmax(), "matmul": mm, "drift": dr, "refresh_s": rs},
        command=command_line(__file__, argv))
    print(f"wrote {args.out / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
