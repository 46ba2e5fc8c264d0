"""Taping blocks in meta mode (parallel/tape.py) changes the cost of a simulation, never its result."""

import json

import pytest

import simcluster.parallel.tape as tape
from simcluster.config.scenario import load
from simcluster.engine import simulate
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_all

from tests.test_fold import FOLDING

# every family and the 4D hybrids (FOLDING), plus layouts that do not fold and Megatron's own rows
LAYOUTS = [(n, o + ["model.layers=2"] if n == "ring_long_sequence" else o) for n, o in FOLDING] + [
    (None, ["parallel.dp=2", "cluster.gpus_per_node=2", "model.layers=3", "model.dropout=0.1"]),  # the default
    ("megatron_3d", ["parallel.recompute=full"]),
    ("megatron_3d", ["parallel.recompute=none", "parallel.sp=false"]),
    ("llama3_4d", ["parallel.attention=ring"]),
]


@pytest.fixture
def replays(monkeypatch):
    """How many blocks each run replayed from a tape, and how many it recorded."""
    counts = {"replayed": 0, "recorded": 0}
    replay, record = tape.Tapes._replay, tape.Tapes._record

    def counted_replay(self, *a):
        counts["replayed"] += 1
        return (yield from replay(self, *a))

    def counted_record(self, *a):
        counts["recorded"] += 1
        return (yield from record(self, *a))

    monkeypatch.setattr(tape.Tapes, "_replay", counted_replay)
    monkeypatch.setattr(tape.Tapes, "_record", counted_record)
    return counts


def untape(monkeypatch):
    """Taping off: every rank runs each of its blocks (what a taped run must equal)."""
    monkeypatch.setattr(tape.Tapes, "of", classmethod(lambda cls, ctx: None))


def _runs(sc, fold):
    out = run_all(sc, fold=fold)
    return [out] if not sc.variants else [o for _, o in out.variants]


@pytest.mark.parametrize("name,overrides", LAYOUTS, ids=[f"{n or 'default'}{'-' if o else ''}{'-'.join(o)}" for n, o in LAYOUTS])
def test_taped_runs_give_the_untaped_trace_and_report_byte_for_byte(name, overrides, replays, monkeypatch):
    sc = load(name, ["run.numerics=meta"] + overrides)
    taped = _runs(sc, fold=False)
    if sc.parallel.attention == "ring" and sc.parallel.cp > 1:  # its messages' tags name the layer
        assert replays["replayed"] == 0 and replays["recorded"] > 0
    else:
        assert replays["replayed"] > 0, "the scenario must replay blocks from tapes"
    untape(monkeypatch)
    before = dict(replays)
    untaped = _runs(sc, fold=False)
    assert replays == before  # (nothing taped with taping off)
    for t, u in zip(taped, untaped, strict=True):
        assert json.dumps(t.report, sort_keys=True) == json.dumps(u.report, sort_keys=True)
        assert t.result.trace.lanes == u.result.trace.lanes
        assert t.result.trace.to_jsonl() == u.result.trace.to_jsonl()
        assert t.result.trace.memory == u.result.trace.memory


def _program(key_of):
    """Two kinds of block on one rank of a tp pair: a matmul and an all-reduce, of two widths, each run
    three times under its own label; `key_of(width)` is the key each is taped under."""
    def program(ctx):
        tapes = tape.Tapes.of(ctx)
        out = []
        for i, width in enumerate([8, 8, 16, 8, 16, 16]):
            def block(width=width):
                x = ctx.ops.matmul(MetaTensor((4, width), "bf16"), MetaTensor((width, width), "bf16"), partial=True)
                with ctx.annotate("recompute", f"R{i}"):
                    y = yield ctx.comm.all_reduce(x, group=ctx.mesh.tp)
                return ctx.ops.finalize(y)
            with ctx.annotate("forward", f"F{i}"):
                out.append((yield from tapes.run(key_of(width), i, block)))
        return out
    return program


