"""Test your own parallel program the way simcluster tests its own: hypothesis strategies for meshes
and for valid layouts of a model, and assertions that a program on an emulated mesh gives what the
same program gives on one device.

    from hypothesis import given
    from simcluster.testing import assert_bit_exact, meshes

    @given(meshes(max_world=8, axes=("dp", "tp")))
    def test_my_program_is_bit_exact(mesh):
        assert_bit_exact(my_program, my_config(mesh), mesh=mesh, assemble=my_assemble)

A program returns what it computed (a dict of arrays, lists of them, ...); `assemble(results,
coords)` turns the ranks' results (by rank) and their mesh coordinates into the outputs one device
would hold, by name. Without one, every rank must hold every output whole (`replicated`); `unshard`
joins the pieces of a sharded one. The strategies need hypothesis (the `test` extra); the
assertions need nothing beyond simcluster. docs/tutorial.md walks through all of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from simcluster import report
from simcluster.engine import RunResult, default_cluster, simulate
from simcluster.model.config import ModelConfig
from simcluster.numerics.divisors import divisors
from simcluster.numerics.tolerance import bound as fast_bound
from simcluster.numerics.tolerance import training_bounds
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import ATTENTIONS, DISPATCHERS, ZERO_OVER, Parallelism
from simcluster.parallel.pipeline_schedules import Schedule
from simcluster.program.mesh import AXES, DeviceMesh
from simcluster.topology.presets import preset

__all__ = ["Layout", "assert_bit_exact", "assert_close_fast", "assert_same", "fast_bound", "layouts", "meshes",
           "one_device", "outputs", "replicated", "unshard"]

Assemble = Callable[[list[Any], list[dict[str, int]]], dict[str, Any]]


# -- from the ranks' results to one device's outputs ---------------------------------------------------
def outputs(result: Any, name: str = "") -> dict[str, np.ndarray]:
    """A result as named arrays: a dict's entries by key (nested ones as `a.b`), a list's items as
    `name[i]`, anything else as one array; None is left out."""
    if result is None:
        return {}
    if isinstance(result, Mapping):
        out: dict[str, np.ndarray] = {}
        for key, value in result.items():
            out |= outputs(value, f"{name}.{key}" if name else str(key))
        return out
    if isinstance(result, (list, tuple)):
        return {k: v for i, item in enumerate(result) for k, v in outputs(item, f"{name}[{i}]").items()}
    return {name or "result": np.asarray(getattr(result, "limbs", result))}  # an exact partial: its limbs


def unshard(results: list[Any], coords: list[dict[str, int]], name: str,
            dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """{name: the whole tensor}: each rank's output `name` (as `outputs` names it), joined along array
    dimension dims[axis] for each mesh axis in `dims` (`{"tp": 0}`: row shards over tensor-parallel
    ranks), in coordinate order. Ranks that differ only on the other axes hold replicas, which must
    agree: one that differs is added as its own output, `name@dp1` (its non-zero coordinates)."""
    dims = dict(dims or {})
    for axis in dims:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r} in dims; valid axes: {', '.join(AXES)}")
    split = [a for a in AXES if a in dims]
    replicas: dict[tuple[int, ...], dict[tuple[int, ...], np.ndarray]] = {}
    for rank, (result, c) in enumerate(zip(results, coords)):
        named = outputs(result)
        if name not in named:
            raise ValueError(f"rank {rank} returned no output named {name!r}; it returned: {', '.join(named) or 'none'}")
        key = tuple(c[a] for a in AXES if a not in dims)
        replicas.setdefault(key, {})[tuple(c[a] for a in split)] = named[name]
    out: dict[str, np.ndarray] = {}
    first = None
    for key in sorted(replicas):
        tiles = replicas[key]
        for depth in reversed(range(len(split))):  # innermost axis first: rows of tiles, then the rows
            joined: dict[tuple[int, ...], list[np.ndarray]] = {}
            for at in sorted(tiles):
                joined.setdefault(at[:depth], []).append(tiles[at])
            tiles = {at: np.concatenate(parts, axis=dims[split[depth]]) for at, parts in joined.items()}
        whole = tiles[()]
        if first is None:
            first = out[name] = whole
        elif whole.shape != first.shape or whole.tobytes() != first.tobytes():
            where = ",".join(f"{a}{i}" for a, i in zip([a for a in AXES if a not in dims], key) if i)
            out[f"{name}@{where}"] = whole
    return out


def replicated(results: list[Any], coords: list[dict[str, int]]) -> dict[str, np.ndarray]:
    """The outputs when every rank holds every output whole (losses after an all-reduce, DDP's
    weights): rank 0's, and a rank's own where it differs (`w@dp1`)."""
    out: dict[str, np.ndarray] = {}
    for name in outputs(results[0]):
        out |= unshard(results, coords, name)
    return out


# -- running a program and its one-device reference ------------------------------------------------
def _run(program: Callable[..., Any], config: Any, mesh: DeviceMesh, mode: str, cluster: Any) -> RunResult:
    """On `cluster`, or DGX A100 nodes of 8 (one node of the world's size where 8 does not divide it)."""
    world = mesh.world_size
    if cluster is None:
        cluster = default_cluster(world) if world <= 8 or world % 8 == 0 else preset("dgx-a100", gpus_per_node=world)
    return simulate(program, config, mesh=mesh, mode=mode, cluster=cluster)


def _view(run: RunResult, assemble: Assemble | None) -> dict[str, Any]:
    coords = [run.mesh.coords(r) for r in range(run.mesh.world_size)]
    return (assemble or replicated)(run.results, coords)


def one_device(program: Callable[..., Any], config: Any, *, assemble: Assemble | None = None,
               mode: str = "exact") -> dict[str, Any]:
    """The outputs of `program(ctx, config)` on one device (a mesh of one rank): the reference."""
    return _view(_run(program, config, DeviceMesh(), mode, None), assemble)


def _reference(program: Callable[..., Any], config: Any, mode: str, assemble: Assemble | None,
               reference: Mapping[str, Any] | None, reference_config: Any) -> dict[str, Any]:
    if reference is not None:
        return dict(reference)
    return one_device(program, config if reference_config is None else reference_config, assemble=assemble, mode=mode)


def assert_same(expected: Mapping[str, Any], got: Mapping[str, Any], *, where: str = "",
                against: str = "the reference") -> None:
    """Raise AssertionError unless `got` has exactly `expected`'s outputs, byte for byte; the message
    names the first mismatches as the report does: output, first index that differs, expected and got
    values, how many elements differ."""
    verdict = report.verification("exact", dict(expected), dict(got))
    if verdict["bit_exact"]:
        return
    differ = sorted(set(expected) ^ set(got)) + [k for k in expected if k in got and
                                                np.asarray(expected[k]).tobytes() != np.asarray(got[k]).tobytes()]
    head = (f"not bit-exact{' on ' + where if where else ''}: {len(differ)} of {len(expected)} outputs differ from "
            f"{against} ({', '.join(differ[:8])}{', ...' if len(differ) > 8 else ''})")
    raise AssertionError("\n".join([head] + ["  mismatch: " + ", ".join(f"{k}={v}" for k, v in m.items())
                                             for m in verdict["mismatches"]]))


def assert_bit_exact(program: Callable[..., Any], config: Any, *, mesh: DeviceMesh, assemble: Assemble | None = None,
                     reference: Mapping[str, Any] | None = None, reference_config: Any = None,
                     cluster: Any = None) -> RunResult:
    """Run `program(ctx, config)` on every rank of `mesh` in exact mode; `assert_same` its outputs and
    the same program's on one device (run with `reference_config`, default `config`; or give its
    outputs as `reference`). Returns the run (its trace times and draws it)."""
    run = _run(program, config, mesh, "exact", cluster)
    assert_same(_reference(program, config, "exact", assemble, reference, reference_config), _view(run, assemble),
                where=repr(mesh), against="the same program on one device")
    return run


def assert_close_fast(program: Callable[..., Any], config: Any, *, mesh: DeviceMesh,
                      bounds: float | Callable[[str], float | None], assemble: Assemble | None = None,
                      reference: Mapping[str, Any] | None = None, reference_config: Any = None,
                      cluster: Any = None) -> RunResult:
    """Run `program` on `mesh` in fast mode (as a GPU computes) and raise AssertionError unless each
    output is within its bound of the same program's fast run on one device, by relative norm error
    ||got - expected|| / ||expected||. `bounds`: one bound for every output, or a function of the
    output's name giving its bound (None: not compared). `fast_bound(dtype, longest_sum,
    rounding_points)` derives one (numerics/tolerance.py says how); `Layout.fast_bounds` gives the
    GPT's. Returns the run."""
    of = (lambda _: float(bounds)) if isinstance(bounds, (int, float)) else bounds
    run = _run(program, config, mesh, "fast", cluster)
    got = _view(run, assemble)
    want = _reference(program, config, "fast", assemble, reference, reference_config)
    verdict = report.verification("fast", want, got, of)
    if not verdict["passed"]:
        t = verdict["tolerance"]
        lines = [f"not within the fast-mode tolerance on {mesh!r}: {t['failing']} of {t['compared']} outputs compared "
                 f"exceed their bound ({t['rule']})"]
        if not t["compared"]:
            lines[0] = f"no output was compared on {mesh!r}: `bounds` gives None for all of {', '.join(want)}"
        if set(want) != set(got):
            lines.append(f"  outputs differ: only in the reference {sorted(set(want) - set(got))}, "
                         f"only in the run {sorted(set(got) - set(want))}")
        lines += [f"  {f['output']}: relative error {f['relative_error']:.3g} > bound {f['bound']:.3g}" for f in t["failed"]]
        raise AssertionError("\n".join(lines))
    return run


# -- strategies ------------------------------------------------------------------------------------
def meshes(max_world: int = 16, *, axes: Iterable[str] = AXES, min_world: int = 1) -> Any:
    """A hypothesis strategy of DeviceMesh with `min_world` to `max_world` ranks, split over `axes`
    (the others have size 1). Every such mesh is equally likely; a failure shrinks to the smallest."""
    from hypothesis import strategies as st

    named = list(axes)
    if not named or len(named) != len(set(named)) or any(a not in AXES for a in named):
        raise ValueError(f"axes must name distinct mesh axes among {', '.join(AXES)}, got {named}")
    axes = [a for a in AXES if a in named]
    if not 1 <= min_world <= max_world:
        raise ValueError(f"need 1 <= min_world <= max_world, got {min_world} and {max_world}")
    def within(k: int, room: int) -> Iterator[tuple[int, ...]]:  # k degrees whose product is at most room
        if k == 0:
            yield ()
            return
        for n in range(1, room + 1):
            yield from ((n, *rest) for rest in within(k - 1, room // n))

    sizes = sorted((s for s in within(len(axes), max_world) if math.prod(s) >= min_world),
                   key=lambda s: (math.prod(s), s))
    return st.sampled_from(sizes).map(lambda s: DeviceMesh(**dict(zip(axes, s))))


@dataclass(frozen=True, eq=False)
class Layout:
    """A mesh and a parallelism for the composed GPT program (simcluster.parallel.composed) that it can run."""

    mesh: DeviceMesh
    parallelism: Parallelism

    def __repr__(self) -> str:
        p, d = self.parallelism, self.parallelism.data
        degrees = ", ".join(f"{a}={n}" for a, n in (self.mesh.sizes | {"ep": self.mesh.ep}).items())
        return (f"Layout({degrees}, schedule={p.schedule.value}, virtual={p.virtual}, attention={p.attention}, "
                f"sp={p.sp}, tp_comm_overlap={p.tp_comm_overlap}, tp_async_backward={p.tp_async_backward}, "
                f"scatter_gather={p.scatter_gather}, embedding_in_split={p.embedding_in_split}, "
                f"loss_in_split={p.loss_in_split}, zero={d.zero} over {p.zero_over}, "
                f"overlap_param_gather={d.overlap_param_gather}, dualpipe_overlap={p.dualpipe_overlap}, "
                f"micro_batches={d.micro_batches}, "
                f"global_batch={d.global_batch})")

    def assemble(self, results: list[Any], coords: list[dict[str, int]]) -> dict[str, Any]:
        from simcluster.parallel.composed import assemble
        return assemble(results, coords, self.parallelism)

    @property
    def one_device(self) -> Parallelism:
        """The parallelism of the reference run: the same training on one device."""
        return Parallelism(data=self.parallelism.data)

    @property
    def fast_bounds(self) -> Callable[[str], float | None]:
        """The derived fast-mode bound of each output of the training (numerics/tolerance.py)."""
        m, d = self.parallelism.model, self.parallelism.data
        return training_bounds(d.precision, m.layers, max(m.hidden, m.ffn_hidden, m.seq, m.vocab, d.global_batch * m.seq))


def _pipeline_degrees(schedule: Schedule, layers: int, room: int) -> list[int]:
    """The stage counts `schedule` can run with these layers on at most `room` ranks."""
    out = []
    for p in range(1, min(layers, room) + 1):
        if (schedule is Schedule.ZB_V and 2 * p > layers) or (schedule is Schedule.DUALPIPE and p % 2):
            continue
        out.append(p)
    return out


def _micro_batch_counts(schedule: Schedule, p: int, per_rank: int | None) -> list[int]:
    """Micro-batch counts the schedule accepts: among divisors of the sequences a rank gets, or 1, 2,
    p, 2p when the global batch is drawn too."""
    counts = divisors(per_rank) if per_rank else sorted({1, 2, p, 2 * p})
    if schedule is Schedule.INTERLEAVED:
        return [m for m in counts if m % p == 0]
    if schedule is Schedule.DUALPIPE:
        return [m for m in counts if m % 2 == 0 and m >= 2 * p]
    return counts


def layouts(model: ModelConfig, *, max_world: int = 16, global_batch: int | None = None, **training: Any) -> Any:
    """A hypothesis strategy of Layout: every mesh of at most `max_world` ranks, schedule (with virtual
    stages, DualPipe's overlap on or off), context-parallel attention, sequence parallelism (with the
    tensor-parallel collectives under the GEMMs or not; Megatron-LM's column-parallel backward or not), ZeRO stage
    and what it shards over (with the weights' gather under the next forward or not), expert parallelism for a mixture of experts (beside tp only with sequence parallelism), and
    micro-batch count that `Parallelism.check` accepts for `model` -- every divisibility rule honoured by
    construction. `global_batch`: fixed (then dp x micro-batches divides it) or drawn; `training`: the
    other TrainingConfig fields (steps=2 unless given; a `zero` given is kept, not drawn)."""
    from hypothesis import strategies as st

    training = {"steps": 2} | training
    zero = training.pop("zero", None)
    m = model
    schedules = list(Schedule)

    routed = bool(m.moe_experts)  # a mixture of experts: tp needs sp

    @st.composite
    def draw(d: Any) -> Layout:
        tps = [t for t in divisors(math.gcd(m.heads, m.ffn_hidden, m.vocab))
               if t <= max_world and (m.kv_heads % t == 0 or t % m.kv_heads == 0)
               and not (routed and m.seq % t)]
        tp = d(st.sampled_from(tps))
        attention = d(st.sampled_from(ATTENTIONS))
        cps = [c for c in divisors(m.seq) if c * tp <= max_world
               and not (c > 1 and attention in ("ring", "allgather") and m.causal and m.seq % (2 * c))
               and not (c > 1 and attention == "ulysses" and (m.heads // tp) % c)
               and not (routed and tp > 1 and (m.seq // c) % tp)]
        cp = d(st.sampled_from(cps))
        sp = (routed and tp > 1) or (d(st.booleans()) and (m.seq // cp) % tp == 0)
        room = max_world // (tp * cp)
        options = [(s, p) for s in schedules for p in _pipeline_degrees(s, m.layers, room)]
        feasible = []
        for s, p in options:  # with a fixed batch, some (schedule, p) have no dp and micro-batch count
            dps = [n for n in range(1, room // p + 1) if global_batch is None or (
                global_batch % n == 0 and _micro_batch_counts(s, p, global_batch // n))]
            if dps:
                feasible.append((s, p, dps))
        schedule, pp, dps = d(st.sampled_from(feasible))
        virtual = d(st.integers(1, m.layers // pp)) if schedule is Schedule.INTERLEAVED else 1
        dp = d(st.sampled_from(dps))
        # a mixture of experts: expert parallelism over runs of dp ranks
        eps = divisors(math.gcd(dp, m.moe_experts)) if m.moe_experts else [1]
        ep = d(st.sampled_from(eps))
        dispatcher = d(st.sampled_from(DISPATCHERS)) if ep > 1 else "alltoall"
        micro = d(st.sampled_from(_micro_batch_counts(schedule, pp, None if global_batch is None else global_batch // dp)))
        batch = global_batch or dp * micro * d(st.integers(1, 2))
        data = TrainingConfig(model=m, global_batch=batch, micro_batches=micro,
                        zero=d(st.sampled_from([0, 1, 2, 3])) if zero is None else zero,
                        **({"overlap_param_gather": d(st.booleans())} | training))
        parallelism = Parallelism(data=data, sp=sp, attention=attention, schedule=schedule, virtual=virtual,
                    zero_over=d(st.sampled_from(ZERO_OVER)), scatter_gather=d(st.booleans()), ep=ep,
                    dispatcher=dispatcher, dualpipe_overlap=d(st.booleans()),
                    tp_comm_overlap=sp and tp > 1 and d(st.booleans()), tp_async_backward=tp > 1 and d(st.booleans()),
                    embedding_in_split=pp > 1 and d(st.booleans()), loss_in_split=pp > 1 and d(st.booleans()))
        mesh = DeviceMesh(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
        try:
            parallelism.check(dp, pp, cp, tp)
        except ValueError as exc:  # a rule this strategy does not know: a bug here, not in the caller's test
            raise AssertionError(f"simcluster.testing.layouts drew a layout Parallelism.check refuses: {exc}") from exc
        return Layout(mesh, parallelism)

    return draw()
