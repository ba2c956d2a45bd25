"""areal_aio/sandbox/cgroups.py: finding where a run's cgroup can be made (parsed from the
kernel's own files), and one run's cgroup made, limited and removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_aio.sandbox import cgroups

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 /outer /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
PROC_CGROUP = "8:pids:/\n4:memory:/outer/job/7\n1:cpu,cpuacct:/\n0::/user.slice/app.scope\n"


def test_mounts_and_own_paths_are_read_off_the_kernels_files():
    assert cgroups.mounts(MOUNTINFO) == {"memory": ("/sys/fs/cgroup/memory", "/outer"),
                                         "pids": ("/sys/fs/cgroup/pids", "/"),
                                         "": ("/sys/fs/cgroup/unified", "/")}
    assert cgroups.own_paths(PROC_CGROUP) == {"pids": "/", "memory": "/outer/job/7", "": "/user.slice/app.scope"}


def test_a_cgroups_folder_is_its_path_below_the_mounts_root():
    assert cgroups.folder(("/sys/fs/cgroup/memory", "/outer"), "/outer/job/7") == Path("/sys/fs/cgroup/memory/job/7")
    assert cgroups.folder(("/sys/fs/cgroup/pids", "/"), "/") == Path("/sys/fs/cgroup/pids")
    assert cgroups.folder(("/sys/fs/cgroup/unified", "/"), "/a/b") == Path("/sys/fs/cgroup/unified/a/b")


def test_a_run_group_writes_its_limits_and_is_removed(tmp_path):
    """A v1 hierarchy stood in for by plain folders: mkdir makes no control files, so the run's
    group writes them as files; its removal then takes what it made."""
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    memory.mkdir()
    pids.mkdir()
    group = cgroups.RunGroup(cgroups.Hierarchy(1, memory, pids), 300 << 20, 12)
    made: list[Path] = []

    def mkdir(path: Path, *args, **kwargs):  # a cgroup folder comes with its control files
        os.mkdir(path)
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max", "memory.max_usage_in_bytes"):
            (path / name).write_text("0")
        made.append(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "mkdir", mkdir)
        group.make()
    assert [p.name for p in made] == [group.name, group.name] and group.name.startswith(cgroups.PREFIX)
    assert (memory / group.name / "memory.limit_in_bytes").read_text() == str(300 << 20)
    assert (memory / group.name / "memory.memsw.limit_in_bytes").read_text() == str(300 << 20) and group.swap
    assert (pids / group.name / "pids.max").read_text() == "12"
    assert group.procs == [str(memory / group.name / "cgroup.procs"), str(pids / group.name / "cgroup.procs")]
    for path in made:  # a real cgroup folder is removed with its files; a plain one needs them gone
        for f in path.iterdir():
            f.unlink()
    group.remove()
    assert not list(memory.iterdir()) and not list(pids.iterdir()) and group.peak is None


def test_a_group_that_cannot_be_made_leaves_nothing_behind(tmp_path, monkeypatch):
    real = cgroups._write

    def write(path, value, optional=False):
        if path.name == "memory.max":  # the first limit: the folder is still empty
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, value, optional)

    monkeypatch.setattr(cgroups, "_write", write)
    group = cgroups.RunGroup(cgroups.Hierarchy(2, tmp_path), 1 << 20, 4)
    with pytest.raises(PermissionError):
        group.make()
    assert not list(tmp_path.iterdir()) and group.folders == []  # the folder it made is gone


def test_find_says_why_where_no_cgroup_can_be_made(monkeypatch, tmp_path):
    texts = {"/proc/self/mountinfo": MOUNTINFO.replace("/sys/fs/cgroup", str(tmp_path)), "/proc/self/cgroup": PROC_CGROUP}
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: texts.get(str(self)) or real(self, *a, **k))
    where, why = cgroups.find()  # the folders do not exist: nothing can be made there
    assert where is None and "v2: memory and pids are not enabled" in why and "v1:" in why
