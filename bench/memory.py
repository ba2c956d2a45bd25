"""Peak memory of one trainer step and of the rollout worker at real models' shapes, with the
chunked LM head (the trainer's) and without it; and a real run's workers (`e2e`).

    shapes    smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b (bench/shapes.py: the published configs,
              random weights, full vocabulary: 49,152 and 151,936)
    variants  full       every weight trained: fp32 weights, gradients and AdamW's two moments
              lora       rank 16, all-linear, alpha 32, over the fp32 base
              lora-bf16  the same over a bf16 base (lora.base_dtype = bfloat16)
              lora-int8  the same over an int8 base (lora.base_dtype = int8)
    tokens    one micro-batch (trainer.micro_tokens = tokens) of ROWS rows: a PROMPT_TOKENS-token
              prompt and tokens / ROWS - PROMPT_TOKENS completion tokens each (512: 4 x 128,
              2048: 4 x 512), one row per sample (trainer.share_prompts = off)
    head      chunked    the trainer's: logits of a few tokens at a time (losses.token_logprobs)
              full       bench only: the model's own logits [rows x L, V], then log-softmax over
                         them, as a trainer without chunking computes them (full and lora only)
    step      Trainer.train of one batch: decoupled PPO, one mini-batch: forward, backward,
              AdamW step (its moments allocated here), no publish
    rollout   the rollout worker's model (float32 on a CPU, bfloat16 on a GPU) and the Engine's
              KV cache: --gen-rows rows decoding --gen-new tokens after prompts of --gen-prompt tokens,
              decoded as the worker's default does (rollout.static_decode = auto: on a GPU the
              static slots, whose cache is preallocated; the dynamic batch on a CPU)
    vocab     the head's share: qwen2.5-0.5b's shape with SmolLM2's vocabulary (49,152) beside
              its own (151,936), lora at the largest --tokens, both heads

Each configuration runs in a fresh process of its own, one after another, so peaks never mix.
CPU: VmHWM (the kernel's high-water mark of resident memory, MALLOC_ENV set); the mark is reset (5 into
/proc/self/clear_refs) once the model is loaded, so `load_peak` is the load's (a bf16 file read
into fp32 maps the file too) and `peak` the step's or the generation's. CUDA (--device cuda):
torch.cuda.max_memory_allocated, reset after the load; bf16 autocast (trainer.bf16 = on).
A configuration whose estimate (`estimate_gib`) is more than the memory available when it is
due is not started: recorded as skipped, with the estimate.

    python bench/memory.py                               # the whole table on this CPU
    python bench/memory.py --shapes smollm2-135m --tokens 512 --variants full,lora
    python bench/memory.py --quick                       # embedded:tiny-random, seconds (tests)
    python bench/memory.py --keep --shapes qwen2.5-1.5b --tokens 512   # add rows to the same file
    python bench/memory.py --device cuda --out DIR       # the same on a GPU
    python bench/memory.py e2e --shape qwen2.5-0.5b      # a real run: both workers' peaks, steps
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.common import command_line, print_table, write_json  # noqa: E402
from bench.shapes import SHAPES, model_folder, parameters  # noqa: E402

GIB = 2**30
ROWS = 4
PROMPT_TOKENS = 32
TOKENS = (512, 2048)
VARIANTS = {"full": (0, "float32"), "lora": (16, "float32"), "lora-bf16": (16, "bfloat16"),
            "lora-int8": (16, "int8")}
"""name -> (lora.rank, lora.base_dtype)"""
UNCHUNKED = ("full", "lora")
"""The variants also measured with the full-logits head."""
VOCAB_SHAPE, VOCAB_SMALL = "qwen2.5-0.5b", 49_152
GEN_ROWS, GEN_PROMPT, GEN_NEW = 8, 32, 16
STATE_BYTES = {"full": 16.0, "lora": 4.0, "lora-bf16": 2.0, "lora-int8": 1.5}
"""Bytes per parameter the step holds besides activations: full = fp32 weights, gradients and
AdamW's two moments; lora = the frozen base (int8: blocks at 1, embeddings at 2)."""
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Every allocation past 64 KiB its own mapping, returned to the kernel when freed: VmHWM then
counts the tensors alive at the peak. glibc's default threshold adapts upwards as big blocks are
freed and keeps later ones on its heap: measured on smollm2-135m lora at 2048 tokens, 5.33 GiB
peak by default against 3.29 with this (the step 25% slower)."""
HEADROOM = 1.1
"""A configuration starts only where estimate x this is available."""
QUICK = "quick"
"""--quick's one shape: embedded:tiny-random (vocab 49,152)."""


