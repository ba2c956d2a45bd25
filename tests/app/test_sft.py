"""areal_aio/app/sft.py: the data it trains on, its checks, and (slow) the whole command on tiny-random."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from areal_aio import wire
from areal_aio.agents import calculator
from areal_aio.agents.calculator import calculate
from areal_aio.agents.model import Bounds, Model
from areal_aio.app.preflight import PreflightError
from areal_aio.app.sft import (
    Pair,
    batches,
    check,
    format_rates,
    generated_pairs,
    plain_tasks,
    read_pairs,
    sft_eval_set,
    tokenize,
    train_samples,
)
from areal_aio.control.sources import eval_tasks, training_tasks
from areal_aio.rewards.scoring import AnswerReward, Score
from areal_aio.settings import build_settings
from areal_aio.tasks.arithmetic import ANSWER_INSTRUCTION
from areal_aio.tasks.steps import STEP_INSTRUCTION, parse
from areal_aio.tasks.task import Task
from tests.conftest import ROOT as ROOT
from tests.conftest import alive

CHAIN = {"task": {"name": "chain", "terms": 3, "eval_size": 8}, "sft": {"steps": 5, "batch_size": 4, "eval_size": 8}}
PRODUCTS = ["task.name=calculator", "task.digits=3", 'task.operators=["+","*"]']


def write(path: Path, *rows: object) -> Path:
    path.write_bytes(b"\n".join(r if isinstance(r, bytes) else orjson.dumps(r) for r in rows) + b"\n")
    return path


def test_read_pairs_takes_both_row_shapes(tmp_path):
    path = write(tmp_path / "pairs.jsonl", {"prompt": "Say hi.", "completion": "hi"},
                 {"messages": [{"role": "user", "content": "Say yo."}, {"role": "assistant", "content": "yo"}]},
                 {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say ok."},
                               {"role": "assistant", "content": "ok"}]})
    assert read_pairs(path) == [Pair("Say hi.", "hi"), Pair("Say yo.", "yo"), Pair("Say ok.", "ok", "Be terse.")]


def test_read_pairs_takes_an_episode_and_trains_its_last_reply(tmp_path):
    chat = [{"role": "user", "content": "Calculate 12 * 34."}, {"role": "assistant", "content": "<calc>12 * 34</calc>"},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "<answer>408</answer>"}]
    path = write(tmp_path / "pairs.jsonl", {"messages": chat},
                 {"messages": [{"role": "system", "content": "Be terse."}, *chat]})
    turns = (("assistant", "<calc>12 * 34</calc>"), ("tool", "408"))
    assert read_pairs(path) == [Pair("Calculate 12 * 34.", "<answer>408</answer>", None, turns),
                                Pair("Calculate 12 * 34.", "<answer>408</answer>", "Be terse.", turns)]


@pytest.mark.parametrize("row,problem", [
    (b"{nope", "not valid JSON"),
    ([1, 2], "a list, not an object"),
    ({"prompt": "q"}, "no completion"),
    ({"prompt": "q", "completion": ""}, "completion is ''"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     r"messages have roles \['assistant', 'user'\]"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}, "a message has no content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "1"},
                   {"role": "assistant", "content": "a"}]}, re.escape("messages have roles ['user', 'tool', 'assistant']")),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "tool", "content": "1"}]}, re.escape("messages have roles ['user', 'assistant', 'tool']")),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]},
     re.escape("messages have roles ['user', 'assistant', 'system', 'assistant']")),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": ["tool"]},
                   {"role": "assistant", "content": "b"}]}, "messages have roles"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "tool", "content": ""}, {"role": "assistant", "content": "b"}]}, "a message has no content"),
    ({"messages": []}, re.escape("messages have roles []")),
])
def test_a_bad_pair_row_names_its_line(tmp_path, row, problem):
    path = write(tmp_path / "bad.jsonl", {"prompt": "q", "completion": "a"}, row)
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: {problem}"):
        read_pairs(path)


def test_generated_pairs_are_the_tasks_reference_replies():
    chain = build_settings(CHAIN)
    for pair in list(zip(range(20), generated_pairs(chain), strict=False)):
        prompt, reply = pair[1].prompt, parse(pair[1].completion)
        assert prompt.endswith(STEP_INSTRUCTION) and reply.valid and len(reply.steps) == 2
    for pair in list(zip(range(20), generated_pairs(build_settings({})), strict=False)):
        prompt, reply = pair[1].prompt, pair[1].completion
        assert prompt.startswith("Calculate ") and prompt.endswith(ANSWER_INSTRUCTION)
        question = prompt.removeprefix("Calculate ").split(". ")[0]
        answer = reply.rsplit("<answer>", 1)[1].removesuffix("</answer>")
        assert reply == f"{question} = {answer}\n<answer>{answer}</answer>" and int(answer) == eval_sum(question)
    with pytest.raises(ValueError, match="no reference replies"):
        next(generated_pairs(build_settings({"task": {"name": "jsonl", "path": "x.jsonl"}})))


@pytest.mark.parametrize("overrides,covers", [
    ([], lambda task: int(task.answer) < 0),  # single-digit + and -: negative differences among them
    (PRODUCTS, lambda task: " * " in task.text and len(task.answer) >= 5),
    (["task.digits=3", 'task.operators=["-"]'], lambda task: int(task.answer) < -100),
])
def test_calculator_pairs_call_the_tool_then_answer_its_value(overrides, covers):
    """Two pairs per training task, in the tasks' order: the call on the question's expression,
    then, after the call and the tool turn with calculate's value, that value as the answer, which
    the task's reward scores correct (and tagged)."""
    settings = build_settings({}, ["task.name=calculator", *overrides])
    tasks = list(itertools.islice(training_tasks(settings, in_loop=False), 300))
    pairs = list(itertools.islice(generated_pairs(settings), 2 * len(tasks)))
    reward = AnswerReward()
    for task, call, answer in zip(tasks, pairs[::2], pairs[1::2], strict=True):
        expression = task.text.removeprefix("Calculate ").split(". ")[0]
        value = calculate(expression)
        assert call == Pair(task.prompt, f"<calc>{expression}</calc>")
        assert answer == Pair(task.prompt, f"<answer>{value}</answer>",
                              turns=(("assistant", call.completion), ("tool", value)))
        assert reward(task, answer.completion).strict
    assert sum(map(covers, tasks)) > 10


