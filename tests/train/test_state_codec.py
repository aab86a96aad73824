"""The training state's pickle-free bytes: exact round trips, and nothing else is read."""

from __future__ import annotations

import json
import math
import pickle
import random
import struct

import numpy as np
import pytest
import torch

from symattn_cli.train.state_codec import MAGIC, StateFormatError, decode, encode
from tests.helpers import CodePayload


def _state() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    return {
        "epoch": 3,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), None, bools
        "scheduler": scheduler.state_dict(),
        "best_metric": -math.inf,
        "best_state": None,
        "best_scores": {"val/acc": 0.5},
        "rng_torch": torch.get_rng_state(),
        "rng_numpy": np.random.get_state(),  # a tuple with a uint32 array
        "rng_python": random.getstate(),  # nested tuples of ints
        "odd": [torch.tensor(2.5, dtype=torch.bfloat16), torch.zeros(0, 3), torch.tensor([True])],
        "nan": math.nan,
        "tracker_id": "abc123",
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_round_trip_is_exact():
    state = _state()
    back = decode(encode(state))
    assert _same(state, back)
    np.random.set_state(back["rng_numpy"])  # the RNG setters take what comes back
    random.setstate(back["rng_python"])
    torch.set_rng_state(back["rng_torch"])


def test_what_cannot_be_stored_is_named():
    with pytest.raises(TypeError, match=r"state\['x'\]\[1\]: a value of type object cannot"):
        encode({"x": [1, object()]})
    with pytest.raises(TypeError, match="dtype object"):
        encode({"x": np.array([None])})


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps({"epoch": 1}),
        b"PK\x03\x04 a torch.save archive",
        MAGIC,
        MAGIC + struct.pack("<Q", 1000) + b"{}",
    ],
    ids=["pickle", "zip", "no-header", "short-header"],
)
def test_foreign_bytes_are_refused(payload):
    with pytest.raises(StateFormatError):
        decode(payload)


def _crafted(tree, arrays, data: bytes = b"") -> bytes:
    header = json.dumps({"tree": tree, "arrays": arrays}).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(
    "tree,arrays,data",
    [
        ({"array": 0}, [], b""),  # no such array
        ({"array": 0}, [dict(kind="ndarray", dtype="|O", shape=[1], offset=0, nbytes=8)], b"0" * 8),
        (
            {"array": 0},
            [dict(kind="tensor", dtype="load", shape=[1], offset=0, nbytes=4)],
            b"0" * 4,
        ),
        ({"array": 0}, [dict(kind="tensor", dtype="float32", shape=[4], offset=0, nbytes=16)], b""),
        (
            {"array": 0},
            [dict(kind="tensor", dtype="float32", shape=[2], offset=0, nbytes=4)],
            b"0" * 4,
        ),
        ({"call": ["os.system", "true"]}, [], b""),
        ({"dict": [[["a"], 1]]}, [], b""),  # a list as a key
        ([1, 2], [], b""),  # not a dict at the top
    ],
    ids=["index", "object", "dtype-name", "past-end", "size", "tag", "key", "top"],
)
def test_crafted_headers_are_refused(tree, arrays, data):
    with pytest.raises(StateFormatError):
        decode(_crafted(tree, arrays, data))


def test_a_payload_is_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(StateFormatError, match="does not start as a symattn training state"):
        decode(pickle.dumps({"epoch": CodePayload(marker)}))
    assert not marker.exists()
