"""Cold-start fine-tuning: `python -m areal_aio sft settings.toml` teaches a model a reply format before RL.

    pairs (sft.data)          generated: the task's reference replies (chain: worked, step-tagged
      |                       solutions; arithmetic: the sum, then the tagged answer; calculator: the
      |                       call, then the tagged value after the tool turn) | sampled: the model's
      |                       own passing replies, the tagged answer added where they left it out (a
      |                       rollout worker samples them first: sampled_pairs) | a JSONL file of
      |                       pairs; pairs whose prompt is held out are left out
      |  tokenize: prompt ids through the chat template exactly as the rollout worker builds
      |  them (after an episode's earlier turns: as the episode's context holds them), completion
      |  ids = the assistant's reply up to the token that ends its turn
      v
    trainer worker  <- sft.steps x Train(objective="sft", publish=False), sft.batch_size pairs each
      |               (token-mean NLL of the completion tokens; workers/trainer/worker.py)
      +-> Save(kind="model") -> <folder>/model/      an HF folder for model.path of an RL run
    rollout worker  greedy replies to the first sft.eval_size held-out prompts (greedy episodes in
                    an episode run: task.name = calculator): the base model beside the training,
                    the tuned one after it (areal_aio/control/evaluation.py)

Each eval reports the share of valid step-tagged replies (areal_aio.tasks.steps.parse), the pass
and strict rates, and why the invalid ones are invalid. When the held-out prompts ask for
steps (they end in STEP_INSTRUCTION), the base model also answers them with the plain answer
instruction instead: the pass rate to match without the step format.

The pairs are tokenized in this process (transformers' tokenizer; no model, no device); the
model lives in the workers only.

The folder (--out, else run.out_dir/<run.name or sft-<time>-<pid>>) gets settings.toml, sft.json
(rates before and after, data, timings), steps.jsonl (one row per step), samples.jsonl (every
eval reply with its score), the workers' logs and model/.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from areal_aio import wire
from areal_aio.agents.calculator import reference_turns
from areal_aio.agents.episodes import episode_spec, load_episode
from areal_aio.app.preflight import PreflightError, preflight, read_checked
from areal_aio.control.evaluation import (
    answers,
    greedy_completions,
    greedy_episodes,
    rates,
    rollout_session,
    sample_rows,
    score,
)
from areal_aio.control.keeping import STOP_SAVE_TIMEOUT_S
from areal_aio.control.progress import say
from areal_aio.control.sources import eval_tasks, training_tasks
from areal_aio.rewards.scoring import Score, Scorer, load_rewards, only_answer_check
from areal_aio.seeds import derive
from areal_aio.settings import (
    CODE_TASKS,
    SFT,
    SFT_GENERATED,
    Settings,
    SettingsError,
    load_settings,
    whole_machine_threads,
)
from areal_aio.store.checkpoint import replace_folder
from areal_aio.tasks.arithmetic import ANSWER_INSTRUCTION, worked_reply
from areal_aio.tasks.files import jsonl_rows
from areal_aio.tasks.steps import STEP_INSTRUCTION, parse
from areal_aio.tasks.task import Task

FOLDER_FILES = ("settings.toml", "sft.json", "steps.jsonl", "samples.jsonl", "model")
"""A folder holding any of these holds a run or a tuning: never written over."""
EPISODE_ROLES = ("assistant", "tool", "user")
"""The roles of a chat row's turns after its user prompt: replies, and the turns an episode
adds between them (Model.add_turn)."""
SAMPLED = "sampled"
"""sft.data: the model's own passing replies (sampled_pairs)."""
SAMPLE_SALT = 0x5F7
"""Keeps the seeds of sampled cold-start replies apart from a run's rollout seeds (seeds.derive)."""
MOST_PROMPTS_PER_PAIR = 20
"""sft.data = sampled gives up (a ValueError) once it has sampled this many prompts per pair it
needs without finding them: a model that passes under 5% of its prompts has little to keep."""
MISMATCHES_IN_A_ROW = 1000
"""Calculator tasks in a row without reference turns (their calculated value is not their
answer) before the generated pairs stop with an error instead of searching on forever."""


