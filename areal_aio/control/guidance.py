"""Guided groups (task.guide): replies a group gets besides the ones its policy sampled.

A group-relative advantage learns only from a group whose rewards differ, and only toward
replies some member wrote. Two cases starve it, and a guide writes the missing member:

  tag        the policy answers correctly but never inside the answer tag (SmolLM2-135M-Instruct
             on the default task: strict 0 in every group), so the format bonus is never paid
             and no advantage points at the tag; or it tags and then writes on, which the bonus
             does not pay either. To a group with a correct reply and none in the strict form
             (tagged, the tag ending it), the guide adds one: that reply with the tagged answer
             after it, or cut after its tag.
  reference  every member fails (a confident wrong answer in all of them), so the group has no
             spread and no member points at the right answer. The guide adds the task's
             reference reply (LUFFY's off-policy guidance, Yan et al. 2025).

A guided member is scored by the run's own reward, trained in its group (it counts in the
group's mean and std) and recorded in samples.jsonl with `guided`. Its tokens were written, not
sampled, so the trainer takes their behaviour log-probs to be its own pi_prox (importance
weight 1: wire.TrainSample.written). It takes no admission slot and is left out of the step's
rates (pass_rate, spread_frac, ...), which stay the policy's own; steps.jsonl counts it as
`guided`. Once the policy tags by itself (or solves what it failed), the guide writes nothing:
it stops on its own.

A guide of one's own: "package.module:function", called as fn(task, replies, passed) with the
group's sampled reply texts and whether each passed; it returns the texts to add (a list, empty
for none). It runs on the event loop: keep it quick and pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from areal_aio.rewards.scoring import ends_with_tag, final_answer, import_reward
from areal_aio.settings import CODE_TASKS, Settings, SettingsError
from areal_aio.tasks.task import Task

KEY = "task.guide"
BUILT_IN = ("off", "tag", "reference", "both")

Guide = Callable[[Task, Sequence[str], Sequence[bool]], list[str]]


def tag_guide(task: Task, replies: Sequence[str], passed: Sequence[bool]) -> list[str]:
    """Where no correct reply of the group is in the strict form (tagged, the tag ending it: the
    one the format bonus pays), its first correct reply put in that form: the tagged answer
    after it where it has no tag, or cut after its last tag where it went on writing. One member
    a group is enough: the form is what it teaches."""
    correct = [text for text, ok in zip(replies, passed, strict=True) if ok]
    if not correct or any(final_answer(text)[1] and ends_with_tag(text) for text in correct):
        return []
    text = correct[0]
    if final_answer(text)[1]:
        return [text[:text.lower().rfind("</answer>") + len("</answer>")]]
    return [f"{text.rstrip()}\n<answer>{task.answer}</answer>"]


def reference_guide(reference: Callable[[Task], str | None]) -> Guide:
    """The task's reference reply (`reference(task)`; None: it has none) where every member failed."""
    def guide(task: Task, replies: Sequence[str], passed: Sequence[bool]) -> list[str]:
        if any(passed):
            return []
        text = reference(task)
        return [text] if text else []
    return guide


def both(*guides: Guide) -> Guide:
    def guide(task: Task, replies: Sequence[str], passed: Sequence[bool]) -> list[str]:
        return [text for g in guides for text in g(task, replies, passed)]
    return guide


def reference_of(settings: Settings) -> Callable[[Task], str | None] | None:
    """How the task's reference reply is written (as `sft.data = generated` writes it), or None
    where the task has none: arithmetic's worked sum and tagged answer, a code task's reference
    solution in the fence its prompt asks for."""
    name = settings.task.name
    if name == "arithmetic" and not settings.task.path:
        from areal_aio.tasks.arithmetic import worked_reply

        return worked_reply
    if name in CODE_TASKS and name != "humaneval":
        return lambda task: f"```python\n{task.answer.strip()}\n```" if task.answer else None
    return None


def load_guide(settings: Settings) -> Guide | None:
    """task.guide as a function, or None for off; SettingsError (naming task.guide) for a guide
    the run cannot use: an episode run or process.mode (one reply per sample, scored by the
    answer), `reference` for a task without reference replies, a function that cannot be had."""
    spec = settings.task.guide
    if spec == "off":
        return None
    if settings.task.episode or settings.task.name == "calculator":
        raise SettingsError(f"{KEY}: {spec!r} guides one-reply groups; this run plays episodes (task.episode)")
    if settings.process.mode != "off":
        raise SettingsError(f"{KEY}: {spec!r} cannot be combined with process.mode = {settings.process.mode!r}")
    if spec not in BUILT_IN:
        return import_reward(spec, key=KEY)
    if spec == "tag":
        return tag_guide
    reference = reference_of(settings)
    if reference is None:
        raise SettingsError(f"{KEY}: {spec!r} needs the task's reference replies; task.name = "
                            f"{settings.task.name!r} has none (arithmetic and the generated code tasks have)")
    guide = reference_guide(reference)
    return guide if spec == "reference" else both(tag_guide, guide)


def texts(guide: Guide, task: Task, replies: Sequence[str], passed: Sequence[bool]) -> list[str]:
    """What `guide` adds to a group, checked: a list of non-empty strings (a TypeError naming
    task.guide otherwise)."""
    added = guide(task, replies, passed)
    if not isinstance(added, list) or not all(isinstance(t, str) for t in added):
        raise TypeError(f"{KEY}: the guide returned {type(added).__name__}, not a list of reply texts")
    return [t for t in added if t.strip()]
