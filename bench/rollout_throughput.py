"""Rollout throughput: the continuous-batching Engine against `model.generate` on the same prompts.

    python bench/rollout_throughput.py [--quick] [--threads 1,2] [--out DIR]
    python bench/rollout_throughput.py --device cuda --dtype bfloat16 --threads 1 --sequences 256 --max-batch 128
    python bench/rollout_throughput.py --threads 1 --no-hf-cb --only engine --ops   (where a decode step's time goes)
    python bench/rollout_throughput.py --model FOLDER --random-weights ...   (FOLDER: a model's
        config.json and tokenizer files; the weights are random, for a machine the model can't reach)

Every method generates the same sequences (arithmetic prompts, GRPO groups of identical
prompts), with the same sampling (temperature, top_p) and the same max_new_tokens:

    engine           areal_aio.workers.rollout.engine.Engine, all sequences queued at once, max_batch slots,
                     driven as the rollout worker drives it: advance() in chunks of
                     rollout.chunk_tokens steps (on a GPU the host reads tokens once a chunk
                     while no request waits for a slot; on a CPU after every step)
    engine+updates   the same, with new weights loaded (KV rebuilt) every --update-every steps
    engine+updates/keep  the same updates with rollout.kv_on_update = keep (no rebuild: the rows
                     decode on over the old weights' KV)
    engine/static    the engine's static decode path (rollout.static_decode = on: fixed slots, a
                     preallocated KV cache, on a GPU each step replayed from a captured CUDA
                     graph); the captures apart (capture_s: once per engine, as compile_s below
                     is once per process), tok_s_with_capture with them
    engine/static+updates  the same with weight updates (the graphs survive them: weights are
                     loaded in place)
    engine/static/wait4  engine/static looking every 4 steps while requests wait for a slot,
                     not every step (a slot freed by an EOS idles up to 3 steps; the host
                     waits for the device a quarter as often)
    engine/int8      the engine on the model with rollout.quantize = int8 (CPU only), and
    engine/int8+updates  with updates, each load requantizing (areal_aio/workers/rollout/int8.py),
    engine/int8+updates/keep  and those updates keeping the KV
    generate/b<G>    model.generate on static batches of one group each (G sequences)
    generate/b<M>    model.generate on static batches of max_batch sequences
    generate/b<M>/static  the same with transformers' static KV cache, with which generate
                     compiles the decode step (torch.compile; on a GPU with CUDA graphs; on a
                     CPU only with --compiled); compile time apart (compile_s)
    hf-cb            transformers' own continuous batching (model.generate_batch, with logprobs)

--ops adds one more engine run (and one of engine/int8) under torch's profiler: the share of
its operators' own time in matrix products, in attention and in the rest, and the share of the
batch's KV columns that are padding (its mask after every advance). Padding-free attention could
save at most attention's share times the padding's. It also times the engine's stop-string check
(an episode's `stop`, e.g. the calculator's "</calc>"; run once per row per token) on the run's
replies: microseconds per call, and that as a share of the profiled run's time per generated token
(the profiler slows that run, so the share reads low). --ops is for a CPU: on a GPU an
operator's CPU time is its launch, not its work.

engine/int8 also reports `mismatch_kl`: the k3 KL per token between the int8 sampler's
log-probs and the float32 model's for the same tokens at the same temperature (a whole-sequence
pass), which is the trainer's `mismatch_kl` for a version's own tokens; engine reports the same
for itself (float32 against float32: the batching's float noise alone).

On a GPU every engine row also gives weight_tb_s: the weight bytes a decode step must read times
the steps per second (a floor on the memory traffic: the KV read comes on top), and its share of
the device-to-device copy bandwidth measured in the same process (copy_tb_s, bytes read and
written): how close the decode step is to the memory-bandwidth limit.

Tokens counted = tokens each sequence really generated (up to and including EOS); padding a
static batch computes after a row's EOS is not counted. Also measured: the seconds to load the
model's weights from the /dev/shm weight store (what an UpdateWeights costs before the rebuild).
Timings are wall seconds on this machine, one method after the other in one process: compare
the ratios, not the absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.settings import RolloutSettings  # noqa: E402
from areal_aio.store.safetensors_io import load_weights  # noqa: E402
from areal_aio.store.weights import SHM_BASE, WeightStore  # noqa: E402
from areal_aio.workers.common import configure_torch  # noqa: E402
from areal_aio.workers.models import (  # noqa: E402
    SMOLLM2,
    TINY,
    encode_prompt,
    load_model,
)
from areal_aio.workers.rollout import int8  # noqa: E402
from areal_aio.workers.rollout.engine import Engine, Request, stop_in_tail  # noqa: E402
from areal_aio.workers.trainer.losses import k3_kl  # noqa: E402
from bench.common import command_line, save_figure, write_json  # noqa: E402

QUESTIONS = ["Calculate 3 + 4.", "Calculate 8 - 5.", "Calculate 6 + 9.", "Calculate 7 - 2.",
             "Calculate 5 + 5.", "Calculate 9 - 4.", "Calculate 2 + 8.", "Calculate 4 - 1."]
INSTRUCTION = " Give the final answer inside <answer></answer> tags."
TEMPERATURE = 0.7
"""The rollout default (settings: rollout.temperature)."""
TOP_P = 1.0
WEIGHT_LOADS = 5
"""Weight-load timings taken; the median is reported (the first one pays the page cache)."""


def prompts(tok: Any, sequences: int, group: int) -> list[list[int]]:
    """`sequences` prompts: groups of `group` identical ones, cycling through QUESTIONS."""
    return [encode_prompt(tok, QUESTIONS[(i // group) % len(QUESTIONS)] + INSTRUCTION)
            for i in range(sequences)]


def run_engine(model: Any, tok: Any, ids: list[list[int]], max_new: int, max_batch: int,
               updates: tuple[int, list[Path]] | None = None, load: Any = load_weights,
               reference: Any = None, keep_kv: bool = False,
               watch: Callable[[Engine, list[Any]], None] | None = None,
               static: bool = False, waiting_steps: int = 1) -> dict[str, Any]:
    """All sequences queued at once; with `updates` = (every, paths), weights change mid-run
    (through `load`; `keep_kv`: rollout.kv_on_update = keep). With a `reference` model (no
    updates), also its mismatch_kl. `watch(engine, finished)` sees the engine after each advance."""
    engine = Engine(model, tok, max_batch=max_batch, seed=0, load=load, keep_kv=keep_kv, static=static,
                    waiting_steps=waiting_steps)
    capture = _time_captures(engine) if static else None
    for i, prompt in enumerate(ids):
        engine.add(Request(str(i), prompt, max_new, TEMPERATURE, TOP_P))
    done, steps, loads, rebuilt, load_s, update_s = [], 0, 0, 0, 0.0, 0.0
    chunk = RolloutSettings().chunk_tokens
    t0 = time.perf_counter()
    while engine.busy:
        left = chunk - steps % chunk  # chunks end at multiples of chunk, as in the worker
        if updates:
            left = min(left, updates[0] - steps % updates[0])
        taken, finished = engine.advance(left)
        done.extend(finished)
        steps += taken
        if watch is not None:
            watch(engine, finished)
        if updates and steps % updates[0] == 0 and engine.running:
            t_update = time.perf_counter()
            loaded, finished = engine.update_weights(loads + 1, str(updates[1][loads % 2]))
            update_s += time.perf_counter() - t_update
            done.extend(finished)
            loads, rebuilt, load_s = loads + 1, rebuilt + loaded.rebuilt, load_s + loaded.load_s
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.completion_ids) for c in done)
    out = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "sequences": len(done),
           "decode_steps": steps}
    if capture is not None:
        with_capture = seconds
        seconds -= capture[0][0]
        out.update(seconds=seconds, tok_s=tokens / seconds, capture_s=capture[0][0], graphs=capture[1](),
                   tok_s_with_capture=tokens / with_capture, graph_error=engine.batch.graph_error)
    if model.device.type == "cuda":
        out["weight_tb_s"] = steps * _weight_bytes(model) / seconds / 1e12
    if reference is not None:
        out["mismatch_kl"] = mismatch_kl(reference, done)
    if updates:
        out.update(updates=loads, rebuilt_rows=rebuilt, load_s=load_s, update_s=update_s,
                   interrupted=sum(1 for c in done if c.interrupts))
    return out


def _time_captures(engine: Engine) -> tuple[list[float], Callable[[], int]]:
    """Wrap the engine's graph captures to add up their seconds: ([total], graphs alive now: a
    cache that grew dropped the ones before)."""
    slots, total = engine.batch, [0.0]
    capture = slots._capture

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return capture(*args)
        finally:
            torch.cuda.synchronize()
            total[0] += time.perf_counter() - t0

    slots._capture = timed
    return total, lambda: len(slots.graphs)


def _weight_bytes(model: Any) -> int:
    """Bytes of the weights a forward pass reads (tied embeddings once)."""
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def copy_bandwidth_tb_s(device: str, nbytes: int = 1 << 30) -> float:
    """A device-to-device copy's TB/s, bytes read and written counted (the memory's practical limit)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t0) / 1e12


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::_int_mm", "aten::bmm", "aten::matmul", "aten::linear"}