@dataclass(frozen=True, slots=True)
class Pair:
    """One supervised example: `completion` is the assistant's reply to the user's `prompt`, or
    to an episode's earlier `turns` after it, (role, text) each: a reply ("assistant"), then
    the tool or user turns the episode added after it, and so on. Only `completion` is trained.
    `system` None = model.system_prompt (as the rollout worker uses)."""

    prompt: str
    completion: str
    system: str | None = None
    turns: tuple[tuple[str, str], ...] = ()


# ---------------------------------------------------------------- data


def read_pairs(path: str | Path) -> list[Pair]:
    """Pairs from a JSONL file of {"prompt", "completion"} or {"messages": [...]} rows; a bad
    row is a ValueError naming its line."""
    pairs = []
    for number, row in jsonl_rows(path):
        pair = _row_pair(row)
        if isinstance(pair, str):
            raise ValueError(f"{path}:{number}: {pair}; expected {{\"prompt\": ..., \"completion\": ...}} or "
                             f"{{\"messages\": [system (optional), user, assistant, tool, ..., assistant]}} "
                             f"with non-empty strings")
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path}: no pairs (the file is empty)")
    return pairs


def _row_pair(row: object) -> Pair | str:
    """The pair of one row, or what is wrong with it."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return "messages is not a list of objects"
        roles = [m.get("role") for m in messages]
        user = 1 if roles[:1] == ["system"] else 0
        chat = roles[user:]  # user, then replies with the turns after them, the trained reply last
        if (chat[:1] != ["user"] or chat[1:2] != ["assistant"] or chat[-1] != "assistant"
                or not all(role in EPISODE_ROLES for role in chat[1:])):
            return f"messages have roles {roles}"
        texts = [m.get("content") for m in messages]
        if not all(isinstance(t, str) and t.strip() for t in texts):
            return "a message has no content"
        turns = tuple(zip(roles[user + 1:-1], texts[user + 1:-1], strict=True))
        return Pair(texts[user], texts[-1], texts[0] if user else None, turns)
    for key in ("prompt", "completion"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            return f"no {key}" if key not in row else f"{key} is {row[key]!r}"
    return Pair(row["prompt"], row["completion"])


def generated_pairs(settings: Settings) -> Iterator[Pair]:
    """The task's training prompts with their reference replies, endless."""
    name = settings.task.name
    if name == "chain":
        from areal_aio.tasks.chain import chain_items

        for it in chain_items(settings.task, settings.run.seed):
            yield Pair(f"{it.question} {STEP_INSTRUCTION}", it.solution)
    elif name == "arithmetic":
        for task in training_tasks(settings, in_loop=False):
            yield Pair(task.prompt, worked_reply(task))
    elif name == "calculator":  # one pair per reply of the reference episode, the turns before it as context
        missed = 0
        for task in training_tasks(settings, in_loop=False):
            turns = reference_turns(task)
            if turns is None:
                missed += 1
                if missed == MISMATCHES_IN_A_ROW:
                    raise ValueError(f"sft.data = generated: the calculator's value is not the answer of "
                                     f"{missed} tasks in a row (task.operators = {settings.task.operators})")
                continue
            missed = 0
            for k, (role, text) in enumerate(turns):
                if role == "assistant":
                    yield Pair(task.prompt, text, turns=tuple(turns[:k]))
    elif name in CODE_TASKS:  # the problem's reference solution, in the fence the prompt asks for
        for task in training_tasks(settings, in_loop=False):
            yield Pair(task.prompt, f"```python\n{task.answer.strip()}\n```")
    else:
        raise ValueError(f"sft.data = generated: task {name!r} has no reference replies; give sft.data "
                         f"a JSONL file of {{prompt, completion}} rows")


