"""sandbox/programs.py: the values that cross the sandbox's wall: what encode writes decodes to
the same value and type, anything else is refused both ways, and JSON equality has a float
tolerance. (Programs run against tests through the harness: tests/rewards/test_code.py.)"""

from __future__ import annotations

import math

import pytest

from areal_aio.sandbox.programs import decode, encode, same


def test_values_round_trip_and_keep_their_types():
    for value in [None, True, 3, -2.5, "s", [1, (2, 3)], {"a": {1: {2}}}, frozenset({1}), b"\x00", 1 + 2j,
                  {(1, 2): [None]}]:
        assert decode(encode(value)) == value and type(decode(encode(value))) is type(value)
    assert math.isnan(decode(encode(float("nan"))))


def test_only_plain_values_encode():
    class AlwaysEqual:
        def __eq__(self, other):
            return True

    class SneakyInt(int):
        pass

    for value in [AlwaysEqual(), SneakyInt(3), [AlwaysEqual()], object(), 10 ** 5000, print]:
        with pytest.raises((TypeError, ValueError)):
            encode(value)


@pytest.mark.parametrize("forged", [{"a": 1, "b": 2}, {"$eval": "1"}, {"$dict": [[[1], 2]]}, {"$float": "1e999"},
                                    {"$tuple": "ab"}, {"$set": [[1]]}])
def test_decode_rejects_what_encode_never_writes(forged):
    with pytest.raises(ValueError):
        decode(forged)


def test_same_is_json_equality_with_a_float_tolerance():
    assert same(3, 3) and same(0.1 + 0.2, 0.3) and same([1, {"a": 2.0}], [1, {"a": 2}])
    assert not same(True, 1) and not same(1, True) and not same(None, 0) and not same("1", 1)
    assert not same([1, 2], [1, 2, 3]) and not same({"a": 1}, {"a": 1, "b": 2}) and not same({1}, [1])