# ---- one configuration, in its own process ------------------------------------------------------


def status_kib(key: str) -> int:
    """A /proc/self/status field in KiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Peak:
    """The high-water mark of this process's memory on `device`: VmHWM, or CUDA's allocator."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def reset(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def now(self) -> int:
        """Bytes in use now (resident; CUDA: allocated)."""
        if self.cuda:
            import torch

            return torch.cuda.memory_allocated()
        return status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return status_kib("VmHWM") * 1024

    def held(self) -> dict[str, int]:
        """CUDA: the most the allocator held from the device (reserved: what another process on
        the same GPU cannot have). CPU: the resident pages of mapped files now (RssFile), the
        model's safetensors file among them: transformers keeps it mapped after the load, and a
        narrowed base (lora.base_dtype) has read all of it; VmHWM counts these clean pages, which
        the kernel may drop, with the process's own."""
        if not self.cuda:
            return {"file_now": status_kib("RssFile") * 1024}
        import torch

        return {"peak_reserved": torch.cuda.max_memory_reserved()}


def samples(tokens: int, vocab: int, seed: int = 0) -> list[Any]:
    """ROWS samples of one group, each PROMPT_TOKENS + (tokens / ROWS - PROMPT_TOKENS) tokens."""
    from areal_aio import wire

    rng = random.Random(seed)
    n = tokens // ROWS - PROMPT_TOKENS
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
    return [wire.TrainSample(prompt_ids=prompt, completion_ids=[rng.randrange(vocab) for _ in range(n)],
                             logprobs=[-10.0] * n, versions=[0] * n, reward=float(i % 2), group=0)
            for i in range(ROWS)]


def trainer_step(cfg: dict[str, Any]) -> dict[str, Any]:
    """Load a Trainer for `cfg`, then one step: its memory and time."""
    import torch

    from areal_aio import wire
    from areal_aio.settings import build_settings
    from areal_aio.store.weights import SHM_BASE, WeightStore
    from areal_aio.workers import frozen_base
    from areal_aio.workers.trainer.worker import Trainer

    rank, base = VARIANTS[cfg["variant"]]
    cuda = cfg["device"].startswith("cuda")
    settings = build_settings({}, [
        f"model.path={cfg['model']}", f"trainer.device={cfg['device']}", f"rollout.group_size={ROWS}",
        f"trainer.batch_size={ROWS}", f"trainer.micro_tokens={cfg['tokens']}", "trainer.share_prompts=off",
        f"trainer.bf16={'on' if cuda else 'off'}", f"lora.rank={rank}", "lora.alpha=32.0",
        f"lora.base_dtype={base}", f"trainer.activation_checkpointing={str(cfg['checkpointing']).lower()}"])
    peak = Peak(cfg["device"])
    store = WeightStore.create(f"bench-memory-{os.getpid()}", base=SHM_BASE)
    try:
        t0 = time.perf_counter()
        trainer = Trainer(settings.to_dict(), store.root)
        load_s = time.perf_counter() - t0
        load_peak, loaded, loaded_file = peak.peak(), peak.now(), peak.held().get("file_now")
        trainer._fast_head = cfg["head"] == "chunked"  # full: the model's own [n x L, V] logits
        batch = samples(cfg["tokens"], len(trainer.tokenizer))
        peak.reset()
        t0 = time.perf_counter()
        stats = trainer.train(wire.Train(step=0, version=0, samples=batch, publish=False)).stats
        if cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        return {"load_peak": load_peak, "loaded": loaded, "loaded_file": loaded_file, "peak": peak.peak(),
                **peak.held(), "step_s": step_s,
                "load_s": load_s, "stored_bytes": frozen_base.stored_bytes(trainer.model),
                "trainable": sum(p.numel() for p in trainer.params), "trained_tokens": stats["tokens"],
                "loss_finite": stats["loss"] == stats["loss"]}
    finally:
        store.close()


