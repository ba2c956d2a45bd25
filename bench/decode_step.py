"""Where a decode step's time goes: one step of the engine's paths timed alone, at one batch.

    python bench/decode_step.py --device cuda --dtype bfloat16 --model DIR --random-weights
    python bench/decode_step.py --quick        (tiny-random on the CPU: a smoke run)

`--rows` requests of about `--prompt-tokens` tokens fill the engine; each figure is the mean of
`--steps` steps with the device synchronized after each (milliseconds):

    dynamic        Engine._decode: the batch's own KV cache, one launch per kernel
    static/eager   the static path's step (workers/rollout/slots.py) run op by op
    static/graph   the same step replayed from its captured CUDA graph (GPU only)
    advance        Engine.advance(1) on the static path: the step, then the host's look at the
                   tokens (what a step costs while requests wait for a slot)
    weights_ms     the time to read the weights once at the device-to-device copy's bandwidth:
                   the floor of a decode step that is bound by memory, not by launches

On a GPU it also lists the kernels of a few replayed steps by their CUDA time (torch's
profiler). Results: OUT/results.json (with provenance).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.workers.models import SMOLLM2, TINY, encode_prompt, load_model  # noqa: E402
from areal_aio.workers.rollout.engine import Engine, Request, _mode  # noqa: E402
from bench.common import command_line, write_json  # noqa: E402
from bench.rollout_throughput import _weight_bytes, copy_bandwidth_tb_s  # noqa: E402

TEMPERATURE = 0.7


def _engine(model: Any, tok: Any, rows: int, prompt_tokens: int, new_tokens: int, **kw: Any) -> Engine:
    """An engine with `rows` running rows (admitted, one token drawn), none near its limit."""
    engine = Engine(model, tok, max_batch=rows, seed=0, look_every_step=False, **kw)
    text = "Calculate the sum of the numbers " + " ".join(str(i) for i in range(prompt_tokens // 2))
    for i in range(rows):
        engine.add(Request(str(i), encode_prompt(tok, text + f" and {i}."), new_tokens, TEMPERATURE))
    engine.advance(1)
    return engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_ms(fn: Any, steps: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
        _sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


@torch.inference_mode()
def measure(model: Any, tok: Any, rows: int, prompt_tokens: int, steps: int) -> dict[str, Any]:
    device = next(model.parameters()).device
    new = 3 * steps + 8  # every measurement below runs on rows far from their limit
    out: dict[str, Any] = {}
    dynamic = _engine(model, tok, rows, prompt_tokens, new)
    out["dynamic_ms"] = _mean_ms(lambda: dynamic._decode(dynamic.batch), steps, device)
    eager = _engine(model, tok, rows, prompt_tokens, new, static=True, graphs=False)
    out["static_eager_ms"] = _mean_ms(lambda: eager._decode(eager.batch), steps, device)
    out["columns"] = eager.batch.columns
    graphs = _engine(model, tok, rows, prompt_tokens, new, static=True)
    slots = graphs.batch
    mode = _mode(slots.seqs)
    if device.type == "cuda":
        slots.step(mode)  # captures
        out["graph_error"] = slots.graph_error
        out["static_graph_ms"] = _mean_ms(lambda: slots.step(mode), steps, device)
    out["advance_ms"] = _mean_ms(lambda: graphs.advance(1), steps, device)
    if device.type == "cuda":
        out["copy_tb_s"] = copy_bandwidth_tb_s(str(device))
        out["weights_ms"] = _weight_bytes(model) / (out["copy_tb_s"] * 1e12) * 1e3
        out["kernels"] = _kernels(slots, mode)
    return out


def _kernels(slots: Any, mode: str, steps: int = 5) -> str:
    """The profiler's table of `steps` replayed steps, by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            slots.step(mode)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random on the CPU, few steps")
    parser.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; --quick: {TINY})")
    parser.add_argument("--random-weights", action="store_true", help="--model's config with random weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "decode_step"))
    args = parser.parse_args(argv)
    spec = args.model or (TINY if args.quick else SMOLLM2)
    rows, steps = (8, 3) if args.quick else (args.rows, args.steps)
    model, tok = load_model(spec, seed=0, dtype=args.dtype, device=args.device, random_weights=args.random_weights)
    result = {"model": spec, "device": args.device, "dtype": args.dtype, "rows": rows,
              "prompt_tokens": args.prompt_tokens, "steps": steps,
              **measure(model, tok, rows, args.prompt_tokens, steps)}
    kernels = result.pop("kernels", None)
    for key, value in result.items():
        print(f"{key:16s} {value:.3f}" if isinstance(value, float) else f"{key:16s} {value}")
    if kernels:
        print(kernels)
        result["kernels"] = kernels.splitlines()
    write_json(Path(args.out) / "results.json", result, command=command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