def engine_ops(model: Any, tok: Any, ids: list[list[int]], max_new: int, max_batch: int) -> dict[str, Any]:
    """One engine run under torch's profiler (module docstring, --ops); the profiler's own cost
    per operator falls on the many small ones, so `other` reads high."""
    holes = columns = 0
    done: list[Any] = []

    def watch(engine: Engine, finished: list[Any]) -> None:
        nonlocal holes, columns
        done.extend(finished)
        if engine.batch.seqs:
            holes += int((~engine.batch.mask).sum())
            columns += engine.batch.mask.numel()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run = run_engine(model, tok, ids, max_new, max_batch, watch=watch)
    s_per_token = run["seconds"] / max(1, run["tokens"])
    own: Counter[str] = Counter()
    for op in prof.key_averages():
        kind = ("attention" if "scaled_dot_product" in op.key or "attention" in op.key
                else "matmul" if op.key in MATMUL_OPS else "other")
        own[kind] += op.self_cpu_time_total
    share = {kind: t / sum(own.values()) for kind, t in own.items()}
    padded = holes / max(columns, 1)
    replies = [c.completion_ids for c in done if c.completion_ids]
    t0 = time.perf_counter()
    for ids in replies:
        stop_in_tail(tok, ids, ("</calc>",))
    stop_s = (time.perf_counter() - t0) / max(1, len(replies))
    return {"op_share": share, "padded_kv_columns": padded,
            "padding_free_bound": padded * share.get("attention", 0.0),
            "stop_check_us": stop_s * 1e6, "stop_check_share": stop_s / s_per_token}