def test_calculator_pairs_stop_when_the_calculator_never_agrees(monkeypatch):
    monkeypatch.setattr("areal_aio.app.sft.reference_turns", lambda task: None)
    with pytest.raises(ValueError, match="not the answer of 1000 tasks in a row"):
        next(generated_pairs(build_settings({}, ["task.name=calculator"])))


def eval_sum(text: str) -> int:
    """A two-term + or - sum, read without eval."""
    a, op, b = text.split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_batches_leave_out_held_out_prompts_and_are_deterministic(tmp_path):
    s = build_settings(CHAIN, ["sft.steps=40"])
    everything = [p.prompt for b in batches(s, set()) for p in b]
    held_out = {everything[0], everything[7]}
    plan = batches(s, held_out)
    assert len(plan) == 40 and all(len(b) == 4 for b in plan) and plan == batches(s, held_out)
    prompts = [p.prompt for b in plan for p in b]
    assert not held_out & set(prompts)
    assert prompts[:6] == everything[1:7] and prompts[6] == everything[8]
    # a file's pairs: shuffled, every pair once per pass
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(6)]
    path = write(tmp_path / "pairs.jsonl", *rows)
    s = build_settings({"sft": {"data": str(path), "steps": 3, "batch_size": 4}})
    order = [p.prompt for b in batches(s, {"q5"}) for p in b]
    assert sorted(order[:5]) == [f"q{i}" for i in range(5)] and sorted(order[5:10]) == sorted(order[:5])
    assert order[:5] != [f"q{i}" for i in range(5)]


