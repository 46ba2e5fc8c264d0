"""Counter-based random numbers: a value is a pure function of (seed, stream, global index).

So a shard of a tensor drawn on one rank is exactly the slice of the full tensor drawn on one device,
whatever the sharding. The mixer is SplitMix64 (Steele, Lea, Flood 2014) applied to a counter.
"""

from __future__ import annotations

import zlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_id(name: str) -> int:
    """A stable 32-bit id for a named tensor (not Python's salted hash)."""
    return zlib.crc32(name.encode())


def bits(seed: int, stream: int | str, index: np.ndarray) -> np.ndarray:
    """64 random bits per element of `index` (an integer array of global flat indices)."""
    if isinstance(stream, str):
        stream = stream_id(stream)
    key = _mix(np.array([(seed & 0xFFFFFFFF) << 32 | (stream & 0xFFFFFFFF)], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        z = np.asarray(index, dtype=np.uint64) * _GOLDEN + key
        return _mix(z)


def uniform(seed: int, stream: int | str, shape: tuple[int, ...], *, offset: tuple[int, ...] | None = None,
            full_shape: tuple[int, ...] | None = None, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    """Float32 uniform in [low, high) for the block at `offset` of a tensor of `full_shape`.

    With no offset/full_shape the block is the whole tensor. Values are multiples of 2**-24 scaled to
    the range, so they are exact in float32.
    """
    full_shape = tuple(shape) if full_shape is None else tuple(full_shape)
    offset = (0,) * len(shape) if offset is None else tuple(offset)
    if len(full_shape) != len(shape) or len(offset) != len(shape):
        raise ValueError(f"shape {shape}, offset {offset} and full_shape {full_shape} must have the same rank")
    grids = np.meshgrid(*[np.arange(o, o + s, dtype=np.int64) for o, s in zip(offset, shape)], indexing="ij")
    flat = np.zeros(shape, dtype=np.int64)
    for g, n in zip(grids, full_shape):
        flat = flat * n + g
    u = (bits(seed, stream, flat) >> np.uint64(40)).astype(np.float64) * 2.0**-24  # [0, 1), 24 bits
    return (low + (high - low) * u).astype(np.float32)