def mismatch_kl(reference: Any, done: list[Any]) -> float:
    """Mean over tokens of k3 KL(sampler || reference) (the trainer's estimator), the
    reference's log-probs at the sampling temperature."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for c in done:
            ids = torch.tensor([c.prompt_ids + c.completion_ids], device=reference.device)
            logits = reference(ids).logits[0, len(c.prompt_ids) - 1:-1].float() / TEMPERATURE
            logp = torch.log_softmax(logits, -1).gather(1, ids[0, len(c.prompt_ids):, None])[:, 0]
            total += float(k3_kl(torch.tensor(c.logprobs, dtype=torch.float64), logp.cpu().double()).sum())
            count += len(c.logprobs)
    return total / max(1, count)


def run_generate(model: Any, tok: Any, ids: list[list[int]], max_new: int, batch: int,
                 static: bool = False) -> dict[str, Any]:
    """model.generate on static, left-padded batches of `batch` sequences, one after the other.

    `static`: transformers' static KV cache, with which generate compiles the decode step
    (torch.compile, CUDA graphs on a GPU): every batch padded to one width, so one graph serves
    them all; the first batch is generated once untimed (the compile, reported as compile_s)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    fixed = max(map(len, ids)) if static else None
    extra: dict[str, Any] = {"cache_implementation": "static"} if static else {}
    if static and model.device.type == "cpu":  # generate compiles on accelerators only unless told
        from transformers.generation.configuration_utils import CompileConfig

        extra["compile_config"] = CompileConfig(mode="default")
        extra["compile_config"]._compile_all_devices = True

    def generate(rows: list[list[int]]) -> list[list[int]]:
        width = fixed or max(map(len, rows))
        device = model.device
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, do_sample=True,
                                 temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                                 max_new_tokens=max_new, **extra)[:, width:]
        return out.tolist()

    compile_s = None
    if static:
        t0 = time.perf_counter()
        generate(ids[:batch])
        compile_s = time.perf_counter() - t0
    tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(ids), batch):
        for row in generate(ids[start:start + batch]):
            tokens += row.index(eos) + 1 if eos in row else len(row)
    seconds = time.perf_counter() - t0
    out = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "sequences": len(ids)}
    return out if compile_s is None else {**out, "compile_s": compile_s}


