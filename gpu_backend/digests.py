"""What a rank sends back: a digest for every output the emulator computed byte for byte the same, the
output itself only where it differs.

Before the ranks start, the emulator runs the scenario (it is the prediction, and the values to compare
with); each rank receives the digests of its own expected outputs (a few bytes a tensor), hashes its
outputs on the host one tensor at a time, and returns `Same(digest)` where they match. The launcher puts
the emulator's tensor back in each `Same`'s place (`restore`): the result is the rank's, byte for byte,
and nothing that matched crossed a process boundary. In fast mode most outputs differ in their last bits
(sums in the device's order) and come back whole, to be held to their bound.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from simcluster.numerics.tensor import Partial


@dataclass(frozen=True)
class Same:
    """A rank's output equal, byte for byte, to the emulator's at the same place in the result."""

    digest: str


@dataclass(frozen=True)
class Unsent:
    """An output not sent back, nor copied to the host: nothing compares it (a run without verification;
    hashing a 1.2B GPT's weights, gradients and moments took 11 s on an H200, copied to the host)."""


def digest(value: Any) -> str | None:
    """The sha256 of an output's kind, dtype, shape and bytes (host values: numpy arrays, numpy scalars as
    0-d arrays, Partials of them), or None for what is not a tensor (a Python number, a string, None)."""
    kind, array = ("partial:" + value.dtype, value.limbs) if isinstance(value, Partial) else ("", value)
    if isinstance(array, np.generic):
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        return None
    h = hashlib.sha256(f"{kind}{array.dtype.str}{array.shape}".encode())
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # (ml_dtypes' bf16 has no buffer format)
    return h.hexdigest()


def digests(result: Any) -> Any:
    """`result` with each tensor replaced by its digest (the emulator's side: what a rank receives)."""
    return walk(result, digest)


def summarize(result: Any, expected: Any, to_host: Any) -> tuple[Any, int, int]:
    """A rank's `result` to send back: `Same` where an output's digest equals `expected`'s at the same
    place, else the output on the host (`to_host`); with `expected` None, `Unsent` for every output (none
    copied).
    With the count of outputs and of those sent whole."""
    counts = [0, 0]

    def one(value: Any, want: Any) -> Any:
        if expected is None and (isinstance(value, Partial) or hasattr(value, "shape") and hasattr(value, "dtype")):
            counts[0] += 1
            return Unsent()
        host = to_host(value)
        d = digest(host)
        if d is None:
            return host
        counts[0] += 1
        if d == want:
            return Same(d)
        counts[1] += 1
        return host
    return _pair(result, expected, one), counts[0], counts[1]


def restore(sent: Any, emulated: Any) -> Any:
    """A rank's whole result: what it `sent`, with the emulator's output in each `Same`'s place."""
    return _pair(sent, emulated, lambda mine, theirs: theirs if isinstance(mine, Same) else mine)


def walk(value: Any, leaf: Any) -> Any:
    """A result (dicts, lists and tuples of leaves) with `leaf` applied to each leaf."""
    if isinstance(value, dict):
        return {k: walk(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(walk(v, leaf) for v in value)
    return leaf(value)


def _pair(value: Any, other: Any, leaf: Any) -> Any:
    """`leaf(v, o)` for each leaf v of `value` and what `other` holds at the same place (None where its
    shape differs: a result the emulator did not predict, compared as a whole later)."""
    if isinstance(value, dict):
        return {k: _pair(v, other.get(k) if isinstance(other, dict) else None, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        same = isinstance(other, (list, tuple)) and len(other) == len(value)
        return type(value)(_pair(v, other[i] if same else None, leaf) for i, v in enumerate(value))
    return leaf(value, other)
