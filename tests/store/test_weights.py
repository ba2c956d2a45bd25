"""areal_aio/store/weights.py: round trips, tied weights, atomic publish, retention, sweeping."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from areal_aio.store import weights as weight_store
from areal_aio.store.safetensors_io import load_weights
from areal_aio.store.weights import WeightStore, WeightStoreError, sweep_dead_runs
from areal_aio.workers.models import TINY, load_model
from tests.conftest import ROOT as REPO


@pytest.fixture(scope="module")
def models():
    """Two tiny-random models with different weights (seeds 0 and 1), and a bf16 one."""
    a, _ = load_model(TINY, seed=0)
    b, _ = load_model(TINY, seed=1)
    c, _ = load_model(TINY, seed=2, dtype="bfloat16")
    return a, b, c


def _assert_same(src, dst, dtype=None) -> None:
    for (name, x), y in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(x.to(dtype) if dtype else x, y), name


def test_round_trip_is_bit_exact(tmp_path, models) -> None:
    a, b, _ = models
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    path = WeightStore(tmp_path).publish(a, 3)
    assert path == tmp_path / "v3.safetensors"
    t0 = time.perf_counter()
    seconds = load_weights(b, path)
    assert 0 < seconds <= time.perf_counter() - t0  # the load's own time
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), name  # the bits: -0.0 and NaNs too


def test_publish_casts_to_the_rollout_dtype(tmp_path, models) -> None:
    a, _, c = models
    path = WeightStore(tmp_path).publish(a, 1, dtype=torch.bfloat16)
    assert path.stat().st_size < sum(p.numel() * 4 for p in a.parameters()) * 0.6
    load_weights(c, path)
    _assert_same(a, c, torch.bfloat16)


def test_cast_while_loading_when_dtypes_differ(tmp_path, models) -> None:
    a, _, c = models
    path = WeightStore(tmp_path).publish(a, 1)  # fp32 file into a bf16 model
    load_weights(c, path)
    _assert_same(a, c, torch.bfloat16)


def test_files_are_standard_safetensors(tmp_path, models) -> None:
    a, b, _ = models
    path = WeightStore(tmp_path).publish(a, 7)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"version": "7"}
    state = load_file(str(path))
    ref = a.state_dict()
    assert all(torch.equal(t, ref[k]) for k, t in state.items())
    other = tmp_path / "by_safetensors.safetensors"  # and we read what safetensors writes
    save_file({k: v.contiguous() for k, v in state.items()}, str(other))
    load_weights(b, other)
    _assert_same(a, b)


def test_tied_weights_are_written_once_and_tied_after_load(tmp_path, models) -> None:
    a, b, _ = models
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    path = WeightStore(tmp_path).publish(a, 1)
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    load_weights(b, path)
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()
    assert torch.equal(b.lm_head.weight, a.lm_head.weight)


def test_publish_writes_a_temp_file_then_renames(tmp_path, models, monkeypatch) -> None:
    a, _, _ = models
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        # at the moment of the rename the temp file is complete and the final name is absent
        seen.append((Path(src).name, Path(dst).exists(), Path(src).stat().st_size))
        real_replace(src, dst)

    monkeypatch.setattr(weight_store.os, "replace", spy)
    store = WeightStore(tmp_path)
    path = store.publish(a, 2)
    assert seen == [(".v2.tmp", False, path.stat().st_size)]
    assert store.versions() == [2] and sorted(p.name for p in tmp_path.iterdir()) == ["v2.safetensors"]


def test_a_failed_publish_leaves_no_file(tmp_path, models, monkeypatch) -> None:
    a, _, _ = models

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_store.os, "replace", boom)
    with pytest.raises(WeightStoreError, match="No space left"):
        WeightStore(tmp_path).publish(a, 1)
    assert list(tmp_path.iterdir()) == []


def test_publish_refuses_when_the_tmpfs_is_too_small(tmp_path, models, monkeypatch) -> None:
    a, _, _ = models
    tiny_disk = shutil._ntuple_diskusage(total=4096, used=3072, free=1024)
    monkeypatch.setattr(weight_store.shutil, "disk_usage", lambda path: tiny_disk)
    with pytest.raises(WeightStoreError, match="MiB free"):
        WeightStore(tmp_path).publish(a, 1)
    assert list(tmp_path.iterdir()) == []


def test_put_stores_shipped_bytes_that_load_like_the_published_file(tmp_path, models, monkeypatch) -> None:
    a, b, _ = models
    for node in ("trainer", "rollout"):
        (tmp_path / node).mkdir()
    data = WeightStore(tmp_path / "trainer").publish(a, 4).read_bytes()
    store = WeightStore(tmp_path / "rollout")
    path = store.put(4, data)
    assert path == store.path(4) and store.versions() == [4]
    load_weights(b, path)
    _assert_same(a, b)

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_store.os, "replace", boom)
    with pytest.raises(WeightStoreError, match="No space left"):
        store.put(5, data)
    assert sorted(p.name for p in store.root.iterdir()) == ["v4.safetensors"]  # no temp file left


def test_retain_deletes_the_rest(tmp_path, models) -> None:
    a, _, _ = models
    store = WeightStore(tmp_path)
    for v in (1, 2, 3, 10):
        store.publish(a, v)
    assert store.versions() == [1, 2, 3, 10]
    assert store.retain({3, 10}) == [1, 2]
    assert store.versions() == [3, 10]
    assert store.retain([]) == [3, 10] and store.versions() == []


def test_create_and_close(tmp_path) -> None:
    (tmp_path / "shm").mkdir()  # the tmpfs; its areal_aio folder is made on demand
    base = tmp_path / "shm" / "areal_aio"
    store = WeightStore.create("run", base=base)
    assert store.root == base / f"run-{os.getpid()}"
    assert (store.root / "owner.pid").read_text() == str(os.getpid())
    with pytest.raises(WeightStoreError, match="exists already"):
        WeightStore.create("run", base=base)
    store.close()
    assert not store.root.exists() and store.versions() == []


def test_missing_parent_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(WeightStoreError, match="does not exist.*AREAL_AIO_SHM"):
        WeightStore.create("run", base=tmp_path / "no" / "areal_aio")


def test_loading_a_missing_version_or_a_wrong_model_fails_clearly(tmp_path, models) -> None:
    a, b, _ = models
    with pytest.raises(WeightStoreError, match="no such weight version"):
        load_weights(b, tmp_path / "v9.safetensors")
    bad = tmp_path / "bad.safetensors"
    save_file({"model.norm.weight": torch.zeros(3)}, str(bad))
    with pytest.raises(WeightStoreError, match="missing"):
        load_weights(b, bad)
    state = {k: v.contiguous() for k, v in load_file(str(WeightStore(tmp_path).publish(a, 1))).items()}
    state["model.norm.weight"] = torch.zeros(3)
    save_file(state, str(bad))
    before = b.model.norm.weight.clone()
    with pytest.raises(WeightStoreError, match="shape"):
        load_weights(b, bad)
    assert torch.equal(b.model.norm.weight, before)  # checked before anything is copied


def test_a_truncated_file_fails_clearly(tmp_path, models) -> None:
    a, b, _ = models
    path = WeightStore(tmp_path).publish(a, 1)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightStoreError, match="truncated"):
        load_weights(b, path)
    (n,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8:8 + n])["__metadata__"] == {"version": "1"}


CHILD = """
import sys, time
from pathlib import Path
from areal_aio.store.weights import WeightStore
store = WeightStore.create("victim", base=Path(sys.argv[1]))
(store.root / "v1.safetensors").write_bytes(b"x")
print(store.root, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_sweep_removes_the_folder_of_a_killed_run(tmp_path) -> None:
    base = tmp_path / "areal_aio"
    mine = WeightStore.create("alive", base=base)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(base)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        root = Path(child.stdout.readline().strip())
        assert root.is_dir() and root.name == f"victim-{child.pid}"
        assert sweep_dead_runs(base) == []  # its owner is alive
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)  # reaped: a zombie would still answer kill(pid, 0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert sweep_dead_runs(base) == [root]
    assert not root.exists() and mine.root.is_dir()
    mine.close()