def run_hf_cb(model: Any, tok: Any, ids: list[list[int]], max_new: int, max_batch: int) -> dict[str, Any]:
    """transformers' continuous batching (paged cache), asked for logprobs as we need them."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
                              max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    wanted = dict(return_logprobs=True, max_requests_per_batch=max_batch, page_size=64,
                  num_blocks=4 * max_batch, max_batch_tokens=16 * max_batch)
    # the config's fields move between transformers releases: pass the ones this one has
    known = inspect.signature(ContinuousBatchingConfig).parameters
    cb = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in known})
    t0 = time.perf_counter()
    out = model.generate_batch(ids, generation_config=config, continuous_batching_config=cb,
                               warmup=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "sequences": len(out)}


def perturbed_weights(model: Any, store: WeightStore) -> list[Path]:
    """Two published versions to alternate between: the model's own and a perturbed copy."""
    paths = [store.publish(model, 1)]
    with torch.no_grad():
        saved = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.mul_(1.001)
        paths.append(store.publish(model, 2))
        for p, s in zip(model.parameters(), saved, strict=True):
            p.copy_(s)
    return paths


def time_weight_load(model: Any, path: Path) -> list[float]:
    return [load_weights(model, path) for _ in range(WEIGHT_LOADS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random, few prompts (CI smoke run)")
    parser.add_argument("--model", default=None, help=f"model spec (default {SMOLLM2}; --quick: {TINY})")
    parser.add_argument("--threads", default=None, help="comma-separated torch thread counts (default 1,2)")
    parser.add_argument("--sequences", type=int, default=None, help="sequences per method (default 64)")
    parser.add_argument("--group", type=int, default=8, help="identical prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=32, help="engine slots (rollout.max_batch)")
    parser.add_argument("--update-every", type=int, default=None,
                        help="engine+updates: decode steps between weight loads (default 16; --quick: 4)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda (every method runs there)")
    parser.add_argument("--dtype", default="float32", help="model dtype (rollout.dtype): float32 | bfloat16")
    parser.add_argument("--no-hf-cb", action="store_true", help="skip transformers' continuous batching")
    parser.add_argument("--random-weights", action="store_true",
                        help="build the model from --model's config with random weights (its shape and "
                             "tokenizer, none of its weights: replies run to --max-new-tokens)")
    parser.add_argument("--compiled", action="store_true",
                        help="on a CPU too: generate/b<max_batch>/static, transformers' compiled decode step "
                             "(torch.compile with inductor: a C++ compiler, minutes of compiling)")
    parser.add_argument("--only", default=None, help="comma-separated methods to run (default all)")
    parser.add_argument("--ops", action="store_true",
                        help="profile one more engine run (and engine/int8): op shares, padded KV columns")
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "rollout_throughput"))
    args = parser.parse_args(argv)
    if args.ops and args.device != "cpu":
        parser.error("--ops profiles the CPU's operators: it runs with --device cpu only")
    # this script owns its process: a SIGTERM (timeout, Ctrl-C from a runner) unwinds through
    # `finally` so the weight store folder in /dev/shm is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = args.model or (TINY if args.quick else SMOLLM2)
    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    sequences = args.sequences or (16 if args.quick else 64)
    max_new = 16 if args.quick and args.max_new_tokens == 64 else args.max_new_tokens
    update_every = args.update_every or (4 if args.quick else 16)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    model, tok = load_model(spec, seed=0, dtype=args.dtype, device=args.device, random_weights=args.random_weights)
    ids = prompts(tok, sequences, args.group)
    base = SHM_BASE if SHM_BASE.parent.is_dir() else Path(tempfile.gettempdir()) / "areal_aio_shm"
    store = WeightStore.create("bench-rollout", base=base)
    rows: list[dict[str, Any]] = []
    try:
        paths = perturbed_weights(model, store)
        load_times = time_weight_load(model, paths[0])
        methods = [
            ("engine", lambda: run_engine(model, tok, ids, max_new, args.max_batch, reference=model)),
            ("engine+updates", lambda: run_engine(model, tok, ids, max_new, args.max_batch,
                                                  (update_every, paths))),
            ("engine+updates/keep", lambda: run_engine(model, tok, ids, max_new, args.max_batch,
                                                       (update_every, paths), keep_kv=True)),
            ("engine/static", lambda: run_engine(model, tok, ids, max_new, args.max_batch, static=True,
                                                 reference=model)),
            ("engine/static+updates", lambda: run_engine(model, tok, ids, max_new, args.max_batch,
                                                         (update_every, paths), static=True)),
            ("engine/static/wait4", lambda: run_engine(model, tok, ids, max_new, args.max_batch, static=True,
                                                       waiting_steps=4)),
            (f"generate/b{args.group}", lambda: run_generate(model, tok, ids, max_new, args.group)),
            (f"generate/b{args.max_batch}",
             lambda: run_generate(model, tok, ids, max_new, args.max_batch)),
        ]
        quantized = None
        if args.device == "cpu" and args.dtype == "float32":
            quantized = copy.deepcopy(model)
            refresh = int8.refreshing(load_weights, int8.quantize(quantized))
            methods[1:1] = [
                ("engine/int8", lambda: run_engine(quantized, tok, ids, max_new, args.max_batch,
                                                   reference=model)),
                ("engine/int8+updates", lambda: run_engine(quantized, tok, ids, max_new, args.max_batch,
                                                           (update_every, paths), load=refresh)),
                ("engine/int8+updates/keep", lambda: run_engine(quantized, tok, ids, max_new, args.max_batch,
                                                                (update_every, paths), load=refresh,
                                                                keep_kv=True)),
            ]
        if args.device.startswith("cuda") or args.compiled:  # transformers' compiled decode
            methods.append((f"generate/b{args.max_batch}/static",
                            lambda: run_generate(model, tok, ids, max_new, args.max_batch, static=True)))
        if not args.no_hf_cb:
            methods.append(("hf-cb", lambda: run_hf_cb(model, tok, ids, max_new, args.max_batch)))
        if args.only:
            wanted = args.only.split(",")
            unknown = set(wanted) - {name for name, _ in methods}
            if unknown:
                parser.error(f"--only: no method {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(name for name, _ in methods)}")
            methods = [(name, fn) for name, fn in methods if name in wanted]
        for n in threads:
            configure_torch(args.device, n)
            # warm-up: one short pass of each kind (allocator, kernels, lazy imports); on a GPU
            # the engine's whole run, since each new shape pays once (kernel choice, allocator):
            # else the method timed first pays it alone
            if args.device.startswith("cuda"):
                run_engine(model, tok, ids, max_new, args.max_batch)
                run_engine(model, tok, ids, max_new, args.max_batch, (update_every, paths))  # rebuild shapes
                run_engine(model, tok, ids, max_new, args.max_batch, static=True)
                run_generate(model, tok, ids[:args.max_batch], max_new, args.max_batch)
            else:
                run_engine(model, tok, ids[:args.group], 4, args.max_batch)
            if quantized is not None:
                run_engine(quantized, tok, ids[:args.group], 4, args.max_batch)
            run_generate(model, tok, ids[:args.group], 4, args.group)
            for name, fn in methods:
                torch.manual_seed(0)
                try:
                    result = fn()
                except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, not fatal
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                rows.append({"method": name, "threads": n, **result})
                print(f"  {name:16s} threads={n}  " + (f"{result['tok_s']:7.1f} tok/s" if "tok_s" in result
                      else result["error"]), file=sys.stderr, flush=True)
        if args.ops:  # at the last thread count
            ops = {"engine": engine_ops(model, tok, ids, max_new, args.max_batch)}
            if quantized is not None:
                ops["engine/int8"] = engine_ops(quantized, tok, ids, max_new, args.max_batch)
    finally:
        store.close()

    summary = _summarize(rows, threads, args.group, load_times)
    if args.device.startswith("cuda"):
        summary["copy_tb_s"] = copy_bandwidth_tb_s(args.device)
        for row in rows:
            if "weight_tb_s" in row:
                row["bandwidth_share"] = row["weight_tb_s"] / summary["copy_tb_s"]
    if args.ops:
        summary["ops"] = ops
    results = {"model": spec, "random_weights": args.random_weights, "device": args.device, "dtype": args.dtype, "sequences": sequences, "group": args.group, "max_new_tokens": max_new,
               "max_batch": args.max_batch, "temperature": TEMPERATURE, "top_p": TOP_P,
               "update_every": update_every, "rows": rows, "weight_load_s": load_times,
               "weight_load_median_s": statistics.median(load_times), **summary}
    write_json(out_dir / "results.json", results, command=command_line(__file__, argv))
    _print_table(results)
    _plot(results, out_dir / "rollout_throughput.png")
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'rollout_throughput.png'}")
    return 0


