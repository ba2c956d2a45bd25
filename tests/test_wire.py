import asyncio
import io

import pytest

from areal_aio import wire

MESSAGES = [
    wire.Init("rollout", {"run": {"seed": 1}}, "/dev/shm/x"),
    wire.Init("trainer", {"run": {"seed": 1}}, "/dev/shm/x", resume="runs/r/checkpoints/step-000004/trainer"),
    wire.Ready("trainer", 12, 1.5, "cpu", 0),
    wire.Generate("g1.0", "Calculate 1 + 2.", 64, 0.7, 0.9),
    wire.Generate("g1.1", "Calculate 1 + 2.", 64, 0.7, 0.9, seed=2**63 - 1),
    wire.Generate("p1.1.0.1.3", "Calculate 1 + 2.", 64, 0.7, 1.0, seed=5, prefix="Step 1: 1 + 2 = 3\n"),
    wire.Generate("g1.0.r1", "Calculate 6 * 7.", 8, 0.7, 1.0, seed=9, context_ids=[1, 2, 5, 6],
                  append=[{"role": "tool", "content": "42"}]),
    wire.Generate("g1.0.r0", "Calculate 6 * 7.", 8, 0.7, 1.0, seed=9, stop=["</calc>", "\n\n"]),
    wire.Abort("g1.0"),
    wire.UpdateWeights(3, "/dev/shm/x/v3.safetensors"),
    wire.WeightsLoaded(3, 0.05, 7),
    wire.Completion("g1.0", [1, 2], [5, 6, 2], [-0.1, -0.2, -0.3], [2, 3, 3], "3", "stop", 1, 0.4),
    wire.Train(4, 3, [wire.TrainSample([1], [2, 3], [-0.5, -0.25], [3, 3], 1.2, 9)]),
    wire.Train(5, 4, [wire.TrainSample([1], [2, 7, 3], [-0.5, 0.0, -0.25], [3, 3, 4], 1.2, 9, [1, 0, 1])]),
    wire.Trained(4, 4, "/dev/shm/x/v4.safetensors", {"loss": 0.5, "mismatch_kl": None}),
    wire.Save("model", "runs/r/.model.tmp", weights="/dev/shm/x/v3.safetensors"),
    wire.Saved("checkpoint", "runs/r/checkpoints/.step-000004.tmp/trainer", 4, 1 << 33, 2.5),
    wire.Shutdown(),
    wire.Error("rollout", "ValueError: x", "Traceback ..."),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_blocking(msg):
    stream = io.BytesIO()
    wire.write_message(stream, msg)
    stream.seek(0)
    assert wire.read_message(stream) == msg
    assert wire.read_message(stream) is None  # clean end of stream


async def test_round_trip_async_many_frames():
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(wire.encode(m) for m in MESSAGES))
    reader.feed_eof()
    frames = wire.FrameReader(reader)
    got = [await frames.read() for _ in MESSAGES]
    assert got == MESSAGES and await frames.read() is None


async def test_a_read_cancelled_inside_a_frame_loses_nothing():
    """A stop cancels the readers wherever they are, then reads the replies still owed on the same
    stream: a read cancelled after a frame's header, before its body, must leave that frame whole."""
    first, second = wire.Abort("first"), wire.Abort("second")
    data = wire.encode(first)
    reader = asyncio.StreamReader()
    frames = wire.FrameReader(reader)
    reader.feed_data(data[:wire.HEADER.size + 3])  # the header and part of the body
    read = asyncio.ensure_future(frames.read())
    await asyncio.sleep(0)  # it took the header and waits for the body
    assert not read.done()
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    reader.feed_data(data[wire.HEADER.size + 3:] + wire.encode(second))
    assert await frames.read() == first
    assert await frames.read() == second


def test_completion_versions():
    c = next(m for m in MESSAGES if isinstance(m, wire.Completion))
    assert (c.oldest_version, c.newest_version) == (2, 3)


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        MESSAGES[3].request_id = "other"


def test_not_a_message_and_malformed_frames():
    with pytest.raises(wire.WireError):
        wire.encode({"type": "Abort"})
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode(b'{"type": "Nope"}')
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode(b'{"type": "Abort", "wrong": 1}')
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode(b"not json")
    truncated = io.BytesIO(wire.encode(wire.Abort("x"))[:-2])
    with pytest.raises(wire.WireError, match="inside a frame"):
        wire.read_message(truncated)
    huge = io.BytesIO(wire.HEADER.pack(wire.MAX_FRAME + 1))
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.read_message(huge)


async def test_async_truncated_frame():
    reader = asyncio.StreamReader()
    reader.feed_data(wire.encode(wire.Abort("x"))[:-1])
    reader.feed_eof()
    with pytest.raises(wire.WireError):
        await wire.FrameReader(reader).read()