def test_sweep_spares_an_ownerless_folder_until_it_is_old(tmp_path) -> None:
    base = tmp_path / "areal_aio"
    fresh = base / "being-created"
    fresh.mkdir(parents=True)
    (base / "stray-file").write_text("not a run")
    assert sweep_dead_runs(base) == []
    old = time.time() - weight_store.OWNERLESS_GRACE_S - 5
    os.utime(fresh, (old, old))
    assert sweep_dead_runs(base) == [fresh] and not fresh.exists()
    assert (base / "stray-file").exists()
    assert sweep_dead_runs(tmp_path / "nothing-here") == []


def test_sweep_removes_again_a_file_written_while_it_removed(tmp_path, monkeypatch) -> None:
    """A worker of the dead run may still finish a version while the folder is being swept."""
    run = tmp_path / "dead-run"
    run.mkdir()
    (run / "owner.pid").write_text("999999999")  # no such process
    real, calls = shutil.rmtree, []

    def rmtree_racing_a_writer(path, ignore_errors=False):
        real(path, ignore_errors=ignore_errors)
        calls.append(path)
        if len(calls) == 1:  # the late writer: a new file in the folder the sweep just emptied
            run.mkdir(exist_ok=True)
            (run / "v3.safetensors").write_bytes(b"late")

    monkeypatch.setattr(weight_store.shutil, "rmtree", rmtree_racing_a_writer)
    assert weight_store.sweep_dead_runs(tmp_path) == [run]
    assert not run.exists() and len(calls) == 2


