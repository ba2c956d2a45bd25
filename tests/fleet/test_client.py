"""PipeWorker's writes to a worker that is gone: a WorkerFailed naming its exit, on either loop."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from areal_aio import wire
from areal_aio.fleet.client import PipeWorker, WorkerFailed


async def writes_to_an_exited_worker() -> list[str]:
    worker = PipeWorker("rollout")
    worker.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import sys; sys.exit(3)",
                                                       stdin=asyncio.subprocess.PIPE)
    await worker.proc.wait()
    errors = []
    for _ in range(3):  # the first write finds the pipe closed, the later ones its closed transport
        with pytest.raises(WorkerFailed) as failed:
            await worker.send_many([wire.Abort("r0")] * 4096)
        errors.append(str(failed.value))
    return errors


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_every_write_to_an_exited_worker_names_its_exit_code(loop_factory):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        errors = runner.run(writes_to_an_exited_worker())
    assert all("rollout worker failed: exited with code 3" in e for e in errors), errors