def rollout_generation(cfg: dict[str, Any]) -> dict[str, Any]:
    """Load the rollout worker's model, then GEN_ROWS rows of generation on the Engine."""
    import torch

    from areal_aio.workers.models import load_model
    from areal_aio.workers.rollout.engine import Engine, Request
    from areal_aio.workers.rollout.worker import static_decode

    cuda = cfg["device"].startswith("cuda")
    peak = Peak(cfg["device"])
    t0 = time.perf_counter()
    model, tok = load_model(cfg["model"], dtype="bfloat16" if cuda else "float32", device=cfg["device"])
    load_s = time.perf_counter() - t0
    load_peak, loaded = peak.peak(), peak.now()
    rows, prompt, new = cfg.get("gen") or (GEN_ROWS, GEN_PROMPT, GEN_NEW)
    static = static_decode("auto", cfg["device"], model)  # as the worker decodes by default
    engine = Engine(model, tok, max_batch=rows, static=static)
    rng = random.Random(0)
    for i in range(rows):
        engine.add(Request(f"r{i}", [rng.randrange(len(tok)) for _ in range(prompt)], new,
                           temperature=1.0, seed=i))
    peak.reset()
    t0 = time.perf_counter()
    done = []
    while engine.busy:
        done += engine.advance(new)[1]
    if cuda:
        torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    new = sum(len(c.completion_ids) for c in done)
    return {"load_peak": load_peak, "loaded": loaded, "peak": peak.peak(), **peak.held(), "load_s": load_s,
            "gen_s": gen_s, "tokens_per_s": new / gen_s, "generated": new, "static_decode": static}


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from areal_aio.workers.common import configure_torch

    configure_torch(cfg["device"], cfg["threads"])
    torch.manual_seed(0)
    return rollout_generation(cfg) if cfg["variant"] == "rollout" else trainer_step(cfg)


# ---- the table ----------------------------------------------------------------------------------