def test_sft_eval_set_is_the_head_of_the_held_out_set():
    s = build_settings(CHAIN, ["sft.eval_size=3"])
    assert sft_eval_set(s) == eval_tasks(s)[:3]
    assert sft_eval_set(build_settings(CHAIN, ["sft.eval_size=0"])) == []


@pytest.fixture(scope="module")
def tokenizer():
    from areal_aio.workers.models import TINY, load_tokenizer

    return load_tokenizer(TINY)


def test_tokenize_gives_the_rollout_prompt_and_the_turn_up_to_eos(tokenizer):
    from areal_aio.workers.models import encode_prompt

    pair = Pair("Calculate 4 - 1 - 7.", "Step 1: 4 - 1 = 3\nStep 2: 3 - 7 = -4\n<answer>-4</answer>")
    prompt, completion = tokenize(tokenizer, pair)
    assert prompt == encode_prompt(tokenizer, pair.prompt)
    assert completion[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in completion[:-1]
    assert tokenizer.decode(completion[:-1]) == pair.completion
    own, _ = tokenize(tokenizer, Pair(pair.prompt, pair.completion, "Be terse."), "ignored")
    assert own == encode_prompt(tokenizer, pair.prompt, "Be terse.")
    assert tokenize(tokenizer, pair, "Be terse.")[0] == own
    samples = train_samples([(prompt, completion)], version=3)
    assert samples[0].versions == [3] * len(completion) and samples[0].logprobs == [0.0] * len(completion)


async def test_calculator_pairs_tokenize_as_the_episode_feeds_the_rollout_worker(tokenizer):
    """A model that writes exactly what it was tuned on, played through the calculator episode by
    a stand-in for the rollout worker (its templating calls, the engine's cut at EOS or at a stop
    string): the worker is given each pair's prompt ids, and the call, cut at </calc> before its
    EOS, is followed in the episode's context by that EOS, as it was trained."""
    from areal_aio.workers.models import encode_prompt, encode_turns
    from areal_aio.workers.rollout.engine import stop_in_tail

    settings = build_settings({}, PRODUCTS)
    task = next(iter(training_tasks(settings, in_loop=False)))
    call, answer = itertools.islice(generated_pairs(settings), 2)
    system, eos = "Be brief.", tokenizer.eos_token_id
    trained = [tokenize(tokenizer, call, system), tokenize(tokenizer, answer, system)]
    fed = []

    async def worker(ask):
        msg = ask.generate(f"r{len(fed)}", task, 0.0, 1.0)
        if msg.context_ids is None:  # workers/rollout/worker.py, _handle
            ids = encode_prompt(tokenizer, msg.messages or msg.prompt, system, msg.prefix)
        else:
            closed = bool(msg.context_ids) and msg.context_ids[-1] == eos
            ids = msg.context_ids + encode_turns(tokenizer, msg.append or [], closed)
        fed.append(ids)
        reply = []
        for token in trained[len(fed) - 1][1]:
            reply.append(token)
            if token == eos or (msg.stop and stop_in_tail(tokenizer, reply, tuple(msg.stop))):
                break
        return wire.Completion(msg.request_id, ids, reply, [0.0] * len(reply), [0] * len(reply),
                               tokenizer.decode(reply, skip_special_tokens=True), "stop", 0, 0.0)

    model = Model(Bounds.of(settings), worker)
    await calculator.episode(task, model)
    assert fed == [prompt for prompt, _ in trained]
    (prompt, reply), (context, last) = trained
    assert reply[-1] == eos and tokenizer.decode(reply[:-1]) == call.completion
    assert model.transcript.turns[0]["tokens"] == len(reply) - 1  # the live call stopped at </calc>
    assert context[:len(prompt) + len(reply)] == prompt + reply  # and its context holds the EOS it was trained on
    value = answer.turns[1][1]
    assert tokenizer.decode(context[len(prompt):]) == (f"{call.completion}<|im_end|>\n<|im_start|>tool\n{value}"
                                                       f"<|im_end|>\n<|im_start|>assistant\n")
    assert model.transcript.context_ids == context + last and last[-1] == eos
    assert AnswerReward()(task, model.transcript.last.text).strict


def test_tokenize_continues_after_a_reply_that_ended_with_eos(tokenizer):
    """An earlier reply that ended with EOS (no stop string): the worker leaves the EOS the
    context holds out of the turns it renders (closed), so the ids are the same."""
    from areal_aio.workers.models import encode_turns

    first = Pair("Say hi.", "hi")
    prompt, reply = tokenize(tokenizer, first)
    context, _ = tokenize(tokenizer, Pair("Say hi.", "ok", turns=(("assistant", "hi"), ("user", "Again."))))
    assert context == prompt + reply + encode_turns(tokenizer, [{"role": "user", "content": "Again."}], closed=True)
    with pytest.raises(ValueError, match="begin with a 'tool' turn"):
        tokenize(tokenizer, Pair("Say hi.", "ok", turns=(("tool", "1"),)))


async def test_calculator_evals_play_the_episode(tmp_path, monkeypatch):
    """A calculator tuning's evals are greedy episodes, scored on the last reply, as a run's are."""
    from areal_aio.app.sft import evaluate
    from areal_aio.fleet.fakes import FakeRollout

    rollout = FakeRollout(policy=lambda prompt, version: "<calc>2 * 3</calc>",
                          continuation=lambda msg, version: f"<answer>{msg.append[0]['content']}</answer>")
    monkeypatch.setattr("areal_aio.control.evaluation.eval_rollout", lambda settings, log: rollout)
    tasks = [Task(f"e{i}", f"Calculate 2 * 3. {calculator.CALCULATOR_INSTRUCTION}", "6") for i in range(3)]
    got = await evaluate(build_settings({}, ["task.name=calculator"]), {"before": tasks}, tmp_path, "eval.log")
    assert got["before"]["pass_rate"] == got["before"]["strict_rate"] == 1.0
    rows = [orjson.loads(line) for line in (tmp_path / "samples.jsonl").read_bytes().splitlines()]
    assert [[t["text"] for t in r["turns"]] for r in rows] == [["<calc>2 * 3</calc>", "6", "<answer>6</answer>"]] * 3


def test_plain_tasks_swap_the_step_instruction_for_the_answer_one():
    tasks = [Task("e0", f"Calculate 1 + 2. {STEP_INSTRUCTION}", "3"), Task("e1", "Calculate 1.", "1")]
    assert plain_tasks(tasks) == [Task("e0", f"Calculate 1 + 2. {ANSWER_INSTRUCTION}", "3")]


def test_format_rates_count_valid_replies_and_name_the_problems():
    texts = ["Step 1: 1 + 2 = 3\n<answer>3</answer>", "<answer>3</answer>", "Step 1: 1 + 2 = 3\n", "3"]
    done = [wire.Completion(f"r{i}", [1], [2] * (i + 1), [0.0] * (i + 1), [0] * (i + 1), text,
                            "length" if i == 2 else "stop", 0, 0.1) for i, text in enumerate(texts)]
    scores = [Score(1.2, True, True), Score(1.2, True, True), Score(0.0, False), Score(1.0, True)]
    got = format_rates(done, scores)
    assert got["valid_rate"] == 0.25 and got["pass_rate"] == 0.75 and got["strict_rate"] == 0.5
    assert got["problems"] == {"no steps": 2, "no <answer> tag": 1} and got["cut_at_max_new_tokens"] == 1
    assert got["tokens_mean"] == 2.5


def test_check_names_the_bad_input(tmp_path):
    with pytest.raises(PreflightError, match="sft.data: no such file"):
        check(build_settings({"sft": {"data": str(tmp_path / "none.jsonl")}}), tmp_path / "a", None)
    bad = write(tmp_path / "bad.jsonl", {"prompt": "q"})
    with pytest.raises(PreflightError, match=r"sft.data: .*bad.jsonl:1: no completion"):
        check(build_settings({"sft": {"data": str(bad)}}), tmp_path / "a", None)
    tasks = write(tmp_path / "tasks.jsonl", {"prompt": "q", "answer": "1"})
    with pytest.raises(PreflightError, match="no reference replies"):
        check(build_settings({"task": {"name": "jsonl", "path": str(tasks)}}), tmp_path / "a", None)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "sft.json").write_text("{}")
    with pytest.raises(PreflightError, match="already holds a run"):
        check(build_settings({}), tmp_path / "used", str(tmp_path / "used"))
    check(build_settings(CHAIN), tmp_path / "fresh", None)
    check(build_settings({}, PRODUCTS), tmp_path / "fresh", None)


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "areal_aio", "sft", str(ROOT / "settings.toml"),
                           "--set", "sft.data=missing.jsonl", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "sft.data: no such file 'missing.jsonl'" in done.stderr