def tag_answers(settings: Settings) -> bool:
    """Whether the task's check is the built-in answer reward, whose strict pass is the tagged
    answer: a passing sampled reply then gets the tag it left out (sampled_pairs)."""
    return only_answer_check(load_rewards(settings.task, settings.judge))


def kept_reply(task: Task, reply: wire.Completion, score: Score, tag: bool) -> str | None:
    """What a sampled reply teaches: a finished, passing reply as it was written, with the tagged
    answer after it where `tag` and it left the tag out; None for a reply not kept."""
    if not score.passed or reply.finish == "length":
        return None
    if tag and not score.strict:
        return f"{reply.text.rstrip()}\n<answer>{task.answer}</answer>"
    return reply.text


async def sampled_pairs(settings: Settings, held_out: set[str], need: int,
                        folder: Path) -> tuple[list[Pair], dict[str, Any]]:
    """`need` pairs of the model's own replies (sft.data = sampled): training prompts in stream
    order, held-out ones left out, each answered once at sft.temperature (seed: run.seed and
    its place in the stream) by a rollout worker on every core (nothing runs beside it); a
    passing reply is kept (kept_reply), in stream order. Sampled once and kept where it passes,
    a prompt joins in proportion to the model's own chance of passing it, so tuning on the kept
    replies moves the model toward passing ones (rejection sampling, as in STaR and RFT) and
    leaves its way of answering, and so its answers, as they were. Returns the pairs and what
    the sampling measured (sft.json's "sampling")."""
    cfg, t0 = settings.sft, time.perf_counter()
    rollout = settings.rollout
    if (share := whole_machine_threads(settings.rollout_devices)) is not None:
        rollout = dataclasses.replace(rollout, threads=max(rollout.threads, share))
    sampling = dataclasses.replace(settings, rollout=rollout)
    stream = (t for t in training_tasks(settings, in_loop=False) if t.text not in held_out)
    tag = tag_answers(settings)
    scorer = Scorer(load_rewards(settings.task, settings.judge), timeout_s=settings.controller.reward_timeout_s, procs=0)
    pairs: list[Pair] = []
    drawn = passed = tagged = cut = 0
    try:
        async with rollout_session(sampling, folder / "sample-rollout.log") as worker:
            while len(pairs) < need:
                if drawn >= MOST_PROMPTS_PER_PAIR * need:
                    raise ValueError(f"sft.data = sampled: {passed} of the model's replies to {drawn} training "
                                     f"prompts passed, {need} are needed; tune on sft.data = generated or a "
                                     f"file of pairs instead")
                left = need - len(pairs)  # the next round: enough prompts at the pass rate so far
                tasks = list(itertools.islice(stream, max(left, round(left * drawn / max(passed, 1)))))
                msgs = [wire.Generate(f"sft{drawn + i}", t.text,
                                      rollout.max_new_tokens, cfg.temperature, 1.0,
                                      seed=derive(settings.run.seed, SAMPLE_SALT, drawn + i), messages=t.messages)
                        for i, t in enumerate(tasks)]
                replies = await answers(worker, msgs)
                scores = await score(scorer, tasks, replies)
                drawn += len(tasks)
                for task, reply, got in zip(tasks, replies, scores, strict=True):
                    passed += got.passed
                    cut += reply.finish == "length"
                    if (text := kept_reply(task, reply, got, tag)) is not None and len(pairs) < need:
                        tagged += text != reply.text
                        pairs.append(Pair(task.text, text, _system(task)))
    finally:
        await scorer.aclose()
    return pairs, {"prompts": drawn, "passed": passed, "pass_rate": round(passed / max(drawn, 1), 4),
                   "cut_at_max_new_tokens": cut, "kept": len(pairs), "tags_added": tagged,
                   "temperature": cfg.temperature, "seconds": round(time.perf_counter() - t0, 3)}


