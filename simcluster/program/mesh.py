"""The device mesh: ranks laid out on named axes (dp, pp, cp, tp), innermost axis fastest.

The mesh is plain data passed to each rank, never global. A process group is the set of ranks that
share every coordinate except the axes named: `mesh.group(rank, "tp")` is this rank's tensor-parallel
group, `mesh.group(rank, "dp", "cp")` its data+context group.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

AXES: tuple[str, ...] = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class ProcessGroup:
    """Ranks (global ids, in group order) named by the mesh axes they span."""

    name: str
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "_hash", hash((self.name, self.ranks)))  # groups are dict keys in hot paths

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:  # rebuilt, not copied: string hashes differ between processes
        return ProcessGroup, (self.name, self.ranks)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_of(self, global_rank: int) -> int:
        """This rank's index inside the group."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in group {self}") from None

    def __contains__(self, global_rank: object) -> bool:
        return global_rank in self.ranks

    def __str__(self) -> str:
        return f"{self.name}{list(self.ranks)}"


def _check_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    for a in axes:
        if a not in AXES:
            raise ValueError(f"unknown mesh axis {a!r}; valid axes: {', '.join(AXES)}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh axes repeated in {axes}")
    return tuple(a for a in AXES if a in axes)  # canonical (mesh) order


class DeviceMesh:
    """`np.arange(world).reshape(dp, pp, cp, tp)` with the process groups along any axes."""

    def __init__(self, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1) -> None:
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for axis, n in (sizes | {"ep": ep}).items():
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {n!r}")
        if dp % ep:
            raise ValueError(f"expert parallelism is carved out of data parallelism: ep={ep} must divide dp={dp}")
        self.ep = int(ep)  # experts sharded over runs of ep consecutive data-parallel ranks (expert_groups)
        self.sizes: dict[str, int] = {a: int(sizes[a]) for a in AXES}
        self.world_size = int(np.prod(list(self.sizes.values())))
        self.ranks = np.arange(self.world_size).reshape(tuple(self.sizes[a] for a in AXES))
        self._groups: dict[tuple[int, tuple[str, ...]], ProcessGroup] = {}
        self._interned: dict[ProcessGroup, ProcessGroup] = {}
        self._along: dict[tuple, ProcessGroup] = {}

    def __repr__(self) -> str:
        return ("DeviceMesh(" + ", ".join(f"{a}={n}" for a, n in self.sizes.items())
                + (f", ep={self.ep}" if self.ep > 1 else "") + ")")

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for a mesh of {self.world_size} ranks")
        idx = np.unravel_index(rank, self.ranks.shape)
        return {a: int(i) for a, i in zip(AXES, idx)}

    def group(self, rank: int, *axes: str) -> ProcessGroup:
        """The group of `rank` along `axes` (all four axes, or none given: the whole world)."""
        axes = _check_axes(axes) if axes else AXES
        key = (rank, axes)
        if key not in self._groups:
            c = self.coords(rank)
            outer = (axes, tuple(c[a] for a in AXES if a not in axes))  # what every member shares
            g = self._along.get(outer)
            if g is None:  # (made once a group, not once a member: a pipeline of P stages asks P times)
                index = tuple(slice(None) if a in axes else c[a] for a in AXES)
                members = tuple(int(r) for r in self.ranks[index].reshape(-1))
                g = ProcessGroup("world" if axes == AXES else "+".join(axes), members)
                g = self._along[outer] = self._interned.setdefault(g, g)  # every member shares one object
            self._groups[key] = g
        return self._groups[key]

    def groups(self, *axes: str) -> list[ProcessGroup]:
        """Every group along `axes`, ordered by their lowest rank."""
        seen: dict[tuple[int, ...], ProcessGroup] = {}
        for r in range(self.world_size):
            g = self.group(r, *axes)
            seen.setdefault(g.ranks, g)
        return [seen[k] for k in sorted(seen)]

    def expert_groups(self, rank: int) -> tuple[ProcessGroup, ProcessGroup]:
        """`rank`'s expert-parallel group, the ep consecutive ranks of its data-parallel group that share
        out the experts between them (Megatron-Core's expert_model_parallel_group), and its expert
        data-parallel group, the ranks of its stage that hold the same experts (expert_data_parallel_group):
        the dp/ep of them, times every tp and cp rank (the experts are whole on each: each saw its own
        tokens, as a data-parallel rank does; Megatron-Core's MoE parallel folding with expert tp 1)."""
        c = self.coords(rank)
        members = self.group(rank, "dp").ranks
        if self.ep == 1:
            alone = ProcessGroup("ep", (rank,))
            ep = self._interned.setdefault(alone, alone)
        else:
            first = c["dp"] // self.ep * self.ep
            g = ProcessGroup("ep", members[first:first + self.ep])
            ep = self._interned.setdefault(g, g)
        if self.ep == 1:  # every rank of the stage holds every expert: its dp (x cp x tp) group reduces them
            return ep, self.group(rank, "dp", *(a for a in ("cp", "tp") if self.sizes[a] > 1))
        if self.sizes["tp"] * self.sizes["cp"] == 1:
            g = ProcessGroup("edp", members[c["dp"] % self.ep::self.ep])
        else:
            index = tuple(slice(c["dp"] % self.ep, None, self.ep) if a == "dp" else slice(None) if a in ("tp", "cp")
                          else c[a] for a in AXES)
            g = ProcessGroup("edp", tuple(sorted(int(r) for r in self.ranks[index].reshape(-1))))
        return ep, self._interned.setdefault(g, g)

    def mirror(self, rank: int) -> ProcessGroup:
        """`rank` and the rank at the mirrored pipeline stage (p-1-s; every other coordinate the same):
        DualPipe's two copies of the same layers."""
        c = self.coords(rank)
        other = dict(c, pp=self.sizes["pp"] - 1 - c["pp"])
        pair = sorted({rank, int(self.ranks[tuple(other[a] for a in AXES)])})
        g = ProcessGroup("pp-mirror", tuple(pair))
        return self._interned.setdefault(g, g)

    def all_groups(self) -> list[ProcessGroup]:
        """Every group along every non-empty combination of axes, then the mirror pairs of the
        pipeline stages, in a fixed order."""
        out: list[ProcessGroup] = []
        for n in range(1, len(AXES) + 1):
            for axes in combinations(AXES, n):
                out.extend(self.groups(*axes))
        pairs = {g.ranks: g for g in map(self.mirror, range(self.world_size)) if g.size == 2}
        out += [pairs[k] for k in sorted(pairs)]
        if self.ep > 1:  # (with ep = 1 the groups are a rank alone and the dp groups)
            experts = {g.ranks: g for r in range(self.world_size) for g in self.expert_groups(r)}
            out += [experts[k] for k in sorted(experts)]
        return out

    def view(self, rank: int) -> "MeshView":
        return MeshView(self, rank)


class MeshView:
    """One rank's view of the mesh: `view.tp` is its tensor-parallel group, `view.coord('tp')` its index."""

    def __init__(self, mesh: DeviceMesh, rank: int) -> None:
        self.mesh = mesh
        self.rank = rank
        self._coords = mesh.coords(rank)
        self._groups: dict[tuple[str, ...], ProcessGroup] = {}
        # this rank's group along each axis and the world (plain attributes: programs use them per call)
        self.dp, self.pp, self.cp, self.tp = (self.group(a) for a in AXES)
        self.world = self.group()
        self.ep, self.edp = mesh.expert_groups(rank)  # (ep = 1: this rank alone, and its dp group's ranks)

    def group(self, *axes: str) -> ProcessGroup:
        g = self._groups.get(axes)
        if g is None:
            g = self._groups[axes] = self.mesh.group(self.rank, *axes)
        return g

    def coord(self, axis: str) -> int:
        _check_axes((axis,))
        return self._coords[axis]

    def size(self, axis: str) -> int:
        _check_axes((axis,))
        return self.mesh.sizes[axis]
