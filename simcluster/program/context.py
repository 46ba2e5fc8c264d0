"""What a per-rank program sees: `ctx.rank`, `ctx.mesh`, `ctx.ops`, `ctx.comm` and its streams.

A program is a generator function `program(ctx, *args)`. Compute goes through `ctx.ops` (results at
once, a kernel enqueued on the current stream); communication through `ctx.comm` (yield the work).

Streams mirror CUDA streams: work on one stream runs in order; `with ctx.stream("side"):` issues onto
another; `ctx.wait_stream("side")` makes the current stream wait for what was issued there so far.
A collective runs on its own communication stream (one per process group by default, one per peer
and direction for send/recv), after the work already issued on the current stream; waiting for it
(yielding its work) makes the current stream wait for its completion.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterator, Protocol

from simcluster.numerics.ops import Ops
from simcluster.program.comm import Comm
from simcluster.program.mesh import MeshView

COMPUTE = "compute"

Program = Callable[..., Generator[Any, Any, Any]]


class Streams(Protocol):
    """The backend's side of stream handling."""

    current: str
    label: tuple[str | None, str | None]  # (kind, name) given to kernels issued now

    def wait_stream(self, name: str) -> None: ...


class Memory(Protocol):
    """What a rank holds: `hold` from this point of the current stream, `release` later; in device
    memory, or in a host tier ("cpu", "nvme")."""

    def hold(self, category: str, name: str, nbytes: int, tier: str = "gpu") -> None: ...

    def release(self, category: str, name: str, tier: str = "gpu") -> None: ...


class Context:
    def __init__(self, *, rank: int, mesh: MeshView, ops: Ops, comm: Comm, streams: Streams, memory: Memory) -> None:
        self.rank = rank
        self.world_size = mesh.mesh.world_size
        self.mesh = mesh
        self.ops = ops
        self.comm = comm
        self.memory = memory
        self._streams = streams

    @property
    def current_stream(self) -> str:
        return self._streams.current

    @contextmanager
    def stream(self, name: str) -> Iterator[None]:
        """Issue the enclosed work onto stream `name`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"stream name must be a non-empty string, got {name!r}")
        prev = self._streams.current
        self._streams.current = name
        try:
            yield
        finally:
            self._streams.current = prev

    def wait_stream(self, name: str) -> None:
        """The current stream waits for all work issued so far on stream `name`."""
        self._streams.wait_stream(name)

    @property
    def issuing(self) -> tuple[str, tuple[str | None, str | None]]:
        """Where work issued now goes: the current stream's name and the kernels' label (two passes run
        together, pipeline.together, each keep their own)."""
        return self._streams.current, self._streams.label

    @issuing.setter
    def issuing(self, where: tuple[str, tuple[str | None, str | None]]) -> None:
        self._streams.current, self._streams.label = where

    @contextmanager
    def annotate(self, kind: str, name: str | None = None) -> Iterator[None]:
        """Label the kernels issued inside: `kind` (forward, backward, ...) and a short `name` (F3)."""
        prev = self._streams.label
        self._streams.label = (kind, name)
        try:
            yield
        finally:
            self._streams.label = prev