def _system(task: Task) -> str | None:
    """A chat task's system message (its turns before the user's: a system message at most);
    None for a plain prompt."""
    turns = task.messages or []
    if len(turns) > 2 or (len(turns) == 2 and turns[0].get("role") != "system"):
        raise ValueError(f"sft.data = sampled: task {task.id} is a chat of {len(turns)} turns; a pair holds a "
                         f"system message and one user prompt")
    return turns[0]["content"] if len(turns) == 2 else None


def sft_eval_set(settings: Settings) -> list[Task]:
    """The first sft.eval_size prompts of the task's held-out set."""
    if settings.sft.eval_size == 0:
        return []
    task = dataclasses.replace(settings.task, eval_size=settings.sft.eval_size)
    return eval_tasks(dataclasses.replace(settings, task=task))


def batches(settings: Settings, held_out: set[str]) -> list[list[Pair]]:
    """sft.steps batches of sft.batch_size pairs (generated or from a file; sampled ones come from
    sampled_pairs), none with a held-out prompt. Generated pairs
    come in stream order; a file's pairs are shuffled (run.seed) and cycled, reshuffled each pass."""
    cfg = settings.sft
    if cfg.data == "generated":
        source: Iterator[Pair] = (p for p in generated_pairs(settings) if p.prompt not in held_out)
    else:
        pool = [p for p in read_pairs(cfg.data) if p.prompt not in held_out]
        if not pool:
            raise ValueError(f"{cfg.data}: every pair's prompt is a held-out prompt")
        source = _shuffled_passes(pool, settings.run.seed)
    return [list(itertools.islice(source, cfg.batch_size)) for _ in range(cfg.steps)]


def _shuffled_passes(pool: list[Pair], seed: int) -> Iterator[Pair]:
    rng = random.Random(seed)
    while True:
        order = pool[:]
        rng.shuffle(order)
        yield from order


