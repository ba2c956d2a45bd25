import os
import subprocess
import sys
import tomllib

import pytest

from areal_aio import settings as settings_module
from areal_aio.settings import (
    Settings,
    SettingsError,
    build_settings,
    load_settings,
    resolved_settings,
)
from tests.conftest import ROOT as ROOT


def test_default_file_loads_and_matches_dataclass_defaults():
    s = load_settings(ROOT / "settings.toml")
    assert s.run.mode == "areal" and s.eta == 4 and s.rollout.interrupt and s.trainer.objective == "decoupled_ppo"
    assert s.model.path == "embedded:smollm2-135m-instruct"
    # every key of the dataclasses is in the default file (and documented there)
    raw = tomllib.loads((ROOT / "settings.toml").read_text())
    defaults = build_settings({}, []).to_dict()
    for section, values in Settings().to_dict().items():
        assert set(raw[section]) == set(values), section
        # and gives each its default: `keys` and the file say the same
        differ = {k: (v, defaults[section][k]) for k, v in raw[section].items() if v != defaults[section][k]}
        assert not differ, f"[{section}] file value, default: {differ}"


def test_every_key_of_the_file_has_a_comment():
    for line in (ROOT / "settings.toml").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, line


@pytest.mark.parametrize("mode,eta,interrupt", [("sync", 0, False), ("one_step", 1, False), ("areal", 4, True)])
def test_mode_presets(mode, eta, interrupt):
    s = build_settings({"run": {"mode": mode}, "trainer": {"objective": "ppo"}})
    assert s.eta == eta and s.rollout.interrupt is interrupt
    assert s.trainer.objective == ("decoupled_ppo" if mode == "areal" else "ppo")


