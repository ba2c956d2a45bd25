"""bench/group_spread.py: which training groups of a run carried a gradient, early and late."""

from __future__ import annotations

import json

import pytest

from bench import group_spread


def sample(step: int, group: int, reply: str, answer: str, prompt: str = "Calculate 4 - 7.") -> dict:
    passed = f"<answer>{answer}</answer>" in reply
    return {"kind": "train", "step": step, "group": group, "task_id": f"t{group}", "prompt": prompt,
            "answer": answer, "reply": reply, "reward": 1.2 if passed else 0.0, "pass": passed}


def write_run(folder, rows: list[dict], entropy: list[float]) -> None:
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"rollout_idle_frac": 0.01, "trainer_idle_frac": 0.25}, indent=2))
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tr')
    (folder / "steps.jsonl").write_text("".join(json.dumps({"step": i + 1, "entropy": e}) + "\n"
                                                for i, e in enumerate(entropy)))


def test_early_groups_spread_and_late_ones_collapse_onto_one_wrong_answer(tmp_path, capsys):
    right, wrong, other = "<answer>-3</answer>", "<answer>-1</answer>", "<answer>-2</answer>"
    rows = [sample(1, 0, right, "-3"), sample(1, 0, wrong, "-3"),  # step 1: one group with spread
            sample(1, 1, right, "-3"), sample(1, 1, right, "-3"),  # and one solved
            sample(2, 2, wrong, "-3"), sample(2, 2, other, "-3"),  # step 2: unsolved, two answers
            sample(3, 3, wrong, "-3"), sample(3, 3, wrong, "-3"), sample(3, 3, wrong, "-3"),  # collapsed
            sample(4, 4, right, "-3"), sample(4, 4, right, "-3"),  # solved
            sample(4, 5, wrong, "-3"), sample(4, 5, wrong, "-3"), sample(4, 5, other, "-3"),  # one spare
            sample(4, 6, "I cannot say.", "-3"), sample(4, 6, "No idea.", "-3"),  # answerless replies
            sample(4, 6, other, "-3"),  # give no answer: one in three is not collapsed
            {"kind": "train", "step": None, "group": 9, "reward": None, "pass": None, "reply": None},  # dropped
            {"kind": "eval", "step": 4, "group": None, "reward": 0.0, "pass": False, "reply": wrong}]
    write_run(tmp_path / "run", rows, [0.9, 0.5, 0.1, 0.05])
    assert group_spread.main([str(tmp_path / "run"), "--first", "2", "--last", "2"]) == 0
    assert "spread" in capsys.readouterr().out
    rec = json.loads((tmp_path / "run" / "group_spread.json").read_text())
    assert rec["provenance"]["command"].startswith("python bench/group_spread.py ")
    (run,) = rec["runs"]
    first, last = run["first"], run["last"]
    assert run["steps"] == 4 and first["steps"] == [1, 2] and last["steps"] == [3, 4]
    assert first["groups"] == 3 and first["spread_frac"] == pytest.approx(1 / 3)
    assert first["solved_frac"] == pytest.approx(1 / 3) and first["unsolved_frac"] == pytest.approx(1 / 3)
    assert first["unsolved_collapsed"] == 0  # two replies, two answers: too few to say
    assert first["entropy_mean"] == pytest.approx(0.7)
    assert last["groups"] == 4 and last["spread_frac"] == 0.0 and last["unsolved_frac"] == pytest.approx(3 / 4)
    assert last["unsolved_collapsed"] == 2 and last["entropy_mean"] == pytest.approx(0.075)
    assert run["unsolved_last"] == [
        {"prompt": "Calculate 4 - 7.", "answer": "-3", "most_common_reply_answer": "-1", "groups": 2,
         "replies_with_it": 5, "replies": 6},
        {"prompt": "Calculate 4 - 7.", "answer": "-3", "most_common_reply_answer": "-2", "groups": 1,
         "replies_with_it": 1, "replies": 3}]
    assert (run["rollout_idle_frac"], run["trainer_idle_frac"]) == (0.01, 0.25)


def test_a_folder_without_samples_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        group_spread.main([str(tmp_path)])
    assert stop.value.code == 2 and "no samples.jsonl" in capsys.readouterr().err
