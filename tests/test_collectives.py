"""Each collective's output equals its mathematical definition, on any group of any size."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcluster.engine import simulate
from simcluster.numerics import limbs
from simcluster.numerics.limbs import BF16
from simcluster.numerics.tensor import Partial, ReduceOp
from simcluster.program.comm import ProgramError
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

KINDS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"]


def one_collective(ctx, kind, axes, inputs, params):
    group = ctx.mesh.group(*axes)
    x = inputs[ctx.rank]
    fn = getattr(ctx.comm, kind)
    if params.get("async"):
        work = fn(x, group=group, async_op=True, **params["kw"](group))
        return (yield work)
    return (yield fn(x, group=group, **params["kw"](group)))


def _value(v):
    return v.limbs if isinstance(v, Partial) else v


@st.composite
def setups(draw):
    dp, tp = draw(st.sampled_from([1, 2, 3, 5])), draw(st.sampled_from([1, 2, 3]))
    mesh = DeviceMesh(dp=dp, tp=tp)
    axes = draw(st.sampled_from([("dp",), ("tp",), ("dp", "tp")]))
    n = mesh.group(0, *axes).size
    kind = draw(st.sampled_from(KINDS))
    flavour = draw(st.sampled_from(["int64", "float32", "bf16", "partial"]))
    op = draw(st.sampled_from([ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN])) if flavour != "partial" else ReduceOp.SUM
    rows = n * draw(st.integers(1, 3))
    cols = n * draw(st.integers(1, 2))  # every dim divisible by the group: any dim may be scattered
    extra = draw(st.sampled_from([(), (n,)]))
    shape = (rows, cols) + extra
    dim = draw(st.integers(0, len(shape) - 1))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    inputs = {}
    for r in range(mesh.world_size):
        ints = rng.integers(-1000, 1000, size=shape)
        if flavour == "int64":
            inputs[r] = ints.astype(np.int64)
        elif flavour == "float32":
            inputs[r] = (ints / 8).astype(np.float32)  # exact in float32: sums are order-free
        elif flavour == "bf16":
            inputs[r] = (ints % 4).astype(BF16)  # 0..3: sums over up to 15 ranks stay exact in bf16
        else:
            inputs[r] = Partial.from_values(rng.standard_normal(shape))
    return mesh, axes, kind, op, dim, inputs, draw(st.booleans())


def expected(kind, op, dim, xs, group, rank, src):
    """The definition, computed directly with numpy (and limbs for partials)."""
    partial = isinstance(xs[0], Partial)
    if partial:
        stacked = np.stack([limbs.to_float(x.limbs, np.float64) for x in xs])  # exact: one term each
        total = limbs.sum_terms(stacked, axis=0)
        total_value = total
    else:
        stacked = np.stack(xs).astype(np.float64) if xs[0].dtype == BF16 else np.stack(xs)
        f = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}[op]
        total_value = f(stacked, axis=0).astype(xs[0].dtype)
    me = group.index(rank)
    n = len(group)
    if kind == "all_reduce":
        return total_value
    if kind == "reduce":
        return total_value if rank == src else None
    if kind == "reduce_scatter":
        return np.split(total_value, n, axis=dim)[me]
    if kind == "all_gather":
        return np.concatenate([_value(x) for x in xs], axis=dim)
    if kind == "all_to_all":
        return np.concatenate([np.split(_value(x), n, axis=0)[me] for x in xs], axis=dim)
    if kind == "broadcast":
        return _value(xs[group.index(src)])
    raise AssertionError(kind)


@given(setups())
def test_collective_output_equals_its_definition(setup):
    mesh, axes, kind, op, dim, inputs, use_async = setup

    def kw(group):
        return {"all_reduce": {"op": op}, "reduce": {"op": op, "dst": group.ranks[-1]},
                "reduce_scatter": {"op": op, "dim": dim}, "all_gather": {"dim": dim},
                "all_to_all": {"split_dim": 0, "concat_dim": dim}, "broadcast": {"src": group.ranks[-1]}}[kind]

    cluster = preset("dgx-a100", nodes=1, gpus_per_node=mesh.world_size)
    run = simulate(one_collective, kind, axes, inputs, {"kw": kw, "async": use_async}, mesh=mesh, cluster=cluster)
    for r in range(mesh.world_size):
        group = mesh.group(r, *axes)
        xs = [inputs[m] for m in group.ranks]
        want = expected(kind, op, dim, xs, list(group.ranks), r, group.ranks[-1])
        got = run.results[r]
        if want is None:
            assert got is None
            continue
        got = _value(got)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.tobytes() == want.tobytes(), (kind, r)


def ring(ctx, inputs):
    n = ctx.world_size
    s = ctx.comm.send(inputs[ctx.rank], dst=(ctx.rank + 1) % n, async_op=True)
    r = ctx.comm.recv(src=(ctx.rank - 1) % n, like=inputs[ctx.rank], async_op=True)
    _, got = yield [s, r]
    return got


@given(st.integers(2, 7), st.integers(0, 100))
def test_send_recv_ring_delivers_each_neighbours_tensor(n, seed):
    rng = np.random.default_rng(seed)
    inputs = {r: rng.standard_normal((3, 2)).astype(np.float32) for r in range(n)}
    run = simulate(ring, inputs, mesh=DeviceMesh(dp=n), cluster=preset("dgx-a100", gpus_per_node=n))
    for r in range(n):
        assert run.results[r].tobytes() == inputs[(r - 1) % n].tobytes()


@given(st.permutations(range(5)), st.integers(0, 1000))
def test_partial_all_reduce_is_independent_of_which_rank_holds_which_term(perm, seed):
    rng = np.random.default_rng(seed)
    vals = [rng.standard_normal((4,)) * 10.0 ** rng.integers(-8, 8) for _ in range(5)]

    def prog(ctx, order):
        total = yield ctx.comm.all_reduce(Partial.from_values(vals[order[ctx.rank]]), group=ctx.mesh.dp)
        return total.limbs.tobytes()

    cluster = preset("dgx-a100", gpus_per_node=5)
    a = simulate(prog, list(range(5)), mesh=DeviceMesh(dp=5), cluster=cluster).results
    b = simulate(prog, list(perm), mesh=DeviceMesh(dp=5), cluster=cluster).results
    assert len(set(a + b)) == 1


def uneven(ctx, sends, recv_shift):
    """Rank r sends sends[r][j] rows to rank j (row values name their sender and destination)."""
    group = ctx.mesh.world
    mine = sends[ctx.rank]
    x = np.concatenate([np.full((rows, 3), 10 * ctx.rank + j, np.float32) for j, rows in enumerate(mine)])
    gets = [sends[q][ctx.rank] + (recv_shift if q == 0 and ctx.rank == 1 else 0) for q in range(len(sends))]
    return (yield ctx.comm.all_to_all_rows(x, group=group, send_rows=mine, recv_rows=gets))


@given(st.integers(2, 5).flatmap(lambda n: st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n),
                                                    min_size=n, max_size=n)))
def test_an_uneven_all_to_all_delivers_each_ranks_rows_in_group_order(sends):
    n = len(sends)
    run = simulate(uneven, sends, 0, mesh=DeviceMesh(dp=n), cluster=preset("dgx-a100", gpus_per_node=n))
    for r in range(n):
        want = np.concatenate([np.full((sends[q][r], 3), 10 * q + r, np.float32) for q in range(n)])
        assert run.results[r].tobytes() == want.tobytes()


def test_an_uneven_all_to_all_whose_sizes_disagree_is_refused_naming_both_ranks():
    with pytest.raises(ProgramError, match="rank 0 sends 2 rows to rank 1, which expects 3"):
        simulate(uneven, [[1, 2], [2, 1]], 1, mesh=DeviceMesh(dp=2), cluster=preset("dgx-a100", gpus_per_node=2))


@pytest.mark.parametrize("send,recv,words", [([1], [1, 1], "send_rows must be 2 whole numbers"),
                                             ([1, -1], [1, 1], "none negative"),
                                             ([1, 1], [1, 1], "add up to 2 rows")])
def test_an_uneven_all_to_all_checks_its_sizes_when_issued(send, recv, words):
    def prog(ctx):
        x = np.zeros((3, 2), np.float32)
        return (yield ctx.comm.all_to_all_rows(x, group=ctx.mesh.world, send_rows=send,
                                               recv_rows=recv))
    with pytest.raises(ProgramError, match=words):
        simulate(prog, mesh=DeviceMesh(dp=2), cluster=preset("dgx-a100", gpus_per_node=2))