def test_an_orphaned_worker_removes_its_store_also_when_a_sweep_took_owner_pid(tmp_path) -> None:
    from areal_aio.workers.common import remove_orphaned_store

    dead = 999_999_999  # the controller that died (not this process's parent: no wait)
    for owner, kept in ((None, False), (dead, False), (1, True)):
        folder = tmp_path / f"run-{owner}"
        folder.mkdir()
        (folder / "v3.safetensors").write_bytes(b"late")  # written after a sweep removed the rest
        if owner is not None:
            (folder / "owner.pid").write_text(str(owner))
        remove_orphaned_store(str(folder), dead, dead)
        # gone when owner.pid is missing or names the dead controller; another owner's stays
        assert folder.exists() == kept, owner


def test_a_forked_orphan_removes_its_controllers_store_not_the_zygotes(tmp_path) -> None:
    """A worker forked from the zygote has the zygote as its parent: once reparented, the folder
    it removes is the one owner.pid says is the controller's."""
    from areal_aio.workers.common import remove_orphaned_store

    zygote, controller = 999_999_998, 999_999_999
    for owner, kept in ((controller, False), (zygote, True)):
        folder = tmp_path / f"run-{owner}"
        folder.mkdir()
        (folder / "owner.pid").write_text(str(owner))
        remove_orphaned_store(str(folder), zygote, controller)
        assert folder.exists() == kept, owner


def test_publish_state_writes_any_tensors_with_their_metadata(tmp_path) -> None:
    from areal_aio.store.safetensors_io import read_tensors

    state = {"a.lora_A.weight": torch.arange(6.0).view(2, 3), "a.lora_B.weight": torch.ones(4, 2)}
    path = WeightStore(tmp_path).publish_state(state, 5, metadata={"format": "lora", "version": "x"})
    assert path == tmp_path / "v5.safetensors" and not list(tmp_path.glob(".*tmp"))
    tensors, meta = read_tensors(path)
    assert meta == {"format": "lora", "version": "5"}  # the version is the store's
    assert tensors.keys() == state.keys() and all(torch.equal(tensors[k], v) for k, v in state.items())
    with pytest.raises(WeightStoreError, match="no such weight version"):
        read_tensors(tmp_path / "v6.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightStoreError, match="unreadable safetensors file"):
        read_tensors(tmp_path / "bad.safetensors")