@pytest.fixture
def six_cores(monkeypatch):
    """A machine whose affinity mask holds 6 cores (so a preset differs from any default)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)


def test_sync_on_a_cpu_gives_each_worker_every_core(six_cores):
    file = load_settings(ROOT / "settings.toml", ["run.mode=sync"])  # the file says 1 each
    assert file.rollout.threads == file.trainer.threads == 6
    for mode in ("one_step", "areal"):  # workers at once: the file's one core each
        s = load_settings(ROOT / "settings.toml", [f"run.mode={mode}"])
        assert s.rollout.threads == s.trainer.threads == 1
    gpu = build_settings({"run": {"mode": "sync"}, "rollout": {"device": "cuda", "threads": 2}})
    assert gpu.rollout.threads == 2 and gpu.trainer.threads == 6  # only a worker on the CPU
    both = build_settings({"run": {"mode": "sync"}}, ["trainer.device=cuda:1"])
    assert both.rollout.threads == 6 and both.trainer.threads == 1


def test_set_threads_wins_over_the_sync_preset(six_cores):
    s = load_settings(ROOT / "settings.toml", ["run.mode=sync", "trainer.threads=3"])
    assert s.rollout.threads == 6 and s.trainer.threads == 3
    # a resolved tree (a checkpoint's) keeps its threads: presets do not apply again
    assert resolved_settings(s.to_dict()).trainer.threads == 3
    assert resolved_settings(s.to_dict(), ["rollout.threads=1"]).rollout.threads == 1


def test_set_wins_over_mode_preset():
    s = build_settings({"run": {"mode": "areal"}}, ["trainer.objective=ppo", "rollout.interrupt=false"])
    assert s.trainer.objective == "ppo" and s.rollout.interrupt is False


def test_overrides_parse_toml_values_and_bare_strings():
    s = build_settings({}, ["trainer.lr=3e-5", "run.max_steps=7", "task.operators=['+']",
                            "model.path=some/folder", "controller.max_staleness=-1"])
    assert s.trainer.lr == 3e-5 and s.run.max_steps == 7 and s.task.operators == ["+"]
    assert s.model.path == "some/folder" and s.eta == float("inf")


def test_int_accepted_for_float_field():
    assert build_settings({"trainer": {"lr": 1}}).trainer.lr == 1.0


@pytest.mark.parametrize("raw,sets,needle", [
    ({"trainer": {"lrr": 1e-5}}, [], "'trainer.lrr'; did you mean 'trainer.lr'"),
    ({"trainr": {}}, [], "'trainr'; did you mean 'trainer'"),
    ({}, ["rollout.group_sise=4"], "did you mean 'rollout.group_size'"),
    ({}, ["run.mode=fast"], "run.mode: 'fast' not allowed; choose one of sync, one_step, areal"),
    ({}, ["trainer.objective=grpo"], "trainer.objective: 'grpo' not allowed"),
    ({"run": {"max_steps": "ten"}}, [], "run.max_steps: expected an integer"),
    ({"run": {"max_steps": 1.5}}, [], "run.max_steps: expected an integer"),
    ({"rollout": {"interrupt": "yes"}}, [], "rollout.interrupt: expected true or false"),
    ({"rollout": {"temperature": 0}}, [], "rollout.temperature: 0.0 out of range; allowed (> 0)"),
    ({"run": {"threshold": 1.5}}, [], "run.threshold: 1.5 out of range"),
    ({"controller": {"max_staleness": -2}}, [], "controller.max_staleness: -2 out of range"),
    ({"trainer": {"batch_size": 30}}, [], "trainer.batch_size (30) must be a multiple of rollout.group_size (8)"),
    ({"rollout": {"device": "gpu"}}, [], "rollout.device: 'gpu' not allowed"),
    ({"task": {"operators": ["^"]}}, [], "task.operators"),
    ({"task": {"operators": ["+", "*"], "terms": 3}}, [], "task.operators: * give wrong reference answers"),
    ({"task": {"operators": ["/"]}}, [], "task.operators: / give wrong reference answers in task.name = 'arithmetic'"),
    ({"task": {"name": "calculator", "operators": ["+", "/"]}}, [], "/ give wrong reference answers in task.name = 'calc"),
    ({"task": {"name": "jsonl"}}, [], "task.path: required"),
    ({"run": "x"}, [], "run: must be a table"),
    ({}, ["run.mode"], "expected section.key=value"),
    ({"run": {"mode": "sync"}}, ["rollout.kv_on_update=keep"], "rollout.kv_on_update: keep changes what an interrupt"),
    ({"run": {"mode": "one_step"}}, ["rollout.kv_on_update=keep"], "rollout.interrupt is off"),
    ({}, ["rollout.kv_on_update=reuse"], "rollout.kv_on_update: 'reuse' not allowed"),
])
def test_bad_input_names_the_key(raw, sets, needle):
    with pytest.raises(SettingsError) as info:
        build_settings(raw, sets)
    assert needle in str(info.value)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nmode=1")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(bad)
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "missing.toml")


def test_resolved_toml_round_trips():
    s = build_settings({"run": {"mode": "sync"}}, ["trainer.lr=2e-6", "model.system_prompt=say \"hi\""])
    again = build_settings(tomllib.loads(s.to_toml()))
    assert again == s


def test_check_cli_prints_resolved_settings_and_fails_on_bad_key():
    ok = subprocess.run([sys.executable, "-m", "areal_aio", "check", str(ROOT / "settings.toml"),
                         "--set", "run.mode=sync"], capture_output=True, text=True)
    assert ok.returncode == 0 and 'mode = "sync"' in ok.stdout and "interrupt = false" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "areal_aio", "check", str(ROOT / "settings.toml"),
                          "--set", "rollout.temprature=1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "rollout.temperature" in bad.stderr


def test_on_off_keys_take_booleans_and_reject_other_text():
    assert build_settings({"trainer": {"bf16": True}}).trainer.bf16 == "on"
    assert build_settings({}, ["trainer.bf16=false", "trainer.share_prompts=true"]).trainer.bf16 == "off"
    assert build_settings({}).trainer.bf16 == "auto"
    with pytest.raises(SettingsError, match="trainer.bf16"):
        build_settings({}, ["trainer.bf16=maybe"])
    with pytest.raises(SettingsError, match="rollout.interrupt"):  # a real bool key stays strict
        build_settings({}, ["rollout.interrupt=on"])


@pytest.mark.parametrize("raw,sets,needle", [
    ({"trainer": {"learning_rate": 1e-5}}, [], "'trainer.learning_rate'; did you mean 'trainer.lr' (TRL's learning_rate)?"),
    ({}, ["trainer.num_generations=4"], "did you mean 'rollout.group_size' (TRL's num_generations)?"),
    ({}, ["trainer.beta=0.04"], "did you mean 'trainer.kl_coef' (TRL's beta)?"),
    ({"rollout": {"max_completion_length": 32}}, [], "did you mean 'rollout.max_new_tokens' (TRL's max_completion_length)?"),
    ({}, ["trainer.per_device_train_batch_size=8"], "did you mean 'trainer.batch_size' (TRL's per_device_train_batch_size)?"),
    ({"trainer": {"temperature": 1.0}}, [], "did you mean 'rollout.temperature' (TRL's temperature)?"),
    ({"trainer": {"epsilon": 0.2}}, [], "did you mean 'trainer.clip_eps' (TRL's epsilon)?"),
    ({"learning_rate": 1e-5}, [], "unknown settings section 'learning_rate'; did you mean 'trainer.lr' (TRL's learning_rate)?"),
    ({}, ["num_generations=4"], "did you mean 'rollout.group_size' (TRL's num_generations)?"),
    ({"run": {"lr": 1e-5}}, [], "unknown settings key 'run.lr'; did you mean 'trainer.lr' or 'sft.lr'?"),
])
def test_trl_names_and_keys_of_another_section_get_hints(raw, sets, needle):
    with pytest.raises(SettingsError) as info:
        build_settings(raw, sets)
    assert needle in str(info.value)


@pytest.mark.parametrize("reward,needle", [
    ("mypkg.rewards.exact", "'mypkg.rewards.exact' is not package.module:function nor a built-in reward "
                            "(answer, judge); did you mean 'mypkg.rewards:exact'?"),
    ("exact", "'exact' is not package.module:function nor a built-in reward"),
    ("", "task.reward: expected \"package.module:function\""),
    ([], "task.reward: expected \"package.module:function\""),
    (3, "task.reward: expected \"package.module:function\""),
    ([3], "task.reward: 3 is not package.module:function nor a built-in reward"),
    (["a.b:score", "c:score"], "two rewards are named 'score'; give one a name"),
    ([{"fn": "a:b", "weight": "high"}], "the weight of 'a:b' must be a finite number, got 'high'"),
    ([{"fn": "a:b", "weight": float("inf")}], "the weight of 'a:b' must be a finite number"),
    ([{"fn": "a:b", "wieght": 2}], "unknown key 'wieght'"),
    ([{"weight": 2}], "is not a reward"),
    ([{"fn": "a:b", "name": ""}], "the name of 'a:b' must be a non-empty string"),
])
def test_bad_reward_settings_name_the_key(reward, needle):
    with pytest.raises(SettingsError) as info:
        build_settings({"task": {"reward": reward}})
    assert needle in str(info.value)


@pytest.mark.parametrize("old", sorted(settings_module.MOVED))
def test_an_old_built_in_name_is_refused_naming_the_new_one(old):
    """The built-in episodes moved to areal_aio.agents: an old name in task.episode (or where a
    reward or an episode is imported) is one line naming the new one, and the new one loads."""
    new = settings_module.MOVED[old]
    with pytest.raises(SettingsError) as info:
        build_settings({"task": {"episode": old}})
    assert str(info.value) == f"task.episode: {old!r} has moved; name {new!r}"
    with pytest.raises(SettingsError, match="has moved"):
        build_settings({"task": {"reward": ["answer", {"fn": old, "weight": 0.0}]}})
    from areal_aio.rewards.scoring import import_reward

    with pytest.raises(SettingsError, match=f"has moved; name {new!r}"):
        import_reward(old, key="task.episode")
    if "smolagents" not in new:  # an optional extra
        assert callable(import_reward(new, key="task.episode"))
    assert build_settings({"task": {"episode": new}}).task.episode == new


def test_reward_forms_round_trip_through_the_resolved_file():
    from areal_aio.settings import resolved_settings, reward_parts

    assert build_settings({}).task.reward == "answer"
    for reward in ("mypkg.rewards:exact", ["answer", "mypkg.rewards:Judge.score"],
                   ["answer", {"fn": "mypkg.rewards:exact", "weight": 0.5, "name": "short"}]):
        s = build_settings({"task": {"reward": reward}})
        assert build_settings(tomllib.loads(s.to_toml())) == s == resolved_settings(s.to_dict())
    assert reward_parts("task.reward", ["answer", "mypkg.rewards:Judge.score", {"fn": "m:f", "weight": 2}]) == [
        ("answer", "answer", 1.0), ("score", "mypkg.rewards:Judge.score", 1.0), ("f", "m:f", 2.0)]
    s = build_settings({}, ['task.reward=[{fn = "m:f", weight = -0.1}]'])  # a penalty is a negative weight
    assert s.task.reward == [{"fn": "m:f", "weight": -0.1}]


@pytest.mark.parametrize("name,package", [("parquet", "pyarrow"), ("datasets", "datasets")])
def test_a_task_format_whose_package_is_missing_is_one_line(monkeypatch, name, package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a))
    with pytest.raises(SettingsError) as info:
        build_settings({"task": {"name": name, "path": "tasks"}})
    assert str(info.value) == f"task.name: '{name}' needs the {package} package: pip install 'areal_aio[data]'"
    with pytest.raises(SettingsError, match=f"task.path: required when task.name = '{name}'"):
        build_settings({"task": {"name": name}})


def test_ray_workers_need_the_ray_extra_and_a_node_of_the_cluster(monkeypatch):
    import importlib.util

    assert build_settings({}).ray.address == ""  # local subprocesses unless asked
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ray" else real(n, *a))
    with pytest.raises(SettingsError) as info:
        build_settings({"ray": {"address": "local"}})
    assert str(info.value) == ("ray.address: workers as Ray actors need the ray package: "
                               "pip install 'areal_aio[ray]'")
    monkeypatch.undo()
    if importlib.util.find_spec("ray") is not None:
        with pytest.raises(SettingsError, match="ray:// .* not supported"):
            build_settings({"ray": {"address": "ray://head:10001"}})


def test_devices_take_a_list_or_a_count_of_cpu_workers() -> None:
    s = load_settings(None, ["rollout.devices=3", 'trainer.devices=["cuda:0", "cuda:1"]'])
    assert s.rollout_devices == ["cpu"] * 3 and s.trainer_devices == ["cuda:0", "cuda:1"]
    assert load_settings(None).rollout_devices == ["cpu"] and load_settings(None).trainer_devices == ["cpu"]
    assert load_settings(None, ['rollout.devices=["cuda:0", "cuda:0"]']).rollout_devices == ["cuda:0"] * 2
    for bad, message in (("rollout.devices=0", "must be >= 1"), ('rollout.devices=["gpu"]', "'gpu' not allowed"),
                         ('trainer.devices="cpu"', "a list of devices or a count"),
                         ('trainer.devices=["cuda:0", "cpu"]', "mixes cpu and cuda"),
                         ('trainer.devices=["cuda", "cuda:0"]', "names a GPU twice")):
        with pytest.raises(SettingsError, match=message):
            load_settings(None, [bad])


def test_sync_shares_the_cores_among_the_workers_of_a_role(monkeypatch) -> None:
    monkeypatch.setattr(settings_module, "cpu_cores", lambda: 8)
    s = load_settings(None, ["run.mode=sync", "rollout.devices=4", "trainer.devices=3"])
    assert (s.rollout.threads, s.trainer.threads) == (2, 2)  # 8 // 4, 8 // 3
    s = load_settings(None, ["run.mode=sync", 'trainer.devices=["cuda:0", "cuda:1"]'])
    assert (s.rollout.threads, s.trainer.threads) == (8, 1)  # GPU ranks: no preset
    assert load_settings(None, ["run.mode=sync", "rollout.devices=16"]).rollout.threads == 1


def test_lora_is_off_by_default_and_its_keys_are_checked() -> None:
    s = build_settings({})
    assert s.lora.rank == 0 and s.lora.targets == "all-linear" and s.lora.merge
    on = build_settings({"lora": {"rank": 8, "alpha": 32, "targets": ["q_proj", "mlp.down_proj"]}})
    assert on.lora.alpha == 32.0 and on.lora.targets == ["q_proj", "mlp.down_proj"]
    assert resolved_settings(on.to_dict()) == on and build_settings(tomllib.loads(on.to_toml())) == on
    for sets, needle in [(["lora.rank=-1"], "lora.rank: -1 out of range"),
                         (["lora.alpha=0"], "lora.alpha: 0.0 out of range"),
                         (["lora.dropout=1.0"], "lora.dropout: 1.0 out of range"),
                         (["lora.targets=q_proj"], 'lora.targets: expected "all-linear" or a list'),
                         (["lora.targets=[]"], "non-empty list"),
                         (["lora.targets=['q proj']"], "'q proj' is not a module name"),
                         (["lora.targets=['q_proj', 'q_proj']"], "'q_proj' is given twice"),
                         (["lora.rnk=8"], "did you mean 'lora.rank'")]:
        with pytest.raises(SettingsError, match=needle):
            build_settings({}, sets)


def test_lora_needs_peft_only_when_on(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    build_settings({})
    with pytest.raises(SettingsError, match="lora.rank: LoRA needs the peft package: pip install peft"):
        build_settings({}, ["lora.rank=8"])


def test_a_product_of_two_terms_is_allowed_and_answered_right():
    """basic_arithmetic ignores precedence, which two terms do not have."""
    from areal_aio.tasks.arithmetic import ANSWER_INSTRUCTION, arithmetic_tasks, expression_of

    s = build_settings({"task": {"operators": ["*"], "digits": 3}})
    for task in arithmetic_tasks(s.task, seed=5, size=200, prefix="p"):
        a, b = expression_of(task, ANSWER_INSTRUCTION).split(" * ")
        assert int(task.answer) == int(a) * int(b)