def tokenize(tokenizer: Any, pair: Pair, system_prompt: str = "") -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a pair: the prompt ids the rollout worker is given for
    this reply, the completion as the chat template writes the assistant's turn, up to and
    including the token that ends it (EOS, where generation stops).

    The prompt is templated as for a first reply (encode_prompt). Each earlier reply then joins
    it as an episode's context holds it: its ids as a completion here, without the EOS (a reply
    cut at a stop string, such as the calculator's </calc>, has none), then the turns after it
    as the worker renders them for the next reply (encode_turns; the reply not closed, so they
    begin with the template's end of turn: where a reply ended with EOS, the same ids)."""
    from areal_aio.workers.models import encode_prompt, encode_turns

    system = system_prompt if pair.system is None else pair.system
    chat = [{"role": "system", "content": system}] if system else []
    chat.append({"role": "user", "content": pair.prompt})
    ids = encode_prompt(tokenizer, pair.prompt, system)
    for reply, turns in _rounds(pair.turns):
        reply_ids = _reply_ids(tokenizer, chat, ids, reply)
        if reply_ids[-1:] == [tokenizer.eos_token_id]:
            reply_ids = reply_ids[:-1]
        ids = ids + reply_ids + encode_turns(tokenizer, turns, closed=False)
        chat += [{"role": "assistant", "content": reply}, *turns]
    return ids, _reply_ids(tokenizer, chat, ids, pair.completion)


def _rounds(turns: tuple[tuple[str, str], ...]) -> list[tuple[str, list[dict[str, str]]]]:
    """An episode's earlier turns as (reply, the turns added after it) rounds."""
    rounds: list[tuple[str, list[dict[str, str]]]] = []
    for role, text in turns:
        if role == "assistant":
            rounds.append((text, []))
        elif rounds:
            rounds[-1][1].append({"role": role, "content": text})
        else:
            raise ValueError(f"a pair's turns begin with a {role!r} turn: an episode adds turns after a reply")
    return rounds


def _reply_ids(tokenizer: Any, chat: list[dict[str, str]], context: list[int], reply: str) -> list[int]:
    """`reply`'s ids after `context` (the ids of `chat` as the rollout worker is given them), as
    the chat template writes the assistant's turn, up to and including its EOS. A template that
    does not extend the context's ids gets the reply's own tokens and EOS instead."""
    full = tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": reply}], tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    eos = tokenizer.eos_token_id
    tail = full[len(context):]
    if full[:len(context)] == context and eos in tail:
        return tail[:tail.index(eos) + 1]
    end = [] if eos is None else [eos]
    return [*tokenizer.encode(reply, add_special_tokens=False), *end]


def train_samples(tokenized: list[tuple[list[int], list[int]]], version: int) -> list[wire.TrainSample]:
    """One Train's samples: one group (identical prompts then share a packed row), no rewards."""
    return [wire.TrainSample(p, c, [0.0] * len(c), [version] * len(c), 0.0, 0) for p, c in tokenized]


# ---------------------------------------------------------------- evals


def plain_tasks(tasks: list[Task]) -> list[Task]:
    """The step prompts among `tasks` with the plain answer instruction in place of the step one."""
    return [Task(t.id, f"{t.prompt.removesuffix(STEP_INSTRUCTION).rstrip()} {ANSWER_INSTRUCTION}", t.answer)
            for t in tasks if t.prompt.endswith(STEP_INSTRUCTION)]


def format_rates(completions: list[wire.Completion], scores: list[Any]) -> dict[str, Any]:
    """Valid step-tagged replies, pass and strict rates, and why the invalid ones are invalid."""
    parsed = [parse(c.text) for c in completions]
    problems = collections.Counter(p.problem for p in parsed if not p.valid)
    return {"n": len(completions), "valid_rate": sum(p.valid for p in parsed) / len(parsed), **rates(scores),
            "tokens_mean": sum(len(c.completion_ids) for c in completions) / len(completions),
            "cut_at_max_new_tokens": sum(c.finish == "length" for c in completions),
            "problems": dict(problems.most_common())}


async def evaluate(settings: Settings, stages: dict[str, list[Task]], folder: Path,
                   log: str) -> dict[str, dict[str, Any]]:
    """Greedy replies of settings.model.path to every stage's tasks (one rollout worker; in an
    episode run, one greedy episode per task, scored on its last reply as the run's eval is),
    scored; their rows are appended to samples.jsonl."""
    everything = [t for tasks in stages.values() for t in tasks]
    scorer = Scorer(load_rewards(settings.task, settings.judge), timeout_s=settings.controller.reward_timeout_s, procs=0)
    turns, failed = None, None
    try:
        if spec := episode_spec(settings):
            played = await greedy_episodes(settings, everything, folder / log, load_episode(spec), scorer)
            completions, scores, turns, failed = played.completions, played.scores, played.turns, played.failed
        else:
            completions = await greedy_completions(settings, everything, folder / log)
            scores = await score(scorer, everything, completions)
    finally:
        await scorer.aclose()
    out, lo, rows = {}, 0, []
    for stage, tasks in stages.items():
        done, got = completions[lo:lo + len(tasks)], scores[lo:lo + len(tasks)]
        their_turns = turns[lo:lo + len(tasks)] if turns is not None else None
        lo += len(tasks)
        out[stage] = format_rates(done, got)
        if failed is not None:  # an episode run: the episodes that failed (scored 0)
            out[stage]["episode_failures"] = sum(failed[lo - len(tasks):lo])
        for row, c in zip(sample_rows(0, tasks, done, got, their_turns), done, strict=True):
            reply = parse(c.text)
            rows.append({**row, "kind": "sft_eval", "stage": stage, "valid": reply.valid,
                         "problem": reply.problem})
    with open(folder / "samples.jsonl", "ab") as fh:
        fh.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return out


# ---------------------------------------------------------------- the run


def sft_folder(settings: Settings, out: str | None) -> Path:
    name = settings.run.name or f"sft-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return Path(out) if out is not None else Path(settings.run.out_dir) / name


def check(settings: Settings, folder: Path, out: str | None) -> None:
    """Preflight of the tuning: the run's checks, sft.data and the folder (PreflightError)."""
    preflight(settings, out)
    check_data(settings)
    check_folder(folder, "--out" if out else "run.name")


def check_data(settings: Settings) -> None:
    """sft.data can be had: generated replies for this task, or a readable file of pairs."""
    data = settings.sft.data
    if data == SAMPLED:
        if episode_spec(settings):
            raise PreflightError(f"sft.data = sampled: task {settings.task.name!r} plays episodes; sampled "
                                 "replies are one reply to one prompt (use generated or a file of chat rows)")
    elif data == "generated":
        if settings.task.name not in (*SFT_GENERATED, *CODE_TASKS):
            raise PreflightError(f"sft.data = generated: task {settings.task.name!r} has no reference "
                                 "replies; give sft.data a JSONL file of {prompt, completion} rows")
    else:
        read_checked("sft.data", data, lambda: read_pairs(data), "a JSONL file", " (or 'generated')")


def check_folder(folder: Path, key: str) -> None:
    found = [name for name in FOLDER_FILES if (folder / name).exists()]
    if found:
        raise PreflightError(f"{key}: {folder} already holds a run ({found[0]}); pick another folder")


async def warm_start(settings: Settings, folder: Path) -> Settings:
    """A run's cold start (sft.before_run): the tuning into `folder` without its evals (the run's
    step-0 eval is the tuned model's), the trainer on every core of a CPU, since nothing runs
    beside it; returns the run's settings, training from the tuned model (before_run off: what
    the run is, and what a copy of its settings.toml does again)."""
    trainer = settings.trainer
    if (share := whole_machine_threads(settings.trainer_devices)) is not None:
        trainer = dataclasses.replace(trainer, threads=max(trainer.threads, share))
    await fine_tune(dataclasses.replace(settings, trainer=trainer,
                                        sft=dataclasses.replace(settings.sft, eval_size=0)), folder)
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, path=str((folder / "model").resolve())),
                               sft=dataclasses.replace(settings.sft, before_run="off"))