def estimate_gib(shape: str, variant: str, tokens: int, head: str, device: str) -> float:
    """What a configuration needs at most, roughly: its weights (and the fp32 copy a load makes
    of a bf16 file, mapped), the state STATE_BYTES counts, and the logits of a full head."""
    n = parameters(shape) if shape != QUICK else 3_300_000
    vocab = SHAPES[shape]["vocab_size"] if shape in SHAPES else 49_152
    per = 4.0 if variant == "rollout" else STATE_BYTES[variant]
    load = n * 6 if not device.startswith("cuda") else 0  # fp32 model + the bf16 file mapped
    logits = 3 * 4 * tokens * vocab if head == "full" else 0  # logits, log-softmax, its gradient
    return (max(n * per, load) + logits) / GIB + 1.0


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The table's cells, in order; each a child process's config."""
    shapes = [QUICK] if args.quick else args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = [v for v in args.variants.split(",") if v]  # "": the rollout rows alone
    common = {"device": args.device, "threads": args.threads, "checkpointing": args.checkpointing,
              "gen": [args.gen_rows, args.gen_prompt, args.gen_new]}
    out = []
    for shape in shapes:
        for n in tokens:
            for variant in variants:
                for head in ("chunked", "full") if variant in UNCHUNKED else ("chunked",):
                    out.append({**common, "shape": shape, "vocab": None, "variant": variant,
                                "tokens": n, "head": head})
        if not args.no_rollout:
            out.append({**common, "shape": shape, "vocab": None, "variant": "rollout", "tokens": 0,
                        "head": "-"})
    if args.vocab_sweep and not args.quick and "lora" in variants:
        for head in ("chunked", "full"):
            out.append({**common, "shape": VOCAB_SHAPE, "vocab": VOCAB_SMALL, "variant": "lora",
                        "tokens": max(tokens), "head": head})
    return out


def folder_of(shape: str, vocab: int | None, root: Path) -> str:
    from areal_aio.workers.models import TINY

    if shape == QUICK:
        return TINY
    return str(model_folder(shape, root, vocab=vocab))


def run_one(cfg: dict[str, Any], root: Path) -> dict[str, Any]:
    """One configuration in a fresh process: its row (skipped where it would not fit)."""
    est = estimate_gib(cfg["shape"], cfg["variant"], cfg["tokens"], cfg["head"], cfg["device"])
    row = {**cfg, "estimate_gib": round(est, 2)}
    free = mem_available_gib()
    if not cfg["device"].startswith("cuda") and est * HEADROOM > free:
        return {**row, "skipped": f"needs ~{est:.1f} GiB, {free:.1f} GiB available"}
    cfg = {**cfg, "model": folder_of(cfg["shape"], cfg["vocab"], root)}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **MALLOC_ENV})
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return {**row, "skipped": f"failed: {tail[0]}"}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1]), "load_avg_1m": os.getloadavg()[0]}


def gib(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x / GIB:.2f}"


def print_rows(rows: list[dict[str, Any]], device: str) -> None:
    table = []
    for r in rows:
        name = r["shape"] + (f" (vocab {r['vocab']:,})" if r.get("vocab") else "")
        what = "rollout" if r["variant"] == "rollout" else f"{r['variant']} {r['tokens']}"
        if "skipped" in r:
            table.append([name, what, r["head"], "-", "-", "-", "-", r["skipped"]])
            continue
        secs = r.get("step_s", r.get("gen_s"))
        table.append([name, what, r["head"], gib(r["load_peak"]), gib(r["loaded"]), gib(r["peak"]),
                      f"{secs:.1f}", ""])
    print_table(["shape", "what", "head", "load peak GiB", "loaded GiB", "peak GiB", "s", "note"], table,
                title=f"peak memory, {device} ({'CUDA max allocated' if device.startswith('cuda') else 'VmHWM'})")


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, read off the rows: the 1.5B-shape LoRA step within 16 GiB on a CPU;
    the chunked step's peak above its loaded memory flat in the vocabulary."""
    out: dict[str, Any] = {}
    big = [r for r in rows if r["shape"] == "qwen2.5-1.5b" and r["variant"].startswith("lora")
           and r["head"] == "chunked" and "peak" in r]
    if big:
        worst = max(big, key=lambda r: r["peak"])
        out["lora_1.5b_peak_gib"] = round(worst["peak"] / GIB, 2)
        out["lora_1.5b_within_16_gib"] = worst["peak"] <= 16 * GIB
    small = [r["tokens"] for r in rows if r.get("vocab")]
    sweep = {(r["vocab"] or SHAPES[r["shape"]]["vocab_size"], r["head"]): (r["peak"] - r["loaded"]) / GIB
             for r in rows if r["shape"] == VOCAB_SHAPE and r["variant"] == "lora" and "peak" in r
             and small and r["tokens"] == max(small)}
    if len(sweep) == 4:
        out["vocab_sweep_step_gib"] = {f"{head} head, vocab {v}": round(g, 3) for (v, head), g in sorted(sweep.items())}
    return out


# ---- a real run ---------------------------------------------------------------------------------


