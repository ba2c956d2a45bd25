"""A judge model as the reward (areal_aio/rewards/judge.py): verdicts parsed, the rubric filled,
calls bounded, an OpenAI-compatible server asked over HTTP (a stand-in server here), failures
scored 0 and counted; and in a run against the fake workers, the loop going on while the judge
is slow."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest

from areal_aio.rewards.judge import Judge, JudgeUnbound, http_complete, parse, rubric
from areal_aio.rewards.scoring import Scorer, load_rewards
from areal_aio.settings import JudgeSettings, SettingsError
from areal_aio.tasks.task import Task
from tests.conftest import make_settings, orchestrator

TASK = Task(id="t1", prompt="Calculate 2 + 3.", answer="5")


@pytest.mark.parametrize(("verdict", "kind", "value"), [
    ("PASS", "choice", 1.0), ("  yes, it is right", "choice", 1.0), ("Correct.", "choice", 1.0),
    ("FAIL: wrong sum", "choice", 0.0), ("no", "choice", 0.0), ("Incorrect", "choice", 0.0),
    ("maybe", "choice", None), ("", "choice", None), ("42", "choice", None),
    ("Score: 7/10", "score", 0.7), ("10", "score", 1.0), ("0", "score", 0.0), ("3.5", "score", 0.35),
    ("11", "score", None), ("-1", "score", None), ("great", "score", None),
])
def test_a_verdict_is_parsed_or_says_it_is_not(verdict, kind, value):
    assert parse(verdict, kind, 10.0) == value


def test_the_rubric_fills_prompt_reply_and_answer_and_keeps_other_braces():
    text = rubric("Q: {prompt} R: {reply} A: {answer} {other} {{x}}", TASK, "It is {5}")
    assert text == "Q: Calculate 2 + 3. R: It is {5} A: 5 {other} {{x}}"
    assert rubric("{answer}|", Task(id="x", prompt="p", answer=None), "r") == "|"


async def test_a_judge_scores_its_verdict_and_counts_one_that_does_not_parse():
    verdicts = iter(["PASS", "FAIL", "hmm"])
    seen, kept = [], []

    async def complete(messages, max_tokens):
        seen.append((messages, max_tokens))
        return next(verdicts)

    judge = Judge(JudgeSettings(model="local"))
    judge.bind(complete, kept.append)
    scorer = Scorer(judge, timeout_s=5.0, procs=0)
    scores = [await scorer.score(TASK, reply) for reply in ("5", "6", "7")]
    assert [(s.reward, s.passed, s.failed) for s in scores] == [(1.0, True, False), (0.0, False, False),
                                                                (0.0, False, True)]
    assert scorer.failures == 0 and judge.unparsed == 1 and judge.calls == 3  # the judge's own count
    assert kept == [{"task_id": "t1", "reply": "7", "verdict": "hmm"}]
    messages, max_tokens = seen[0]
    assert max_tokens == 16 and messages[0]["role"] == "user" and "Reply: 5" in messages[0]["content"]


async def test_a_judge_keeps_at_most_max_concurrent_calls_in_flight():
    running = peak = 0

    async def complete(messages, max_tokens):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return "PASS"

    judge = Judge(JudgeSettings(model="local", max_concurrent=3))
    judge.bind(complete)
    scores = await asyncio.gather(*(judge(TASK, str(i)) for i in range(12)))
    assert peak == 3 and all(s.passed for s in scores)


async def test_a_local_judge_the_run_did_not_serve_is_a_counted_failure():
    judge = Judge(JudgeSettings(model="local"))
    with pytest.raises(JudgeUnbound, match="judge.model: a local judge is served inside `run` only"):
        await judge(TASK, "5")
    scorer = Scorer(judge, timeout_s=5.0, procs=0)
    assert (await scorer.score(TASK, "5")).failed and scorer.failures == 1


def test_judge_needs_a_url_or_a_model():
    settings = make_settings(**{"task.reward": "judge"})
    with pytest.raises(SettingsError, match="task.reward: \"judge\" needs judge.url"):
        load_rewards(settings.task, settings.judge)
    assert isinstance(load_rewards(settings.task, JudgeSettings(url="http://127.0.0.1:9/v1")).fn, Judge)


# ---------------------------------------------------------------- over HTTP, a stand-in server


class Server:
    """An OpenAI-compatible stand-in on a free port: /v1/chat/completions answers `verdict`
    (after `delay_s`), by Content-Length or chunked; every request body is kept."""

    def __init__(self, verdict: str = "PASS", delay_s: float = 0.0, chunked: bool = False, status: int = 200):
        self.verdict, self.delay_s, self.chunked, self.status = verdict, delay_s, chunked, status
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.running = self.peak = 0  # requests being answered at once

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await reader.readexactly(int(fields.get("content-length", 0)))
        if body:
            self.bodies.append(orjson.loads(body))
        self.headers.append(fields)
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        reply = orjson.dumps({"choices": [{"message": {"role": "assistant", "content": self.verdict}}]})
        if self.chunked:
            payload = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (reply[:7], reply[7:])) + b"0\r\n\r\n"
            writer.write(b"HTTP/1.1 %d X\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (self.status, payload))
        else:
            writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (self.status, len(reply), reply))
        await writer.drain()
        writer.close()

    @contextlib.asynccontextmanager
    async def serving(self):
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        finally:
            server.close()
            await server.wait_closed()


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_url_judge_asks_chat_completions_greedily_with_its_key(monkeypatch, chunked):
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    server = Server("FAIL", chunked=chunked)
    async with server.serving() as url:
        judge = Judge(JudgeSettings(url=url, model="grader", key_env="JUDGE_KEY", max_tokens=4))
        score = await judge(TASK, "6")
    assert score.reward == 0.0 and not score.failed
    [body] = server.bodies
    assert body["model"] == "grader" and body["max_tokens"] == 4 and body["temperature"] == 0.0
    assert "Reply: 6" in body["messages"][0]["content"]
    assert server.headers[0]["authorization"] == "Bearer sekrit"


async def test_a_url_judge_that_answers_an_error_status_is_a_counted_failure():
    async with Server(status=500).serving() as url:
        with pytest.raises(RuntimeError, match="judge.url answered HTTP 500"):
            await http_complete(url, "")([{"role": "user", "content": "x"}], 4)
        scorer = Scorer(Judge(JudgeSettings(url=url)), timeout_s=5.0, procs=0)
        assert (await scorer.score(TASK, "5")).failed and scorer.failures == 1


def test_a_judge_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="judge.url: 'ftp://x' is not an http"):
        http_complete("ftp://x", "")


async def test_a_slow_judge_delays_its_own_groups_never_the_loop(tmp_path):
    """A judge taking 50 ms a verdict, 2 in flight at most: the run still makes its steps, every
    trained reward is the judge's, and an unparsed verdict counts as a reward failure."""
    server = Server("PASS", delay_s=0.05)
    async with server.serving() as url:
        settings = make_settings("areal", **{"task.reward": "judge", "judge.url": url, "judge.max_concurrent": 2,
                                             "run.max_steps": 4})
        summary = await orchestrator(tmp_path, settings).run()
    assert summary["steps"] == 4 and summary["reward_failures"] == 0
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    assert all(r["reward"] == 1.0 for r in rows if r["kind"] == "train" and r["step"] is not None)
    assert len(server.bodies) >= summary["samples_generated"]
    assert server.peak == 2  # the verdicts overlapped each other, at most judge.max_concurrent at once
    bad = Server("perhaps")
    async with bad.serving() as url:
        settings = make_settings("sync", **{"task.reward": "judge", "judge.url": url, "run.max_steps": 2})
        summary = await orchestrator(tmp_path / "bad", settings).run()
    assert summary["reward_failures"] >= summary["samples_generated"] > 0
    events = [orjson.loads(x) for x in (tmp_path / "bad" / "run" / "events.jsonl").read_bytes().splitlines()]
    unparsed = [e for e in events if e["event"] == "judge_unparsed"]
    held_out = {f"t{i}" for i in range(100, 104)}  # the eval's verdicts are kept too, not counted as rewards
    assert len([e for e in unparsed if e["task_id"] not in held_out]) == summary["reward_failures"]
    assert all(e["verdict"] == "perhaps" for e in unparsed) and len(unparsed) > summary["reward_failures"]


async def test_judge_calls_are_in_flight_together_up_to_the_bound():
    server = Server("PASS", delay_s=0.05)
    async with server.serving() as url:
        judge = Judge(JudgeSettings(url=url, max_concurrent=5))
        scores = await asyncio.gather(*(judge(TASK, str(i)) for i in range(12)))
    assert all(s.passed for s in scores) and server.peak == 5
