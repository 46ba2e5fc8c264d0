"""Folding: simulate one representative of each set of identical ranks and let it stand for the rest.

In meta mode the data-parallel replicas of a layout run one program on the same shapes, and so do
the tensor-parallel peers of a Megatron layout: their kernels, memory and waits are the same. The
fold's symmetries are
- a shift by `block` data-parallel replicas (a block being whole nodes),
- a rotation of the tp coordinate inside each tp group (a tp group being inside one node),
- with Ulysses or all-gather attention, a rotation of the cp coordinate: of a node's cp positions
  inside it, and of runs of them, a node's worth each, across nodes (a cp x tp block being inside a
  node or whole nodes),
- with expert parallelism routed evenly (meta mode's stated routing without skew), a rotation of the
  ep coordinate inside each ep group (a replica being whole nodes),
and each is a symmetry of the whole run:
- of the mesh: it changes only the dp (tp, cp) coordinate, so a group is mapped onto a group, one
  that spans dp (tp, cp) onto itself;
- of the cluster: every link is one rank's port (cluster.py) and nodes are mapped onto nodes, so
  NVLink onto NVLink and NIC onto NIC;
- of each collective's phases over a group it maps onto itself: its rings onto themselves, or, where
  they are not (a ring that visits nodes in order is not mapped onto itself when the cp positions of
  a node are rotated, nor the data-parallel ring when the ep groups are: it steps from one into the
  next), the weaker property that the replay needs: every member's port sends and receives the same
  flows (bytes, inside a node or not) as its representative's, and the flows the replay moves into
  each representative's port are the ones that port receives unfolded (`FoldError` otherwise: a
  chain from a root has neither). Mapping each flow to the one its representative sends is then a
  bijection at every port; the max-min rates of the simulated ports, each flow's limited by a full
  link on which no flow runs faster, carried over by it keep that property, and max-min rates are
  the only rates that have it: they are the unfolded run's.
So the unfolded run is symmetric at every instant, and only the representatives (dp index below
`block`, tp index 0, cp index 0) run:
- their programs run; a call completes when its simulated members have issued it (a folded member's
  data is its representative's, which is in the same group: in meta mode, a shape); a message from a
  representative to a folded peer (a tp ring's, tensor_parallel.py) is the image of the one it
  receives from a folded peer, so the representative's receive is matched to its own send (`partner`);
- the replay moves, of each orbit of flows, the one that leaves a representative, into the port of
  its destination's representative. The symmetries move no rank to itself, so such a port carries
  one flow of each orbit that crosses the port it stands for: as many as in the unfolded run. The
  max-min rates are the same, and network.py's filling makes them the same bits;
- statistics of a folded rank are its representative's (streams and groups renamed); `expand`
  rebuilds the whole trace when a view or an export asks for it.
Tests check that folded and unfolded runs give byte-identical traces and reports.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from simcluster.engine.errors import FoldError
from simcluster.engine.trace import MemoryEvent, Trace, TraceEvent
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import ClusterSpec


@dataclass(frozen=True)
class Fold:
    mesh: DeviceMesh
    block: int  # data-parallel replicas simulated (all dp replicas: dp is not folded)
    tp: bool  # tp peers folded onto tp index 0
    # cp peers folded onto cp index 0 (Ulysses, all-gather attention: every cp rank runs the same shapes): 0, not folded; else
    # the cp positions a node holds, rotated inside it, the runs of them rotated across nodes
    cp_local: int = 0
    ep: bool = False  # the ep peers (expert parallelism) folded onto ep index 0
    gpus_per_node: int = 1  # (where a flow stays inside a node)

    def __post_init__(self) -> None:
        sizes = self.mesh.sizes
        replica = self.mesh.world_size // sizes["dp"]
        t, c = sizes["tp"], sizes["cp"]
        e = self.mesh.ep if self.ep else 1
        simulated = [r for r in range(self.block * replica)
                     if (not self.tp or r % t == 0) and (not self.cp_local or r // t % c == 0) and r // replica % e == 0]
        object.__setattr__(self, "replica", replica)
        object.__setattr__(self, "ranks", tuple(simulated))
        is_rep = bytearray(self.mesh.world_size)
        for r in simulated:
            is_rep[r] = 1
        object.__setattr__(self, "is_rep", bytes(is_rep))
        object.__setattr__(self, "_partners", {})

    @property
    def world(self) -> int:
        return self.mesh.world_size

    @property
    def copies(self) -> int:
        return self.world // len(self.ranks)

    def describe(self) -> str:
        what = []
        if self.block < self.mesh.sizes["dp"]:
            what.append(f"data-parallel replicas in blocks of {self.block}")
        if self.tp:
            what.append("tensor-parallel peers")
        if self.cp_local:
            what.append("context-parallel peers")
        if self.ep:
            what.append("expert-parallel peers")
        return (f"{len(self.ranks)} of {self.world} ranks simulated, each standing for {self.copies} "
                f"(folded: {' and '.join(what)})")

    # -- ranks and their images --------------------------------------------------------------
    def rep(self, rank: int) -> int:
        """The simulated rank that `rank` is an image of."""
        t, c = self.mesh.sizes["tp"], self.mesh.sizes["cp"]
        r = rank % (self.block * self.replica)
        if self.tp:
            r -= r % t
        if self.cp_local:
            r -= r // t % c * t
        if self.ep:
            r -= r // self.replica % self.mesh.ep * self.replica
        return r

    def image(self, rank: int, of: int) -> int:
        """`rank` moved by the symmetry that takes rep(of) to `of`."""
        t, c = self.mesh.sizes["tp"], self.mesh.sizes["cp"]
        span = self.block * self.replica
        shift = of - of % span
        if self.tp:
            turn = of % t
            rank = rank - rank % t + (rank % t + turn) % t
        if self.cp_local:  # the cp index as (run, position in it): both rotated by of's
            near, runs = self.cp_local, c // self.cp_local
            mine, turn = rank // t % c, of // t % c
            moved = (mine // near + turn // near) % runs * near + (mine % near + turn % near) % near
            rank += (moved - mine) * t
        if self.ep:  # the ep index rotated by of's, inside the ep group
            e, replica = self.mesh.ep, self.replica
            mine, turn = rank // replica % e, of % span // replica % e
            rank += ((mine + turn) % e - mine) * replica
        return (rank + shift) % self.world

    def partner(self, src: int, dst: int) -> int | None:
        """For a message from folded `src` to its representative `dst`: where dst's own message of the same
        orbit goes (its image under the symmetry that takes dst to src is this one), or None where src's
        representative is another rank. A ring's message from the previous rank stands for the rep's own to
        the next."""
        if self.rep(src) != dst:
            return None
        found = self._partners.get((src, dst))
        if found is None:
            t = self.mesh.sizes["tp"]  # (a tp peer first: a ring's partner is one)
            near = range(dst - dst % t, dst - dst % t + t)
            found = self._partners[(src, dst)] = next(x for x in (*near, *range(self.world)) if self.image(x, src) == dst)
        return found

    def stream(self, name: str, of: int) -> str:
        """A stream of rep(of), as `of` calls it."""
        if name.startswith("send->") or name.startswith("recv<-"):
            return name[:6] + str(self.image(int(name[6:]), of))
        return name

    def group(self, where: str, of: int) -> str:
        """A group ("tp[0, 1]") or message channel ("p2p[0->1] tag 2") of rep(of), as `of` sees it."""
        if not where:
            return where
        head, _, rest = where.partition("[")
        inside, _, tail = rest.partition("]")
        ranks = [self.image(int(x), of) for x in re.findall(r"\d+", inside)]
        if "->" in inside:
            return f"{head}[{ranks[0]}->{ranks[1]}]{tail}"
        return f"{head}[{', '.join(map(str, sorted(ranks)))}]{tail}"

    def by_rank(self, per_rank: dict[int, Any], rename: bool = False) -> dict[int, Any]:
        """Per-rank values of the simulated ranks for every rank, in rank order (with `rename`, the
        values are dicts keyed by stream, renamed)."""
        out: dict[int, Any] = {}
        for r in range(self.world):
            v = per_rank.get(self.rep(r))
            if v is not None:
                out[r] = {self.stream(s, r): x for s, x in v.items()} if rename else v
        return out

    def expand(self, trace: Trace, ranks: Iterable[int] | None = None) -> Trace:
        """The unfolded run's trace (of `ranks` only, if given), rebuilt from the simulated ranks'."""
        events: dict[int, list[TraceEvent]] = {}
        for e in trace.events:
            events.setdefault(e.rank, []).append(e)
        memory: dict[int, list[MemoryEvent]] = {}
        for m in trace.memory:
            memory.setdefault(m.rank, []).append(m)
        lanes: dict[int, list[str]] = {}
        for r, s in trace.lanes:
            lanes.setdefault(r, []).append(s)
        all_lanes: list[tuple[int, str]] = []
        all_events: list[TraceEvent] = []
        all_memory: list[MemoryEvent] = []
        for r in range(self.world) if ranks is None else sorted(set(ranks)):
            rep = self.rep(r)
            all_lanes.extend((r, self.stream(s, r)) for s in lanes.get(rep, ()))
            all_events.extend(e._replace(rank=r, stream=self.stream(e.stream, r), group=self.group(e.group, r))
                              for e in events.get(rep, ()))
            all_memory.extend(m._replace(rank=r) for m in memory.get(rep, ()))
        out = Trace.from_lanes(all_lanes, [all_events])
        out.memory = tuple(all_memory)
        return out

    # -- checks --------------------------------------------------------------------------------
    def check_phases(self, members: tuple[int, ...], phases: Iterable[Any], where: str, kind: str) -> None:
        """Each phase's flows must be their own image under every symmetry that maps the group onto
        itself (so that the flows leaving the simulated ranks stand for the others)."""
        group = set(members)
        movers = []
        span = self.block * self.replica
        if span < self.world:
            movers.append(span)  # the dp shift: of = the first rank of the next block
        if self.tp:
            movers.append(1)  # the tp rotation by one
        if self.cp_local:
            t, c = self.mesh.sizes["tp"], self.mesh.sizes["cp"]
            movers += [t] if self.cp_local > 1 else []  # the cp rotation by one inside a node
            movers += [self.cp_local * t] if c > self.cp_local else []  # and by a node's worth
        if self.ep:
            movers.append(self.replica)  # the ep rotation by one
        # (a mover that maps the group onto another group: that one's call is not simulated)
        movers = [of for of in movers if {self.image(m, of) for m in members} == group]
        for phase in phases:
            flows = set(phase.flows)
            if any((self.image(s, of), self.image(d, of), b) not in flows for of in movers for s, d, b in flows):
                # (not its own image: a ring in node order under the cp or ep rotation)
                self._ports_alike(members, phase.flows, where, kind)

    def even_rows(self, op: Any, where: str) -> None:
        """An uneven all_to_all whose folded members' sends are their representative's: only where it
        sends every member as many rows, and receives as many from each."""
        if len(set(op.splits) | set(op.gets)) > 1:
            raise FoldError(f"all_to_all on {where} moves uneven rows ({list(op.splits)}): its folded copies "
                            f"would not send what their representative does")

    def _ports_alike(self, members: tuple[int, ...], flows: Iterable[tuple[int, int, float]], where: str,
                     kind: str) -> None:
        """The weaker check (the module docstring), for phases that are not their own image: every
        member's ports carry what its representative's do, and each representative's port receives,
        folded, what it receives."""
        gpn = self.gpus_per_node
        out: dict[int, list] = {m: [] for m in members}
        into: dict[int, list] = {m: [] for m in members}
        moved: dict[int, list] = {m: [] for m in members}
        for s, d, b in flows:
            what = (b, s // gpn == d // gpn)
            out[s].append(what)
            into[d].append(what)
            if self.is_rep[s]:
                if self.rep(d) not in moved:
                    raise FoldError(f"{kind} on {where} sends from a representative out of its group's folded copies")
                moved[self.rep(d)].append(what)
        for m in members:
            r = self.rep(m)
            if sorted(out[m]) != sorted(out[r]) or sorted(into[m]) != sorted(into[r]) or \
                    (self.is_rep[m] and sorted(moved[m]) != sorted(into[m])):
                raise FoldError(f"{kind} on {where} does not load every folded copy's ports alike")


def fold_for(mesh: DeviceMesh, spec: ClusterSpec, axes: tuple[str, ...] = ("dp",)) -> Fold | None:
    """The fold of a layout along `axes` (those whose ranks the program treats alike: dp, tp, cp):
    blocks of whole replicas and whole nodes; tp groups inside a node; cp x tp blocks inside a node,
    or of whole nodes (each node's cp positions rotated inside it, and the nodes among themselves).
    None if nothing folds."""
    sizes, gpn = mesh.sizes, spec.gpus_per_node
    replica = mesh.world_size // sizes["dp"]
    block = sizes["dp"]
    if "dp" in axes:
        # (whole expert-parallel groups too: a shift by whole ep groups maps them, and the groups holding
        # the same experts, onto themselves)
        least = math.lcm(math.lcm(replica, gpn) // replica, mesh.ep)
        if sizes["dp"] % least == 0:
            block = least
    t, c = sizes["tp"], sizes["cp"]
    # (rotating the ep index moves whole replicas: a symmetry of the cluster where each is whole nodes)
    ep = "ep" in axes and mesh.ep > 1 and replica % gpn == 0 and block % mesh.ep == 0
    tp = "tp" in axes and t > 1 and gpn % t == 0
    cp_local = 0
    if "cp" in axes and c > 1 and gpn % t == 0:
        cp_local = c if gpn % (c * t) == 0 else gpn // t if (c * t) % gpn == 0 else 0
    if block == sizes["dp"] and not tp and not cp_local and not ep:
        return None
    return Fold(mesh, block, tp, cp_local, ep, gpn)
