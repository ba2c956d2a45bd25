"""`python -m areal_aio eval MODEL`: preflight as `run` (one line, exit 2, nothing started), and
eval.json with its logs where the user said or under runs/, never in the current folder."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from areal_aio.app.cli import main
from areal_aio.control import evaluation
from tests.conftest import ROOT


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty current folder, no hub: what eval leaves in it is all there is to see."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    yield tmp_path
    gc.unfreeze()  # run_owned freezes what is alive (a CLI process ends there; this one goes on)


def a_run_folder_without_model(root: Path) -> Path:
    run = root / "runs" / "old"
    run.mkdir(parents=True)
    (run / "settings.toml").write_text('[run]\nmode = "sync"\n')
    (run / "steps.jsonl").write_text("")
    (run / "summary.json").write_text("{}")
    (run / "checkpoints").mkdir()
    return run


def a_model_folder(folder: Path, *, config: str = '{"model_type": "llama"}', weights: bool = True,
                   tokenizer: bool = True) -> Path:
    """An HF folder as preflight sees one (its files' names and config; nothing in it is loaded)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config)
    for name, wanted in (("model.safetensors", weights), ("tokenizer.json", tokenizer)):
        if wanted:
            (folder / name).write_text("{}")
    return folder


@pytest.mark.parametrize("model,needle", [
    ("notamodel", "MODEL: 'notamodel' has no config.json: not a Hugging Face model folder"),
    ("runs/old", "MODEL: runs/old is a run folder without model/"),
    ("embedded:nope", "MODEL: unknown embedded model 'embedded:nope'"),
    ("./no/such/folder", "MODEL: no such folder './no/such/folder'"),
    ("empty", "MODEL: 'empty/config.json' is not a JSON config"),
    ("typeless", "MODEL: 'typeless/config.json' names no model_type: not a Hugging Face model's config"),
    ("weightless", "MODEL: 'weightless' has no weights (none of model.safetensors, model.safetensors.index.json"),
    ("untokenized", "MODEL: 'untokenized' has no tokenizer (none of tokenizer.json, tokenizer.model"),
])
def test_an_unusable_model_is_one_line_and_exit_2_before_anything_starts(here, capsys, model, needle):
    (here / "notamodel").mkdir()
    a_run_folder_without_model(here)
    a_model_folder(here / "empty", config="")
    a_model_folder(here / "typeless", config="{}")  # the folder the rollout worker failed on, exit 1
    a_model_folder(here / "weightless", weights=False)
    a_model_folder(here / "untokenized", tokenizer=False)
    before = sorted(p.name for p in here.rglob("*"))
    t0 = time.perf_counter()
    assert main(["eval", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"settings error: {needle}") and err.count("\n") == 1, err
    assert time.perf_counter() - t0 < 5 and sorted(p.name for p in here.rglob("*")) == before


def test_sft_checks_the_model_the_same_way(here):
    for spec, needle in (("embedded:nope", "unknown embedded model"), ("notamodel", "has no config.json")):
        (here / "notamodel").mkdir(exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "areal_aio", "sft", str(ROOT / "settings.toml"),
                               "--set", f"model.path={spec}"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr


@pytest.fixture
def fake_eval(monkeypatch):
    """evaluate_model without workers: writes eval.json and a log beside it, as the real one does."""
    async def evaluate_model(settings, out_file):
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.with_name("eval-rollout.log").write_text("worker log\n")
        result = {"model": settings.model.path, "pass_rate": 0.5, "strict_rate": 0.25, "reward_mean": 0.5, "n": 4}
        out_file.write_bytes(orjson.dumps(result))
        return result

    monkeypatch.setattr(evaluation, "evaluate_model", evaluate_model)


def test_eval_of_a_model_writes_under_runs_and_says_where_last(here, capsys, fake_eval):
    assert main(["eval", "embedded:tiny-random"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    found = list(here.glob("runs/eval-*/eval.json"))
    assert len(found) == 1 and re.fullmatch(r"runs/eval-\d{8}-\d{6}-\d+", str(found[0].parent.relative_to(here)))
    assert last.startswith(f"wrote {found[0].relative_to(here)}")
    assert sorted(p.name for p in here.iterdir()) == ["runs"]  # nothing beside the user
    assert (found[0].parent / "eval-rollout.log").exists()


def test_out_is_a_file_or_a_folder_and_a_run_folder_keeps_its_own(here, capsys, fake_eval):
    assert main(["eval", "embedded:tiny-random", "--out", "scores/tiny.json"]) == 0
    assert (here / "scores" / "tiny.json").exists() and (here / "scores" / "eval-rollout.log").exists()
    assert main(["eval", "embedded:tiny-random", "--out", "results"]) == 0
    assert (here / "results" / "eval.json").exists() and (here / "results" / "eval-rollout.log").exists()
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"wrote {Path('results') / 'eval.json'}")
    run = a_run_folder_without_model(here)
    a_model_folder(run / "model")
    assert main(["eval", str(run)]) == 0
    assert (run / "eval.json").exists() and (run / "eval-rollout.log").exists()
    assert sorted(p.name for p in here.iterdir()) == ["results", "runs", "scores"]


def test_an_out_json_that_is_a_folder_is_refused_before_the_eval_runs(here, capsys, monkeypatch):
    async def evaluate_model(settings, out_file):
        raise AssertionError("the eval ran")

    monkeypatch.setattr(evaluation, "evaluate_model", evaluate_model)
    (here / "scores.json").mkdir()
    assert main(["eval", "embedded:tiny-random", "--out", "scores.json"]) == 2
    err = capsys.readouterr().err
    assert err == ("settings error: --out: 'scores.json' is a folder, not a file eval.json can be written as; "
                   "give a file, or 'scores.json/eval.json' to write into it\n")
    assert sorted(p.name for p in here.rglob("*")) == ["scores.json"]  # no error.log beside it


def test_an_eval_json_written_over_says_so_on_the_last_line(here, capsys, fake_eval):
    assert main(["eval", "embedded:tiny-random", "--out", "tiny.json"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("wrote tiny.json")
    assert main(["eval", "embedded:tiny-random", "--out", "tiny.json"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("overwrote tiny.json")


def test_an_out_folder_that_cannot_be_written_is_refused(here, capsys):
    Path("afile").write_text("x")
    assert main(["eval", "embedded:tiny-random", "--out", "afile/sub"]) == 2
    assert "--out: 'afile/sub' cannot be made: 'afile' is a file" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_of_an_hf_folder_leaves_nothing_in_the_current_folder(tmp_path):
    """The real workers on tiny-random: eval.json and the worker's log under runs/eval-*/."""
    from areal_aio.workers.models import TINY, load_model

    model = tmp_path.parent / f"{tmp_path.name}-model"  # an HF folder, away from the current one
    weights, tokenizer = load_model(TINY, seed=0)
    weights.save_pretrained(model)
    tokenizer.save_pretrained(model)
    done = subprocess.run([sys.executable, "-m", "areal_aio", "eval", str(model), str(ROOT / "settings.toml"),
                           "--set", "task.eval_size=2", "--set", "rollout.max_new_tokens=4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = next(tmp_path.glob("runs/eval-*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert {"eval.json", "eval-rollout.log"} <= {p.name for p in folder.iterdir()}
    assert done.stdout.splitlines()[-1].startswith(f"wrote {folder.relative_to(tmp_path) / 'eval.json'}")
    assert orjson.loads((folder / "eval.json").read_bytes())["n"] == 2


@pytest.mark.parametrize("failed", [4, 1])
def test_an_agent_eval_whose_episodes_failed_says_so_and_shows_no_score_for_none(here, capsys, monkeypatch, failed):
    async def evaluate_model(settings, out_file):
        out_file.parent.mkdir(parents=True, exist_ok=True)
        result = {"model": settings.model.path, "pass_rate": 0.0, "strict_rate": 0.0, "reward_mean": 0.0, "n": 4,
                  "episode": "areal_aio.agents.calculator_openai:episode", "episode_failures": failed}
        out_file.write_bytes(orjson.dumps(result))
        return result

    monkeypatch.setattr(evaluation, "evaluate_model", evaluate_model)
    code = main(["eval", "embedded:tiny-random", "--out", "e.json"])
    out = capsys.readouterr().out
    if failed == 4:
        assert code == 1 and out.splitlines()[-1].endswith("all 4 episodes failed (each scored 0; their turns are "
                                                           "in eval.json): no score")
        assert "pass 0.000" not in out  # no score where there is none
    else:
        assert code == 0 and "(4 held-out prompts; 1 of 4 episodes failed, scored 0)" in out


def test_sft_eval_lines_count_failed_episodes_and_show_no_score_for_none():
    from areal_aio.app.sft import eval_line

    rates = {"valid_rate": 0.0, "pass_rate": 0.0, "strict_rate": 0.0, "n": 8}
    assert eval_line("before", {**rates, "episode_failures": 8}).endswith("all 8 episodes failed (each scored 0; "
                                                                          "samples.jsonl has their turns): no score")
    assert "8 held-out prompts; 3 episodes failed, scored 0" in eval_line("after", {**rates, "episode_failures": 3})
    assert eval_line("after", rates).endswith("(8 held-out prompts)")
