"""The resumable training state as bytes, without pickle: a JSON tree and raw array bytes.

A run file is shared between people and machines, so reading it must never run code. Pickle
(and ``torch.load`` of a full pickle) can; this format cannot: decoding is ``json.loads`` and
copies of raw bytes into arrays of an allowed dtype.

Layout: :data:`MAGIC`, the header's length (8 bytes, little-endian), the header (UTF-8 JSON),
then every array's bytes back to back. The header is ``{"tree": T, "arrays": [A, ...]}``;
``A = {"kind": "tensor" | "ndarray", "dtype", "shape", "offset", "nbytes"}`` (offset from
the start of the array bytes), and ``T`` encodes the state's value:

    None, bool, int, float, str     as themselves (floats may be NaN or +-Infinity)
    list / tuple                    {"list": [T, ...]} / {"tuple": [T, ...]}
    dict                            {"dict": [[key T, value T], ...]} (str, int keys ...)
    torch.Tensor / numpy array      {"array": index into "arrays"}

That covers what :meth:`symattn_cli.train.trainer.Trainer.state` holds: state dicts of the
model, optimiser, scheduler and scaler, counters, best-so-far tracking and the RNG states of
torch (a uint8 tensor), CUDA, numpy (a tuple with a uint32 array) and Python (nested tuples of
ints). Anything else is refused when writing, naming where it sits in the state.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

MAGIC = b"symattn-state\x00v1\x00"
_LENGTH = struct.Struct("<Q")

# The tensor dtypes a state may hold, by name (never looked up with getattr on input).
TENSOR_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
    )
}  # fmt: skip
# numpy kinds with a fixed, plain byte layout: bool, signed, unsigned, float, complex.
ARRAY_KINDS = "biufc"


class StateFormatError(ValueError):
    """The bytes are not a training state in this format (damaged, foreign or crafted)."""


def encode(state: Mapping[str, Any]) -> bytes:
    """The bytes of ``state`` (see the module docstring)."""
    arrays: list[dict[str, Any]] = []
    chunks: list[bytes] = []

    def add(kind: str, dtype: str, shape: tuple[int, ...], data: bytes) -> dict[str, int]:
        offset = arrays[-1]["offset"] + arrays[-1]["nbytes"] if arrays else 0
        arrays.append(
            {"kind": kind, "dtype": dtype, "shape": list(shape), "offset": offset,
             "nbytes": len(data)}
        )  # fmt: skip
        chunks.append(data)
        return {"array": len(arrays) - 1}

    def tree(value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, np.integer)):
            return int(value)
        if isinstance(value, (float, np.floating)):
            return float(value)
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in TENSOR_DTYPES:
                raise TypeError(f"state{where}: tensor of dtype {name} cannot be stored")
            flat = value.detach().cpu().contiguous().reshape(-1)  # (n,)
            data = flat.view(torch.uint8).numpy().tobytes()  # the raw bytes, any dtype
            return add("tensor", name, tuple(value.shape), data)
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in ARRAY_KINDS:
                raise TypeError(f"state{where}: array of dtype {value.dtype} cannot be stored")
            data = np.ascontiguousarray(value).tobytes()
            return add("ndarray", value.dtype.str, value.shape, data)
        if isinstance(value, (list, tuple)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [tree(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                if not (key is None or isinstance(key, (bool, int, float, str))):
                    raise TypeError(f"state{where}: key {key!r} is not a number or string")
                items.append([key, tree(item, f"{where}[{key!r}]")])
            return {"dict": items}
        raise TypeError(f"state{where}: a value of type {type(value).__name__} cannot be stored")

    header = json.dumps({"tree": tree(dict(state), ""), "arrays": arrays}).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header, *chunks])


def decode(payload: bytes) -> dict[str, Any]:
    """The state in ``payload``; :class:`StateFormatError` for anything else."""
    if not payload.startswith(MAGIC):
        raise StateFormatError("it does not start as a symattn training state")
    start = len(MAGIC) + _LENGTH.size
    if len(payload) < start:
        raise StateFormatError("it is cut short")
    (length,) = _LENGTH.unpack_from(payload, len(MAGIC))
    try:
        header = json.loads(payload[start : start + length].decode())
        tree, specs = header["tree"], header["arrays"]
        if not isinstance(specs, list):
            raise TypeError("arrays is not a list")
        arrays = [_array(spec, payload, start + length) for spec in specs]
        state = _value(tree, arrays)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as err:
        if isinstance(err, StateFormatError):
            raise
        raise StateFormatError(f"its header is malformed ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict):
        raise StateFormatError("it does not hold a dict")
    return state


def _array(spec: Any, payload: bytes, base: int) -> torch.Tensor | np.ndarray:
    kind, dtype, shape = spec["kind"], spec["dtype"], spec["shape"]
    offset, nbytes = spec["offset"], spec["nbytes"]
    if not all(isinstance(n, int) and n >= 0 for n in (offset, nbytes, *shape)):
        raise StateFormatError(f"array entry {spec!r} has a bad offset, size or shape")
    if base + offset + nbytes > len(payload):
        raise StateFormatError("an array runs past the end of the state")
    data = payload[base + offset : base + offset + nbytes]
    if kind == "tensor":
        if dtype not in TENSOR_DTYPES:
            raise StateFormatError(f"tensor dtype {dtype!r} is not one a state holds")
        target = TENSOR_DTYPES[dtype]
        if nbytes != math.prod(shape) * target.itemsize:
            raise StateFormatError(f"a {dtype} tensor of shape {shape} is not {nbytes} bytes")
        if nbytes == 0:
            return torch.empty(shape, dtype=target)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(target).reshape(shape)
    if kind == "ndarray":
        numpy_dtype = np.dtype(str(dtype))
        if numpy_dtype.kind not in ARRAY_KINDS or numpy_dtype.fields is not None:
            raise StateFormatError(f"array dtype {dtype!r} is not one a state holds")
        if nbytes != math.prod(shape) * numpy_dtype.itemsize:
            raise StateFormatError(f"a {dtype} array of shape {shape} is not {nbytes} bytes")
        return np.frombuffer(data, dtype=numpy_dtype).reshape(shape).copy()
    raise StateFormatError(f"array kind {kind!r} is unknown")


def _value(tree: Any, arrays: list) -> Any:
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if not isinstance(tree, dict) or len(tree) != 1:
        raise StateFormatError(f"a node of the tree is malformed: {str(tree)[:60]}")
    ((kind, body),) = tree.items()
    if kind == "array":
        if not isinstance(body, int) or not 0 <= body < len(arrays):
            raise StateFormatError(f"array index {body!r} is out of range")
        return arrays[body]
    if kind in ("list", "tuple") and isinstance(body, list):
        values = [_value(v, arrays) for v in body]
        return tuple(values) if kind == "tuple" else values
    if kind == "dict" and isinstance(body, list):
        out = {}
        for item in body:
            if not (isinstance(item, list) and len(item) == 2):
                raise StateFormatError("a dict entry is not a [key, value] pair")
            key, value = item
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise StateFormatError(f"a dict key is not a number or string: {key!r}")
            out[key] = _value(value, arrays)
        return out
    raise StateFormatError(f"a node of the tree is malformed: {kind!r}")
