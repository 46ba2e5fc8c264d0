"""A rank's streams, as phase one of a run records them: ordered items that timing.py replays.

An item is a kernel (KERNEL, name, kind, flops, bytes), a run of kernels back to back under one label
(KERNELS, label, kind, ((name, flops, bytes), ...): what a taped block replays, parallel/tape.py), a
wait on another stream's item (WAIT, stream, index), a rank's part of a communication call (COMM, ...)
or a change in what the rank holds (MEMORY, category, name, +-bytes). `RankState` is a rank's side of its Context: its streams, its
current stream and label, what it holds, and its program's progress (run by interpreter.py).
"""

from __future__ import annotations

from typing import Any

from simcluster.model.memory import CATEGORIES, in_tier
from simcluster.program.comm import Comm, Work
from simcluster.program.context import COMPUTE

KERNEL, WAIT, COMM, MEMORY, KERNELS = 0, 1, 2, 3, 4


class Stream:
    """One rank's stream: items run in order. Kernel: (KERNEL, name, kind, flops, bytes);
    wait: (WAIT, stream, index); communication: (COMM, call, kind, label, member index, stream, index,
    where), where the call is joined once that item of that stream (None: no wait) has ended;
    memory: (MEMORY, category, name, +-bytes), taking effect when the stream reaches it."""

    __slots__ = ("rank", "name", "items", "waited_upto", "end_times", "waiters")

    def __init__(self, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.items: list[tuple] = []
        self.waited_upto: dict[str, int] = {}
        self.end_times: list[int | None] = []
        # the replay's, by item: its end, and what waits for it (streams to wake, calls to join)
        self.waiters: list[list | None] = []


def wait_index(waiter: Stream, dep: Stream, index: int) -> int:
    """The item of `dep` that `waiter` must wait for, from now on, to wait for item `index` (and so
    for everything before it); -1 if it need not wait at all.

    Waits that cannot delay anything are left out: on items already waited for, and on trailing
    items of `dep` that end when its previous item ends (a memory item, or a wait on `waiter`
    itself, which `waiter` has passed in order). The replay's times are the same either way.
    """
    if waiter is dep:
        return -1
    covered = waiter.waited_upto.get(dep.name, -1)
    if index <= covered:
        return -1
    waiter.waited_upto[dep.name] = index
    items = dep.items
    while index > covered:
        item = items[index]
        if item[0] == MEMORY or (item[0] == WAIT and item[1] is waiter):
            index -= 1
            continue
        return index
    return -1


def _add_wait(waiter: Stream, dep: Stream, index: int) -> None:
    j = wait_index(waiter, dep, index)
    if j >= 0:
        waiter.items.append((WAIT, dep, j))


class RankState:
    """A rank's program and its streams (the `Streams` side of its Context)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.gen: Any = None
        self.comm: Comm | None = None
        self.streams: dict[str, Stream] = {}
        self.cur = self.stream(COMPUTE)  # the current stream
        self.label: tuple[str | None, str | None] = (None, None)
        self.blocked: list[Work] | None = None
        self.single = True
        self.send_value: Any = None
        self.finished = False
        self.result: Any = None
        self.works: list[Work] = []  # possibly not yet waited for
        self.prune_at = 64
        self.held: dict[tuple[str, str], int] = {}

    @property
    def current(self) -> str:
        return self.cur.name

    @current.setter
    def current(self, name: str) -> None:
        self.cur = self.stream(name)

    def stream(self, name: str) -> Stream:
        s = self.streams.get(name)
        if s is None:
            s = self.streams[name] = Stream(self.rank, name)
        return s

    def waited(self, works: list[Work]) -> None:
        """The current stream waits for `works`, all complete: what yielding them does (interpreter.py
        `_advance`), for a caller that goes on at once without yielding."""
        for w in works:
            w.waited = True
            _add_wait(self.cur, w.stream, w.index)

    def wait_stream(self, name: str) -> None:
        dep = self.streams.get(name)
        if dep is not None and dep.items:
            _add_wait(self.cur, dep, len(dep.items) - 1)

    # -- memory: ctx.memory -----------------------------------------------------------------------
    @property
    def memory(self) -> "RankState":
        return self

    def hold(self, category: str, name: str, nbytes: int, tier: str = "gpu") -> None:
        """From this point of the current stream, the rank holds `nbytes` more of `category`, in its
        device's memory or (`tier`) its host's: "cpu" or "nvme", kept as category "cpu:optimizer"."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; valid: {', '.join(CATEGORIES)}")
        category = in_tier(category, tier)
        if (category, name) in self.held:
            raise ValueError(f"rank {self.rank} already holds {category} buffer {name!r}")
        self.held[(category, name)] = int(nbytes)
        self.cur.items.append((MEMORY, category, name, int(nbytes)))

    def release(self, category: str, name: str, tier: str = "gpu") -> None:
        category = in_tier(category, tier)
        nbytes = self.held.pop((category, name), None)
        if nbytes is None:
            raise ValueError(f"rank {self.rank} releases {category} buffer {name!r}, which it does not hold")
        self.cur.items.append((MEMORY, category, name, -nbytes))

    def kernel(self, name: str, flops: float, nbytes: float) -> None:
        kind, label = self.label
        self.cur.items.append((KERNEL, f"{label}/{name}" if label else name, kind or COMPUTE, flops, nbytes))

    def kernels(self, run: tuple[tuple[str, float, float], ...]) -> None:
        """`run`'s kernels (name, flops, bytes), one after another under the current label: the same
        events as a `kernel` call each, as one item (one step of the replay where no event is kept)."""
        kind, label = self.label
        self.cur.items.append((KERNELS, label, kind or COMPUTE, run))
