"""The object collectives carry data, never code: the safe encoding round-trips what training
loops exchange, refuses anything else on the sender before anything is sent, and never
unpickles unless every rank asked for pickle by name."""

from __future__ import annotations

import pickle

import numpy as np
import pluribus as pb
import pytest
from pluribus import codec
from pluribus.arrays import bfloat16_dtype
from pluribus.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.timeout(60)


class Payload:
    """A class whose unpickling would run code on the receiver."""

    def __reduce__(self):
        return (print, ("code ran on the receiver",))


def test_round_trip_keeps_types_values_and_arrays():
    value = {
        "none": None,
        "flags": [True, False],
        ("tuple", 1): (1, 2.5, "x", float("inf")),
        3: b"\x00\xffraw",
        "state": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "empty": np.zeros((0, 4))},
        "scalar": np.int64(7),
        "big": 2**80,
        "nested": [[{"k": (np.float16(0.5),)}]],
    }
    got = codec.decode(codec.encode(value, 0), 1, "rank 0")
    assert got.keys() == value.keys()
    assert got["none"] is None and got["flags"] == [True, False] and got["big"] == 2**80
    assert got[("tuple", 1)] == (1, 2.5, "x", float("inf"))
    assert got[3] == b"\x00\xffraw"
    for name in ("w", "empty"):
        np.testing.assert_array_equal(got["state"][name], value["state"][name])
        assert got["state"][name].dtype == value["state"][name].dtype
        assert got["state"][name].flags.writeable  # a copy, not a view of the wire buffer
    assert type(got["scalar"]) is np.int64 and got["scalar"] == 7
    assert type(got["nested"][0][0]["k"][0]) is np.float16


def test_bfloat16_arrays_keep_their_dtype():
    bf16 = bfloat16_dtype()
    if bf16 is None:
        pytest.skip("ml_dtypes is not installed")
    array = np.arange(4).astype(bf16)
    got = codec.decode(codec.encode(array, 0), 1, "rank 0")
    assert got.dtype == bf16 and (got.astype(np.float32) == np.arange(4)).all()


@pytest.mark.parametrize(
    "bad", [Payload(), {1, 2}, np.array([object()]), {"deep": [lambda: 0]}], ids=repr
)
def test_anything_but_data_is_refused_naming_the_rank_and_where(bad):
    with pytest.raises(TypeError, match="rank 3: the object") as info:
        codec.encode(bad, 3)
    assert "pickle=True" in str(info.value)


def test_pickled_or_malformed_bytes_are_an_error_not_code():
    with pytest.raises(ValueError, match="rank 1: the object from rank 0 .* look pickled"):
        codec.decode(pickle.dumps(Payload()), 1, "rank 0")
    good = codec.encode({"a": np.ones(3)}, 0)
    for broken in (good[:-4], good[:10], b"PLB1" + good[4:8] + b'{"exec": 1}'):
        with pytest.raises(ValueError, match="not in pluribus' safe encoding"):
            codec.decode(broken, 1, "rank 0")
    forged = codec.encode(np.zeros(2), 0).replace(b"<f8", b"|O8")
    with pytest.raises(ValueError, match="cannot be received"):
        codec.decode(forged, 1, "rank 0")


def _exchange() -> tuple:
    rank = pb.get_rank()
    mine = {"rank": rank, "shape": (rank, 2), "w": np.full(3, rank, dtype=np.int16)}
    everyone = pb.all_gather_object(mine)
    root = pb.broadcast_object(mine if rank == 1 else None, src=1)
    return everyone, root


def test_object_collectives_carry_data_between_ranks():
    for everyone, root in run_ranks(_exchange, 3):
        assert [e["shape"] for e in everyone] == [(0, 2), (1, 2), (2, 2)]
        assert [e["w"].tolist() for e in everyone] == [[r] * 3 for r in range(3)]
        assert root["rank"] == 1 and root["w"].dtype == np.int16


def _refused_everywhere(src_only: bool) -> str:
    rank = pb.get_rank()
    bad = Payload() if rank == 1 else "fine"
    try:
        if src_only:
            pb.broadcast_object(bad, src=1)
        else:
            pb.all_gather_object(bad)
    except TypeError as exc:
        message = str(exc)
    else:
        return "no error"
    pb.barrier()  # the group is still in step: nothing but the lengths was sent
    return message


@pytest.mark.parametrize("src_only", [True, False], ids=["broadcast_object", "all_gather_object"])
def test_an_object_one_rank_cannot_encode_fails_every_rank_at_once(src_only):
    messages = run_ranks(_refused_everywhere, 3, timeout=30, args=(src_only,))
    assert "rank 1: the object is a" in messages[1] and "Payload" in messages[1]
    for rank in (0, 2):
        assert f"rank {rank}: rank(s) [1] could not encode" in messages[rank]


def _pickled() -> list:
    rank = pb.get_rank()
    return pb.all_gather_object(np.float64 if rank == 0 else complex(rank, 1), pickle=True)


def test_pickle_only_when_asked_for_by_name():
    assert run_ranks(_pickled, 2)[1] == [np.float64, complex(1, 1)]


def _one_side_pickles() -> None:
    pb.broadcast_object(Payload(), src=0, pickle=pb.get_rank() == 0)


def test_a_pickled_object_is_never_unpickled_by_a_rank_that_did_not_ask():
    with pytest.raises(RanksFailed, match="look pickled"):
        run_ranks(_one_side_pickles, 2, timeout=30)


def test_float64_is_not_taken_for_bfloat16_without_ml_dtypes(monkeypatch):
    """Without ml_dtypes ``bfloat16_dtype()`` is None, which numpy calls equal to float64."""
    monkeypatch.setattr(codec, "bfloat16_dtype", lambda: None)
    value = np.arange(3.0)
    back = codec.decode(codec.encode(value, 0), 1, "rank 0")
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, value)
