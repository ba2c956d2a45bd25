"""The run folder's row files: nothing made is lost, order is kept, sizes count what is coming."""

import asyncio

import orjson

from areal_aio.control.runlog import RunLog


def rows(path):
    return [orjson.loads(x)["i"] for x in path.read_bytes().splitlines()]


async def test_a_cancelled_flush_loses_no_rows_and_keeps_their_order(tmp_path):
    log = RunLog(tmp_path, "")
    for i in range(1000):
        log.row("steps", {"i": i})
    flusher = asyncio.create_task(log.flush())
    await asyncio.sleep(0)  # the write has started
    flusher.cancel()
    for i in range(1000, 1010):
        log.row("steps", {"i": i})
    await log.settle()
    assert rows(tmp_path / "steps.jsonl") == list(range(1010))


async def test_sizes_count_rows_not_yet_written(tmp_path):
    log = RunLog(tmp_path, "")
    log.row("steps", {"i": 0})
    log.row("samples", {"i": 1})
    sizes = log.sizes()
    assert (tmp_path / "steps.jsonl").stat().st_size == 0
    log.row("steps", {"i": 2})  # after the instant the sizes were taken
    await log.settle()
    assert sizes["steps"] == len(orjson.dumps({"i": 0})) + 1
    assert (tmp_path / "steps.jsonl").read_bytes()[:sizes["steps"]] == b'{"i":0}\n'
    assert sizes["samples"] == (tmp_path / "samples.jsonl").stat().st_size


async def test_appending_continues_the_sizes_of_the_existing_files(tmp_path):
    (tmp_path / "steps.jsonl").write_bytes(b'{"i":0}\n')
    log = RunLog(tmp_path, "", append=True)
    log.row("steps", {"i": 1})
    assert log.sizes()["steps"] == 16
    await log.settle()
    assert rows(tmp_path / "steps.jsonl") == [0, 1]


async def test_rows_at_once_write_and_count_what_rows_one_by_one_would(tmp_path):
    one, many = RunLog(tmp_path / "one", ""), RunLog(tmp_path / "many", "")
    for i in range(5):
        one.row("samples", {"i": i})
    many.rows("samples", ({"i": i} for i in range(3)))
    many.rows("samples", [])  # a group with nothing to record adds nothing
    many.rows("samples", [{"i": 3}, {"i": 4}])
    assert many.sizes() == one.sizes()
    await one.settle()
    await many.settle()
    assert (tmp_path / "many" / "samples.jsonl").read_bytes() == (tmp_path / "one" / "samples.jsonl").read_bytes()
    assert rows(tmp_path / "many" / "samples.jsonl") == list(range(5))