async def fine_tune(settings: Settings, folder: Path) -> dict[str, Any]:
    """The whole tuning (module docstring); returns what sft.json holds."""
    from areal_aio.fleet import placement
    from areal_aio.fleet.client import ensure_model
    from areal_aio.store.weights import WeightStore

    t0 = time.perf_counter()
    cfg = settings.sft
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings.toml").write_text(settings.to_toml())
    eval_set = sft_eval_set(settings)
    held_out = {t.prompt for t in eval_tasks(settings)} | {t.prompt for t in eval_set}
    await ensure_model(settings.model.path)
    sampling: dict[str, Any] = {}
    if cfg.data == SAMPLED:
        pairs, sampling = await sampled_pairs(settings, held_out, cfg.steps * cfg.batch_size, folder)
        plan = [pairs[i:i + cfg.batch_size] for i in range(0, len(pairs), cfg.batch_size)]
    else:
        plan = batches(settings, held_out)
    tokenized = await asyncio.to_thread(_tokenize_all, settings, plan)
    longest = max(len(c) for batch in tokenized for _, c in batch)
    too_long = sum(len(c) > settings.rollout.max_new_tokens for batch in tokenized for _, c in batch)
    if too_long:
        say(f"warning: {too_long} completions are longer than rollout.max_new_tokens "
            f"({settings.rollout.max_new_tokens} tokens; the longest has {longest}): the evals cut them",
            folder=folder)

    stages = {"before": eval_set}
    if plain := plain_tasks(eval_set):
        stages["before_plain"] = plain
    trainer_settings = dataclasses.replace(settings, trainer=dataclasses.replace(
        settings.trainer, lr=cfg.lr, minibatches=1, kl_coef=0.0))
    tuning = Tuning(trainer_settings, folder, placement.trainer_client(trainer_settings, folder),
                    WeightStore.create(f"sft-{folder.name}"), t0)
    evaluating = None
    try:
        async with asyncio.TaskGroup() as tg:
            training = tg.create_task(tuning.train(tokenized))
            if eval_set:  # the base model's eval runs beside the training
                evaluating = tg.create_task(evaluate(settings, stages, folder, "eval-before-rollout.log"))
    finally:
        await tuning.close()
    before = evaluating.result() if evaluating is not None else {}
    after: dict[str, Any] = {}
    if eval_set:
        tuned = dataclasses.replace(settings, model=dataclasses.replace(settings.model, path=str(folder / "model")))
        after = await evaluate(tuned, {"after": eval_set}, folder, "eval-after-rollout.log")
    summary = {
        **tuning.record(), "ended": "completed",
        "pairs": sum(map(len, plan)), "distinct_prompts": len({p.prompt for b in plan for p in b}),
        "completion_tokens_max": longest, "completions_over_max_new_tokens": too_long,
        **({"sampling": sampling} if sampling else {}),
        "train_s": round(training.result(), 3), "wall_s": round(time.perf_counter() - t0, 3),
        "eval_size": len(eval_set), "max_new_tokens": settings.rollout.max_new_tokens,
        **before, **after,
    }
    (folder / "sft.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


@dataclass
class Tuning:
    """The trainer worker's side of a tuning: the steps, steps.jsonl, model/ and, when it is
    stopped, the model so far (what a stopped run keeps, a stopped tuning keeps too)."""

    settings: Settings  # the run's, with the trainer's lr, one mini-batch and no KL (fine_tune)
    folder: Path
    trainer: Any  # fleet.client.WorkerClient
    store: Any  # store.weights.WeightStore: the trainer's /dev/shm folder (nothing is published)
    t0: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    async def train(self, tokenized: list) -> float:
        """Every step, then model/; returns the seconds of the steps alone."""
        t_start = time.perf_counter()
        await self.trainer.start(wire.Init("trainer", self.settings.to_dict(), str(self.store.root)))
        t_train = time.perf_counter()
        with open(self.folder / "steps.jsonl", "ab") as fh:
            try:
                for step, batch in enumerate(tokenized, start=1):
                    await self.trainer.send(wire.Train(step, step - 1, train_samples(batch, step - 1),
                                                       objective=SFT, publish=False))
                    self._step(await self.trainer.recv(), fh, t_start)
            except asyncio.CancelledError:  # stopped: keep the steps made (the command's exit line follows)
                await self._keep_stopped(fh, t_start)
                raise
            train_s = time.perf_counter() - t_train
            await self._save(fh, t_start)
        return train_s

    async def close(self) -> None:
        """The trainer stopped, then what it may have been writing into removed: its /dev/shm
        folder and a model/ it did not finish, whatever the stop raised."""
        try:
            await self.trainer.stop()
        finally:
            self.store.close()
            shutil.rmtree(self.folder / ".model.tmp", ignore_errors=True)

    def record(self) -> dict[str, Any]:
        """What sft.json holds for a finished or a stopped tuning."""
        cfg, rows = self.settings.sft, self.rows
        return {"model": str(self.folder / "model"), "base_model": self.settings.model.path,
                "task": self.settings.task.name, "data": cfg.data, "steps": cfg.steps, "steps_done": len(rows),
                "batch_size": cfg.batch_size, "lr": cfg.lr, "tokens_trained": sum(r["tokens"] for r in rows),
                "loss_first": rows[0]["loss"] if rows else None, "loss_last": rows[-1]["loss"] if rows else None}

    def _step(self, msg: Any, fh: Any, t_start: float) -> None:
        """One Trained reply: a steps.jsonl row (and the progress line)."""
        if not isinstance(msg, wire.Trained):
            raise self.trainer.failure(msg)
        row = {"step": len(self.rows) + 1, **msg.stats, "wall_s": round(time.perf_counter() - t_start, 3)}
        self.rows.append(row)
        fh.write(orjson.dumps(row) + b"\n")
        fh.flush()
        if self.settings.run.progress:
            say(f"sft step {row['step']}/{self.settings.sft.steps}: loss {row['loss']:.4f}, {row['tokens']} "
                f"tokens, {row['seconds']:.1f}s", folder=self.folder)

    async def _save(self, fh: Any, t_start: float) -> None:
        """model/ written whole or not at all (a temp folder renamed, as a run's exports are); a
        step still in flight answers first and is recorded."""
        tmp = self.folder / ".model.tmp"
        await self.trainer.send(wire.Save("model", str(tmp)))
        while isinstance(msg := await self.trainer.recv(), wire.Trained):
            self._step(msg, fh, t_start)
        if not isinstance(msg, wire.Saved):
            raise self.trainer.failure(msg)
        replace_folder(tmp, self.folder / "model")  # in the loop: a stop's timeout cannot cut it in two

    async def _keep_stopped(self, fh: Any, t_start: float) -> None:
        """A stopped tuning keeps what it learned: the step in flight ends, model/ is written and
        sft.json says how far it got. Keeping never hides the stop: a failure is one line."""
        try:
            await asyncio.wait_for(self._save(fh, t_start), STOP_SAVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the stop is what the caller reports
            say(f"areal_aio: could not write the tuned model: {exc}", folder=self.folder)
            return
        summary = {**self.record(), "ended": "interrupted", "wall_s": round(time.perf_counter() - self.t0, 3)}
        (self.folder / "sft.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        say(f"sft stopped at step {len(self.rows)} of {self.settings.sft.steps}: the model so far is in "
            f"{self.folder / 'model'}", folder=self.folder)


def _tokenize_all(settings: Settings, plan: list[list[Pair]]) -> list[list[tuple[list[int], list[int]]]]:
    from areal_aio.workers.models import load_tokenizer

    tokenizer = load_tokenizer(settings.model.path)
    return [[tokenize(tokenizer, pair, settings.model.system_prompt) for pair in batch] for batch in plan]


def eval_line(stage: str, r: dict[str, Any]) -> str:
    """One eval's line: its rates, or, where every episode failed, that there is no score."""
    failed = r.get("episode_failures", 0)
    if failed and failed == r["n"]:
        return f"{stage:>12}: all {r['n']} episodes failed (each scored 0; samples.jsonl has their turns): no score"
    said = f"; {failed} episodes failed, scored 0" if failed else ""
    return (f"{stage:>12}: valid {r['valid_rate']:.3f}  pass {r['pass_rate']:.3f}  strict {r['strict_rate']:.3f}  "
            f"({r['n']} held-out prompts{said})")


def main(settings_path: str, overrides: list[str], out: str | None) -> int:
    """`python -m areal_aio sft`: exit 0 done, 1 failed (one line; error.log), 2 bad input, 130 / 143."""
    from areal_aio.app.runner import exit_code, run_owned

    try:
        settings = load_settings(settings_path, overrides)
        folder = sft_folder(settings, out)
        check(settings, folder, out)
    except SettingsError as exc:
        say(f"settings error: {exc}")
        return 2
    try:
        summary = run_owned(fine_tune(settings, folder))
    except BaseException as exc:  # noqa: BLE001 - exit_code re-raises what is not a run's end
        return exit_code(exc, folder)
    lines = [eval_line(stage, r) for stage in ("before_plain", "before", "after") if (r := summary.get(stage))]
    lines += [f"{summary['steps']} steps, {summary['pairs']} pairs, loss {summary['loss_first']:.3f} -> "
              f"{summary['loss_last']:.3f}, training {summary['train_s']:.0f}s, all {summary['wall_s']:.0f}s",
              f"model: {summary['model']}"]
    say("\n".join(lines), sys.stdout, folder)
    return 0
