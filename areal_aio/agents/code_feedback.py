"""Code with execution feedback: an episode for the code tasks (tasks/code_tasks.py, or JSONL
rows with tests), task.episode = "areal_aio.agents.code_feedback:episode". It runs the code
reward's judge between replies; the Model it talks to is agents/model.py's.

The model writes the program; it is judged in the sandbox (rewards/code.py `judge`: each run
isolated there, the verdict computed outside it). While it fails and replies are left
(task.episode_turns), the episode adds a user turn saying why (the first failing test's
reason, never the expected values, which stay outside the sandbox and outside the chat) and
asks for the whole program again. The reward is the last program's verdict (1 or 0, strict
when fenced); a sandbox that cannot start is a counted failure, as the code reward's is.

The sandbox run blocks for up to its wall clock: it runs in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio

from areal_aio.agents.model import Model
from areal_aio.rewards.code import judge
from areal_aio.rewards.scoring import Score
from areal_aio.tasks.task import Task

FEEDBACK = ("The program failed the tests: {why}. Fix it and reply with the whole program in one "
            "```python block.")


async def episode(task: Task, model: Model) -> Score:
    """Write, run the tests, see why they failed, write again; the last program's verdict."""
    tests, entry_point = task.extra["tests"], task.extra.get("entry_point")
    prefix, wall_s = task.extra.get("prefix", ""), task.extra.get("timeout_s")
    text = await model.reply()
    while True:
        kw = {"wall_s": wall_s} if wall_s else {}
        passed, fenced, why = await asyncio.to_thread(judge, text, tests, entry_point, prefix, **kw)
        if passed is None:
            return Score(reward=0.0, passed=False, failed=True)
        if passed or not model.replies_left:
            return Score(reward=float(passed), passed=passed, strict=passed and fenced)
        model.add_turn("user", FEEDBACK.format(why=why or "wrong output"))
        text = await model.reply()