@pytest.mark.slow
def test_sft_command_writes_a_loadable_model_and_its_record(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tuned"
    done = subprocess.run(
        [sys.executable, "-m", "areal_aio", "sft", str(ROOT / "settings.toml"), "--out", str(out),
         "--set", "model.path=embedded:tiny-random", "--set", "task.name=chain", "--set", "task.terms=3",
         "--set", "sft.steps=3", "--set", "sft.batch_size=4", "--set", "sft.eval_size=4", "--set", "sft.lr=1e-3",
         "--set", "rollout.max_new_tokens=6", "--set", "trainer.bf16=off", "--set", "run.progress=false"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model: {out / 'model'}" in done.stdout
    record = orjson.loads((out / "sft.json").read_bytes())
    assert record["steps"] == 3 and record["pairs"] == 12 and record["loss_last"] < record["loss_first"]
    assert {"before", "before_plain", "after"} <= set(record) and record["after"]["n"] == 4
    steps = [orjson.loads(line) for line in (out / "steps.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3]
    rows = [orjson.loads(line) for line in (out / "samples.jsonl").read_bytes().splitlines()]
    assert sorted({r["stage"] for r in rows}) == ["after", "before", "before_plain"] and len(rows) == 12
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 2 and tok.chat_template
    assert not list(Path("/dev/shm/areal_aio").glob("sft-tuned-*"))


def test_before_run_auto_is_on_where_there_is_something_to_tune_on(tmp_path):
    assert not build_settings({}).sft_before_run and build_settings(CHAIN).sft_before_run  # arithmetic: off
    assert build_settings({}, ["sft.data=sampled"]).sft_before_run
    assert build_settings({}, ["task.name=calculator"]).sft_before_run
    assert build_settings({}, ["task.name=functions"]).sft_before_run
    assert not build_settings({}, ["task.name=code"]).sft_before_run  # a CodeI/O warm start was not measured
    tasks = {"task": {"name": "jsonl", "path": str(tmp_path / "tasks.jsonl")}}
    assert not build_settings(tasks).sft_before_run
    assert build_settings({**tasks, "sft": {"data": "pairs.jsonl"}}).sft_before_run
    assert not build_settings({}, ["sft.before_run=off"]).sft_before_run
    assert build_settings(tasks, ["sft.before_run=on"]).sft_before_run


def test_run_checks_the_cold_start_before_it_starts(tmp_path):
    """A run whose cold start cannot be had is one line and exit 2, before any worker starts."""
    tasks = write(tmp_path / "tasks.jsonl", {"prompt": "q", "answer": "1"})
    done = subprocess.run([sys.executable, "-m", "areal_aio", "run", str(ROOT / "settings.toml"),
                           "--set", "task.name=jsonl", "--set", f"task.path={tasks}", "--set", "sft.before_run=on",
                           "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "sft.data = generated: task 'jsonl' has no reference replies" in done.stderr
    checked = subprocess.run([sys.executable, "-m", "areal_aio", "check", str(ROOT / "settings.toml"),
                              "--set", "task.name=jsonl", "--set", f"task.path={tasks}", "--set", "sft.before_run=on"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert checked.returncode == 2 and "has no reference replies" in checked.stderr  # check says it too
    (tmp_path / "left" / "sft").mkdir(parents=True)
    (tmp_path / "left" / "sft" / "steps.jsonl").write_text("")  # a cold start that was stopped
    done = subprocess.run([sys.executable, "-m", "areal_aio", "run", str(ROOT / "settings.toml"), "--set",
                           "sft.before_run=on", "--out", str(tmp_path / "left")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "already holds a run (steps.jsonl)" in done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_run_tunes_first_then_trains_rl_from_the_tuned_model(tmp_path):
    """sft.before_run: the run folder gets sft/ (its steps, its model) and the RL run's settings
    name that model and say the tuning is done, so a resume or a copy does not tune again."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_aio", "run", str(ROOT / "settings.toml"), "--out", str(out),
         "--set", "model.path=embedded:tiny-random", "--set", "sft.before_run=on", "--set", "sft.steps=2",
         "--set", "sft.batch_size=4", "--set", "run.max_steps=2", "--set", "rollout.group_size=4", "--set", "trainer.batch_size=8",
         "--set", "rollout.max_new_tokens=8", "--set", "task.eval_size=4", "--set", "trainer.bf16=off",
         "--set", "controller.reward_procs=0", "--set", "run.progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"cold start: 2 sft steps on generated replies, into {out / 'sft'}" in err
    steps = [orjson.loads(line) for line in (out / "sft" / "steps.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    record = orjson.loads((out / "sft" / "sft.json").read_bytes())
    assert record["base_model"] == "embedded:tiny-random" and "before" not in record  # the run's eval is it
    import tomllib

    ran = tomllib.loads((out / "settings.toml").read_text())
    assert ran["model"]["path"] == str((out / "sft" / "model").resolve()) and ran["sft"]["before_run"] == "off"
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["steps"] == 2 and (out / "model" / "config.json").exists()
    assert not Path(f"/dev/shm/areal_aio/sft-sft-{proc.pid}").exists()


def children(pid: int) -> list[int]:
    """The processes below `pid`, its children's too (Linux: /proc/<pid>/task/*/children): the
    zygote and the workers it forked."""
    try:
        found = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                 for c in (task / "children").read_text().split()]
    except FileNotFoundError:
        return []  # it ended meanwhile
    return found + [grandchild for child in found for grandchild in children(child)]


@pytest.mark.slow
def test_sigterm_during_the_cold_start_stops_cleanly(tmp_path):
    """SIGTERM while the run tunes: exit 143, the tuning's worker gone, its /dev/shm folder
    removed, no RL run started, and what the tuning learned kept: the step in flight ends,
    sft/model/ is written whole and sft.json says how far it got."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_aio", "run", str(ROOT / "settings.toml"), "--out", str(out),
         "--set", "model.path=embedded:tiny-random", "--set", "sft.before_run=on", "--set", "sft.steps=500",
         "--set", "sft.batch_size=4",
         "--set", "trainer.bf16=off", "--set", "run.progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    steps = out / "sft" / "steps.jsonl"
    deadline = time.time() + 120
    while not steps.exists() or not steps.read_text():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    workers = children(proc.pid)
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated; workers stopped" in err and "Traceback" not in err
    assert workers and not any(Path(f"/proc/{pid}").exists() and alive(pid) for pid in workers)
    assert not Path(f"/dev/shm/areal_aio/sft-sft-{proc.pid}").exists()
    assert not (out / "summary.json").exists()
    done = len(steps.read_text().splitlines())
    record = orjson.loads((out / "sft" / "sft.json").read_bytes())
    assert record["ended"] == "interrupted" and record["steps_done"] == done >= 1 and record["steps"] == 500
    assert f"sft stopped at step {done} of 500: the model so far is in {out / 'sft' / 'model'}" in err
    assert (out / "sft" / "model" / "config.json").exists() and (out / "sft" / "model" / "model.safetensors").exists()
    assert not (out / "sft" / ".model.tmp").exists()


def _reply(text: str, finish: str = "stop") -> wire.Completion:
    return wire.Completion("r", [1], [2], [0.0], [0], text, finish, 0, 0.1)


def test_kept_reply_adds_the_tag_to_a_passing_untagged_reply_only():
    from areal_aio.app.sft import kept_reply

    task = Task("t", "Calculate 5 - 9.", "-4")
    check = AnswerReward()
    plain, tagged, wrong = "5 - 9 = -4", "5 - 9 = -4\n<answer>-4</answer>", "5 - 9 = 4"
    assert kept_reply(task, _reply(plain), check(task, plain), tag=True) == tagged
    assert kept_reply(task, _reply(tagged), check(task, tagged), tag=True) == tagged  # strict: as it was
    assert kept_reply(task, _reply(plain), check(task, plain), tag=False) == plain  # another check: as written
    assert kept_reply(task, _reply(wrong), check(task, wrong), tag=True) is None
    assert kept_reply(task, _reply(plain, "length"), check(task, plain), tag=True) is None  # cut: never ended


def _sampling(monkeypatch, policy):
    from areal_aio.fleet.fakes import FakeRollout

    rollout = FakeRollout(policy=policy)
    monkeypatch.setattr("areal_aio.control.evaluation.eval_rollout", lambda settings, log: rollout)
    return rollout


async def test_sampled_pairs_keep_the_models_passing_replies_in_stream_order(tmp_path, monkeypatch):
    """The model answers sums right and subtractions wrong: only the sums are kept, each with
    its tag added, in the order of the training stream, held-out prompts left out."""
    from areal_aio.app.sft import sampled_pairs

    def policy(prompt: str, version: int) -> str:
        a, op, b = re.search(r"(\d+) ([-+]) (\d+)", prompt).groups()
        return f"{a} {op} {b} = {int(a) + int(b)}"  # right for +, wrong for - (unless b is 0)

    rollout = _sampling(monkeypatch, policy)
    settings = build_settings({"sft": {"data": "sampled", "temperature": 0.9}})
    stream = list(itertools.islice(training_tasks(settings, in_loop=False), 60))
    held_out = {stream[0].text}
    pairs, record = await sampled_pairs(settings, held_out, 6, tmp_path)
    passing = [t for t in stream[1:] if AnswerReward()(t, policy(t.text, 0)).passed][:6]
    assert [p.prompt for p in pairs] == [t.text for t in passing]
    assert [p.completion for p in pairs] == [f"{policy(t.text, 0)}\n<answer>{t.answer}</answer>" for t in passing]
    assert record["kept"] == record["tags_added"] == 6 and record["temperature"] == 0.9
    assert record["passed"] >= 6 and record["prompts"] >= stream.index(passing[-1])
    assert sum(what == "generate" for _, what, _ in rollout.log) == record["prompts"]  # once per prompt
    assert rollout.returncode == 0  # the worker was stopped


async def test_sampled_pairs_give_up_on_a_model_that_never_passes(tmp_path, monkeypatch):
    from areal_aio.app.sft import sampled_pairs

    rollout = _sampling(monkeypatch, lambda prompt, version: "no idea")
    with pytest.raises(ValueError, match=r"sft.data = sampled: 0 of the model's replies to \d+ training prompts passed"):
        await sampled_pairs(build_settings({"sft": {"data": "sampled"}}), set(), 4, tmp_path)
    assert rollout.returncode == 0


def test_sampled_data_is_refused_for_an_episode_task(tmp_path):
    with pytest.raises(PreflightError, match="sft.data = sampled: task 'calculator' plays episodes"):
        check(build_settings({"sft": {"data": "sampled"}}, ["task.name=calculator"]), tmp_path / "a", None)
