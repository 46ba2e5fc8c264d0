"""Streams: work on different streams overlaps; explicit dependencies order it; labels reach the trace."""

from simcluster.engine import simulate
from simcluster.program.mesh import DeviceMesh


def test_side_stream_overlaps_and_wait_stream_joins():
    def prog(ctx):
        with ctx.stream("side"):
            ctx.ops.kernel("side-work", flops=1e12, nbytes=0)
        ctx.ops.kernel("main-work", flops=2e12, nbytes=0)
        ctx.wait_stream("side")
        ctx.ops.kernel("after", flops=1e9, nbytes=0)
        return ctx.current_stream

    run = simulate(prog, mesh=DeviceMesh())
    assert run.results == ["compute"]  # the context manager restores the stream
    (side,) = run.trace.lane(0, "side")
    main, after = run.trace.lane(0, "compute")
    assert side.start == main.start == 0  # both streams start at once
    assert after.start == max(side.end, main.end)


def test_without_wait_stream_no_dependency():
    def prog(ctx):
        with ctx.stream("side"):
            ctx.ops.kernel("side-work", flops=1e13, nbytes=0)
        ctx.ops.kernel("after", flops=1e9, nbytes=0)
        return None

    trace = simulate(prog, mesh=DeviceMesh()).trace
    assert trace.lane(0, "compute")[0].start == 0


def test_annotations_label_kernels_and_nest():
    def prog(ctx):
        with ctx.annotate("forward", "F0"):
            ctx.ops.kernel("a", flops=1, nbytes=1)
            with ctx.annotate("backward", "B0"):
                ctx.ops.kernel("b", flops=1, nbytes=1)
            ctx.ops.kernel("c", flops=1, nbytes=1)
        ctx.ops.kernel("d", flops=1, nbytes=1)
        return None

    trace = simulate(prog, mesh=DeviceMesh()).trace
    assert [(e.kind, e.name) for e in trace] == [("forward", "F0/a"), ("backward", "B0/b"), ("forward", "F0/c"),
                                                  ("compute", "d")]
