"""The step-tagged reply format of process rewards (ProcessThinker, arXiv 2606.11209).

    Step 1: 7 + 5 = 12
    Step 2: 12 - 3 = 9
    <answer>9</answer>

A valid reply is steps labelled 1..K in order, each on its own line and not
empty, then one <answer></answer> tag holding the final answer, then nothing
but white space. `parse` never raises: a malformed reply comes back with the
reason it is invalid and whatever steps it did have, so a process reward can
still score its steps and a report can count why replies fail.

A step prefix (`StepReply.prefix(i)`) is the reply up to the start of what
follows step i: its line ends with a newline, so a continuation sampled from
prompt + prefix writes step i + 1 (or the answer) next.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

STEP_INSTRUCTION = ("Solve it step by step. Write each step on its own line as 'Step 1: ...', "
                    "'Step 2: ...' and so on, then give only the final answer inside <answer></answer> tags.")
LABEL = re.compile(r"^[ \t]*Step[ \t]+(\d+)[ \t]*:", re.MULTILINE | re.IGNORECASE)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class StepReply:
    """One parsed reply. `ends[i]` is the character offset where step i + 1's part of the
    reply ends (the next label or the answer tag): `text[:ends[i]]` is the prefix up to it."""

    text: str
    steps: tuple[str, ...]  # each step's text without its label, stripped
    ends: tuple[int, ...]
    answer: str | None  # inside the last answer tag, stripped; None without a tag
    problem: str  # "" for a valid reply, else why it is not

    @property
    def valid(self) -> bool:
        return not self.problem

    def prefix(self, i: int) -> str:
        """The reply through step i (1-based), ending in a newline."""
        if not 1 <= i <= len(self.steps):
            raise IndexError(f"step {i} of a reply with {len(self.steps)} steps")
        head = self.text[:self.ends[i - 1]].rstrip()
        return head + "\n"


def render(steps: Sequence[str], answer: str) -> str:
    """A valid reply from its steps and final answer (what cold-start fine-tuning learns)."""
    lines = [f"Step {i}: {step.strip()}" for i, step in enumerate(steps, start=1)]
    return "\n".join(lines + [f"<answer>{answer.strip()}</answer>"])


def parse(text: str) -> StepReply:
    labels = list(LABEL.finditer(text))
    tags = list(ANSWER.finditer(text))
    answer = tags[-1].group(1).strip() if tags else None
    first_tag = tags[0].start() if tags else len(text)
    # steps: the labels before the first answer tag, each running to the next label or the tag
    before = [m for m in labels if m.start() < first_tag]
    steps, ends, numbers = [], [], []
    for k, m in enumerate(before):
        end = before[k + 1].start() if k + 1 < len(before) else first_tag
        steps.append(text[m.end():end].strip())
        ends.append(end)
        numbers.append(int(m.group(1)))
    reply = StepReply(text, tuple(steps), tuple(ends), answer, "")
    return _with_problem(reply, _problem(text, before, numbers, steps, tags, labels))


def _with_problem(reply: StepReply, problem: str) -> StepReply:
    return StepReply(reply.text, reply.steps, reply.ends, reply.answer, problem)


def _problem(text: str, before: list, numbers: list[int], steps: list[str], tags: list,
             labels: list) -> str:
    if not before:
        return "no 'Step 1:' line before the answer" if labels else "no steps"
    if text[:before[0].start()].strip():
        return "text before Step 1"
    expected = list(range(1, len(numbers) + 1))
    if numbers != expected:
        return f"steps numbered {', '.join(map(str, numbers))}, expected {', '.join(map(str, expected))}"
    empty = [n for n, step in zip(numbers, steps, strict=True) if not step]
    if empty:
        return f"step {empty[0]} is empty"
    if not tags:
        return "no <answer> tag"
    if len(tags) > 1:
        return f"{len(tags)} answer tags"
    if not tags[0].group(1).strip():
        return "the answer tag is empty"
    if text[tags[0].end():].strip():
        return "text after the answer tag"
    return ""
