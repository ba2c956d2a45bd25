"""README's commands and examples are real, and so are the examples of the docs pages (docs/),
wherever a block now lives: each is found by the HTML comment marker just before it."""

import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from areal_aio.settings import build_settings
from tests.conftest import ROOT as ROOT

README = (ROOT / "README.md").read_text()


def page(name: str) -> str:
    """A docs page's Markdown source."""
    return (ROOT / "docs" / name).read_text()


def block_after(marker: str, text: str = README) -> str:
    match = re.search(re.escape(marker) + r"\s*```[a-z]*\n(.*?)```", text, re.DOTALL)
    assert match, marker
    return match.group(1)


def run_example(folder, marker: str, text: str = README) -> subprocess.CompletedProcess:
    """The Python example after `marker` in `text`, run as a script in `folder` beside
    settings.toml; it must exit 0."""
    (folder / "example.py").write_text(block_after(marker, text))
    shutil.copy(ROOT / "settings.toml", folder / "settings.toml")
    done = subprocess.run([sys.executable, "example.py"], cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_readme_has_both_commands_and_ci_runs_the_test_one():
    assert "python -m areal_aio run settings.toml" in README
    test_cmd = block_after("<!-- test-command -->").strip()
    assert "pip install torch==2.13.0" in test_cmd  # both tiers, nothing left out:
    assert test_cmd.endswith('python -m pytest -q -n 2 -m "not slow" && python -m pytest -q -m slow')
    extracted = subprocess.run(
        ["awk", '/<!-- test-command -->/{found=1; next} found && /^```/{if (inblock) exit; inblock=1; next} inblock{print}',
         str(ROOT / "README.md")], capture_output=True, text=True, check=True).stdout.strip()
    assert extracted == test_cmd
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


def test_settings_example_is_valid():
    """README's settings example: every key real and every value allowed, as the file and as the
    --set line beside it."""
    example = tomllib.loads(block_after("<!-- settings-example -->"))
    from_file = build_settings(example)
    assert from_file.rollout.device == from_file.trainer.device == "cuda"
    line = re.search(r"`python -m areal_aio run settings.toml((?: --set \S+)+)`", README)
    assert line, "the --set line beside the settings example"
    overrides = line.group(1).split(" --set ")[1:]
    from_line = build_settings({}, overrides)
    for section in ("rollout", "trainer"):  # the example's [run] keys are its own, not the line's
        assert getattr(from_line, section) == getattr(from_file, section), section


def test_docs_embedding_page_has_the_readme_example():
    assert block_after("<!-- embed-example -->", page("embedding.md")) == block_after("<!-- embed-example -->")


@pytest.mark.slow
def test_embedding_example_runs(tmp_path):
    done = run_example(tmp_path, "<!-- embed-example -->")
    assert "step 3: reward" in done.stdout and "trained 3 steps" in done.stdout
    assert (tmp_path / "runs" / "embedded-demo" / "summary.json").exists()


@pytest.mark.slow
def test_episode_example_runs(tmp_path):
    """The multi-turn example: a calculator episode trained on tiny-random, its rows with turns."""
    import orjson

    done = run_example(tmp_path, "<!-- episode-example -->", page("episodes.md"))
    assert "trained 2 steps; 0 episodes failed" in done.stdout
    samples = [orjson.loads(x) for x in (tmp_path / "runs" / "episode-demo" / "samples.jsonl")
               .read_bytes().splitlines()]
    assert all(r["turns"] for r in samples if r["kind"] == "train")


def test_own_task_and_reward_example_passes_check(tmp_path):
    """The settings, rows and reward module of "Your own task and reward" (docs/tasks-and-rewards.md)
    are checked as a user would."""
    text = page("tasks-and-rewards.md")
    (tmp_path / "settings.toml").write_text(block_after("<!-- byo-settings -->", text))  # defaults elsewhere
    (tmp_path / "tasks.jsonl").write_text(block_after("<!-- byo-rows -->", text))
    (tmp_path / "my_rewards.py").write_text(block_after("<!-- byo-reward -->", text))
    done = subprocess.run([sys.executable, "-m", "areal_aio", "check", "settings.toml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert 'reward = ["answer", {fn = "my_rewards:brevity", weight = 0.2}]' in done.stdout
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "What is 3 + 4?", "answer": 7}\n')
    done = subprocess.run([sys.executable, "-m", "areal_aio", "check", "settings.toml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "'brevity' requires a 'max_words' argument" in done.stderr