def worker_peaks(root_pid: int) -> dict[str, int]:
    """VmHWM (bytes) of each worker process under `root_pid`, by role (trainer / rollout)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            hwm = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            continue
        for role in ("trainer", "rollout"):
            if f"areal_aio.workers.{role}" in cmd:
                out[role] = max(out.get(role, 0), hwm)
    return out


E2E_SETTINGS = ["run.max_steps=3", "run.checkpoint_every=0", "run.progress=false", "task.eval_size=2",
                "task.eval_every=100", "rollout.group_size=2", "trainer.batch_size=4", "rollout.max_new_tokens=8",
                "rollout.max_batch=4", "controller.reward_procs=0"]
"""The end-to-end run: 3 steps of 2 groups of 2 replies of at most 8 tokens (random weights:
the plumbing, memory and step time, not learning); --set adds to these."""


def e2e(args: argparse.Namespace) -> dict[str, Any]:
    """`python -m areal_aio run` on a shape's folder: its steps and each worker's peak memory."""
    folder = model_folder(args.shape, args.root)
    out = args.out / "e2e" / args.shape
    sets = [f"model.path={folder}", f"run.out_dir={out.parent}", f"run.name={out.name}-{int(time.time())}",
            *E2E_SETTINGS, *args.set]
    cmd = [sys.executable, "-m", "areal_aio", "run", str(REPO / "settings.toml")]
    for item in sets:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    peaks: dict[str, int] = {}
    while proc.poll() is None:
        for role, hwm in worker_peaks(proc.pid).items():
            peaks[role] = max(peaks.get(role, 0), hwm)
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"e2e: the run exited {proc.returncode}")
    run = max(out.parent.glob(f"{out.name}-*"), key=lambda p: p.stat().st_mtime)
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    return {"shape": args.shape, "settings": sets[2:], "wall_s": wall, "steps": len(steps),
            "step_seconds": [s.get("seconds") for s in steps],
            "cold_start_s": summary.get("cold_start_s"), "peak_rss": peaks,
            "peak_rss_gib": {role: round(b / GIB, 2) for role, b in peaks.items()}}


# ---- main ---------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=("table", "e2e"), default="table")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="embedded:tiny-random, 512 tokens, full and lora")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)} (default all; "
                    "--quick: full,lora)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each configuration's process")
    ap.add_argument("--checkpointing", action="store_true", help="trainer.activation_checkpointing on")
    ap.add_argument("--no-rollout", action="store_true", help="leave the rollout rows out")
    ap.add_argument("--gen-rows", type=int, default=GEN_ROWS, help="rollout: rows decoding together")
    ap.add_argument("--gen-prompt", type=int, default=GEN_PROMPT, help="rollout: prompt tokens of each row")
    ap.add_argument("--gen-new", type=int, default=GEN_NEW, help="rollout: tokens each row generates")
    ap.add_argument("--no-vocab-sweep", dest="vocab_sweep", action="store_false")
    ap.add_argument("--keep", action="store_true", help="keep the rows of --out's results.json this run does not measure")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES), help="e2e: the model's shape")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="e2e: more settings")
    ap.add_argument("--root", type=Path, default=REPO / "bench" / "out" / "shapes", help="the shapes' folders")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "memory")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens = "512"
    args.variants = args.variants or ("full,lora" if args.quick else ",".join(VARIANTS))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    path = args.out / "results.json"
    if args.mode == "e2e":
        res = {**e2e(args), "command": command_line(__file__, argv)}
        print(json.dumps(res, indent=2))
        old = json.loads(path.read_text()) if path.exists() else {}
        old.pop("provenance", None)
        write_json(path, {**old, "e2e": [*(old.get("e2e") or []), res]}, command=command_line(__file__, argv))
        return 0
    rows = []
    for cfg in configurations(args):
        row = run_one(cfg, args.root)
        rows.append(row)
        note = row.get("skipped") or f"peak {gib(row['peak'])} GiB"
        print(f"  {row['shape']} {row['variant']} {row['tokens']} {row['head']}: {note}", file=sys.stderr, flush=True)
    print_rows(rows, args.device)
    met = targets(rows)
    print(json.dumps(met, indent=2))
    old = json.loads(path.read_text()) if path.exists() else {}
    kept = old.get("e2e")  # `e2e` runs, kept
    commands = [*(old.get("commands") or [] if args.keep else []), command_line(__file__, argv)]
    if args.keep:  # the rows of earlier invocations that this one did not measure again
        key = ("shape", "vocab", "variant", "tokens", "head")
        mine = {tuple(r[k] for k in key) for r in rows}
        rows = [r for r in old.get("rows", []) if tuple(r[k] for k in key) not in mine] + rows
        met = targets(rows)
    write_json(path, {"device": args.device, "rows_per_step": ROWS, "prompt_tokens": PROMPT_TOKENS,
                      "lora": {"rank": 16, "alpha": 32.0, "targets": "all-linear"},
                      "generation": {"rows": args.gen_rows, "prompt_tokens": args.gen_prompt,
                                     "new_tokens": args.gen_new},
                      "checkpointing": args.checkpointing, "commands": commands, "rows": rows, "targets": met,
                      **({"e2e": kept} if kept else {})},
               command=command_line(__file__, argv))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