def test_a_wrong_key_is_caught_by_the_comparison(replays):
    """The byte comparison above can fail: a key that leaves out what the work depends on (here the
    width) replays the wrong block, and the trace differs."""
    mesh = DeviceMesh(tp=2)
    right = simulate(_program(lambda w: ("block", w)), mesh=mesh, mode="meta")
    assert replays == {"replayed": 8, "recorded": 4}  # on each of the two ranks
    wrong = simulate(_program(lambda w: "block"), mesh=mesh, mode="meta")
    plain = simulate(_program(lambda w: None), mesh=mesh, mode="meta")
    assert right.trace.to_jsonl() == plain.trace.to_jsonl()
    assert wrong.trace.to_jsonl() != plain.trace.to_jsonl()
    labels = {e.name for e in right.trace.events}
    assert {"F5/matmul_partial", "R5"} <= labels  # relabelled: the call's own label and its recomputation's


def test_a_block_that_holds_memory_is_not_taped(replays):
    """A replay repeats kernels and requests only; a block that does anything else runs every time."""
    def program(ctx):
        tapes = tape.Tapes.of(ctx)
        for i in range(3):
            def block():
                ctx.ops.matmul(MetaTensor((4, 8), "bf16"), MetaTensor((8, 8), "bf16"))
                ctx.memory.hold("activations", f"x{i}", 64)
                return None
                yield
            with ctx.annotate("forward", f"F{i}"):
                yield from tapes.run("block", i, block)
    run = simulate(program, mesh=DeviceMesh(dp=1), mode="meta")
    assert replays == {"replayed": 0, "recorded": 1}
    assert [m.name for m in run.trace.memory] == ["x0", "x1", "x2"]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v", "dualpipe"])
def test_a_backward_that_defers_its_weight_gradients_is_replayed(schedule, monkeypatch):
    """Zero-bubble schedules and DualPipe split each backward pass's weight gradients off into a W pass. The
    B pass is taped too (it was the largest untaped cost: 37 % of `plan llama3_4d --at-scale`); its replay
    hands the recorded weight-gradient thunks to the W pass under the replayed layer's names; the run is
    byte-identical to the untaped one (a replay giving them the recorded layer's names is not); a thunk
    called again replays its first call's kernels."""
    deferring = {"replayed": 0}
    replay = tape.Tapes._replay

    def counted(self, t, layer, grads, defer):
        deferring["replayed"] += defer is not None and bool(t.deferred)
        return (yield from replay(self, t, layer, grads, defer))

    call = tape._Thunk.__call__

    def counted_thunk(self):  # a weight gradient replayed from its first call's kernels
        deferring["thunks"] = deferring.get("thunks", 0) + bool(self.kernels)
        return call(self)

    monkeypatch.setattr(tape.Tapes, "_replay", counted)
    monkeypatch.setattr(tape._Thunk, "__call__", counted_thunk)
    sc = load("pipeline_schedules", ["run.numerics=meta", f"parallel.schedule={schedule}", "model.layers=8"])
    taped = _runs(sc, fold=False)[0]
    assert deferring["replayed"] > 0 and deferring["thunks"] > 0
    untape(monkeypatch)
    untaped = _runs(sc, fold=False)[0]
    assert taped.result.trace.to_jsonl() == untaped.result.trace.to_jsonl()
    assert json.dumps(taped.report, sort_keys=True) == json.dumps(untaped.report, sort_keys=True)

    def misnamed(self, t, layer, grads, defer):  # every replayed thunk under the first layer's names
        return (yield from replay(self, t, 0, grads, defer))

    monkeypatch.undo()  # (taping on again)
    monkeypatch.setattr(tape.Tapes, "_replay", misnamed)
    with pytest.raises(Exception):
        broken = _runs(sc, fold=False)[0]
        assert broken.result.trace.to_jsonl() == untaped.result.trace.to_jsonl()