def _summarize(rows: list[dict], threads: list[int], group: int, load_times: list[float]) -> dict:
    """Speed-ups of the engine over generate on one group per batch, per thread count."""
    ratios = {}
    for n in threads:
        by = {r["method"]: r for r in rows if r["threads"] == n and "tok_s" in r}
        base = by.get(f"generate/b{group}")
        if base and "engine" in by:
            ratios[str(n)] = {m: r["tok_s"] / base["tok_s"] for m, r in by.items()}
    return {"speedup_vs_generate_group": ratios}


def _print_table(results: dict) -> None:
    print(f"\nrollout throughput: {results['model']} on {results['device']} ({results['dtype']}), "
          f"{results['sequences']} sequences "
          f"(groups of {results['group']}), max_new_tokens={results['max_new_tokens']}, "
          f"temperature={results['temperature']}, top_p={results['top_p']}")
    print(f"{'method':18s} {'threads':>7s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s} {'x gen/b' + str(results['group']):>10s}")
    for r in results["rows"]:
        if "tok_s" not in r:
            print(f"{r['method']:18s} {r['threads']:7d}  failed: {r['error']}")
            continue
        ratio = results["speedup_vs_generate_group"].get(str(r["threads"]), {}).get(r["method"], float("nan"))
        extra = (f"  ({r['updates']} updates, {r['rebuilt_rows']} rows rebuilt, "
                 f"{r['update_s'] / max(1, r['updates']):.2f}s per load + rebuild)"
                 if "updates" in r else "")
        if "mismatch_kl" in r:
            extra += f"  (mismatch_kl {r['mismatch_kl']:.2e} to float32)"
        if "capture_s" in r:
            extra += f"  ({r['graphs']} graphs at the end, captures took {r['capture_s']:.2f}s"
            extra += f"; capture failed: {r['graph_error']})" if r["graph_error"] else ")"
        if "bandwidth_share" in r:
            extra += f"  (weights read at {r['weight_tb_s']:.2f} TB/s: {r['bandwidth_share']:.0%} of a copy's)"
        print(f"{r['method']:18s} {r['threads']:7d} {r['tokens']:7d} {r['seconds']:8.2f} "
              f"{r['tok_s']:8.1f} {ratio:10.2f}{extra}")
    if "copy_tb_s" in results:
        print(f"device-to-device copy: {results['copy_tb_s']:.2f} TB/s (bytes read and written)")
    print(f"weight load from the store: median {results['weight_load_median_s']:.3f}s "
          f"over {len(results['weight_load_s'])} loads")
    for method, o in results.get("ops", {}).items():
        print(f"{method}: own time " + ", ".join(f"{k} {v:.1%}" for k, v in sorted(o["op_share"].items()))
              + f"; padded KV columns {o['padded_kv_columns']:.1%}; padding-free attention saves at most "
              f"{o['padding_free_bound']:.1%}; a stop-string check {o['stop_check_us']:.1f} us "
              f"({o['stop_check_share']:.2%} of a token's time)")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if "tok_s" in r]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    width = 0.8 / max(1, len(threads))
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, n in enumerate(threads):
        values = [next((r["tok_s"] for r in rows if r["method"] == m and r["threads"] == n), 0.0)
                  for m in methods]
        ax.bar([i + k * width for i in range(len(methods))], values, width, label=f"{n} thread(s)")
    ax.set_xticks([i + width * (len(threads) - 1) / 2 for i in range(len(methods))], methods,
                  rotation=15)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"rollout throughput, {results['model']}, {results['sequences']} seqs, "
                 f"max_new_tokens={results['max_new_tokens']}")
    ax.legend()
    save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
