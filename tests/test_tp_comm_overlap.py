"""`parallel.tp_comm_overlap`: the sequence-parallel collectives in pieces under the GEMMs beside them
(Megatron-LM's --tp-comm-overlap with its async backward, `parallel.tp_async_backward`; torchtitan's async
TP without it; parallel/tensor_parallel.py). The same bytes as one device, and what the pieces are and
what they hide."""

from __future__ import annotations

import pytest

from simcluster.config.scenario import load
from simcluster.config.schema import ScenarioError
from simcluster.parallel import tensor_parallel
from simcluster.run.runner import run_scenario

SMALL = ["run.numerics=exact", "run.steps=2", "model.layers=2", "model.hidden=32", "model.heads=4",
         "model.ffn_hidden=64", "model.seq=16", "model.vocab=64", "model.global_batch=4", "model.dropout=0.1",
         "parallel.sp=true", "parallel.tp_comm_overlap=true", "parallel.dp=1", "cluster.nodes=1"]
LAYOUTS = [["cluster.gpus_per_node=2", "parallel.tp=2"],
           ["cluster.gpus_per_node=4", "parallel.tp=4", "model.dtype=bf16"],
           ["cluster.gpus_per_node=8", "parallel.tp=2", "parallel.cp=2", "parallel.attention=ring",
            "parallel.dp=2", "parallel.zero=1"],
           ["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb-h1",
            "parallel.recompute=full"],
           ["cluster.gpus_per_node=4", "parallel.tp=4", "model.arch=llama", "model.kv_heads=2",
            "parallel.recompute=op"],
           ["cluster.gpus_per_node=4", "parallel.tp=2", "parallel.dp=2", "model.arch=llama", "model.dtype=fp16",
            "parallel.recompute=selective"]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: " ".join(k.split(".")[1] for k in lay[1:]))
def test_the_overlapped_layout_is_bit_exact_against_one_device(layout):
    """Every other layout with Megatron-LM's backward (Transformer Engine's bulk overlap), the rest
    without (torch's async TP)."""
    backward = LAYOUTS.index(layout) % 2 == 0
    report = run_scenario(load(None, SMALL + layout + [f"parallel.tp_async_backward={str(backward).lower()}"]),
                          trace=False).report
    assert report["verification"]["passed"], report["verification"]


def test_a_ring_that_files_a_part_under_the_wrong_rank_is_caught(monkeypatch):
    """The broken variant: each rank puts the part it holds where the next rank's tokens go (at tp 2 that
    is the right place: tp 4)."""
    monkeypatch.setattr(tensor_parallel, "held", lambda r, step, t: (r + step) % t)
    report = run_scenario(load(None, SMALL + LAYOUTS[1]), trace=False).report
    assert not report["verification"]["passed"]


def test_without_sequence_parallelism_it_is_refused_in_one_line():
    with pytest.raises(ScenarioError, match="parallel.sp = true"):
        run_scenario(load(None, SMALL + LAYOUTS[0] + ["parallel.sp=false"]), trace=False)
    assert run_scenario(load(None, SMALL + ["parallel.sp=false", "run.numerics=meta", "cluster.gpus_per_node=1"]), trace=False)  # tp 1: nothing


BIG = ["run.numerics=meta", "cluster.preset=dgx-h100", "cluster.gpus_per_node=8", "parallel.dp=1", "parallel.tp=8",
       "parallel.sp=true", "model.layers=2", "model.hidden=4096", "model.heads=32", "model.ffn_hidden=16384",
       "model.seq=4096", "model.vocab=32768", "model.global_batch=2", "model.dropout=0"]


FLAGS = {"plain": (False, False), "async": (False, True), "overlap": (True, True), "torch": (True, False)}


def flags(on: str) -> list[str]:
    """The four orders: each collective where it falls, Megatron-LM's async backward, Transformer Engine's
    overlap with it (Megatron-LM's --tp-comm-overlap), and torch's async TP (the overlap without it)."""
    overlap, backward = FLAGS[on]
    return [f"parallel.tp_comm_overlap={str(overlap).lower()}", f"parallel.tp_async_backward={str(backward).lower()}"]


def test_the_pieces_are_transformer_engines_and_hide_the_tensor_parallel_collectives():
    """A block's forward: QKV's and fc1's GEMMs as 8 each (the ring exchange's steps: 7 sends of a rank's
    tokens to the next rank each), the output projections' as 4 each (a quarter of the columns, each
    followed by its piece's reduce-scatter); the all-gathers into a GEMM leave the tp group's calls, the
    forward's reduce-scatters come in 4 pieces. The backward's column-parallel layers run as Megatron-LM's
    do (parallel.tp_async_backward): their input gathered again under the input-gradient GEMM, 2 more
    all-gathers a block, and that gradient's reduce-scatter under the weight gradients, whole. torch's
    async TP (the overlap alone) has the same pieces and rings, keeps the forward's gathered input instead
    of gathering it again, and runs those input gradients (the GPT's: one GEMM each, QKV's and fc1's) in 4
    pieces each under their reduce-scatters, as the forward's output projections. The same step's communication is more hidden: most with both, then the
    overlap alone, then the async backward alone; the step is shortest with both, and either alone beats
    the plain order (which of the two by more depends on the shapes: here the pieces' smaller GEMMs cost
    the overlap alone about what it hides)."""
    t = 8
    runs = {on: run_scenario(load(None, BIG + flags(on))) for on in FLAGS}
    calls = {on: {(c["group"], c["collective"]): c["calls_per_rank"] for c in r.report["communication"]}
             for on, r in runs.items()}
    regathers = calls["async"][("tp", "all_gather")] - calls["plain"][("tp", "all_gather")]
    rings = calls["async"][("tp", "all_gather")] - calls["overlap"][("tp", "all_gather")]
    assert regathers > 0 and rings == 2 * regathers  # (2 a block forward, QKV and fc1; 2 backward, the projections')
    assert calls["async"][("tp", "reduce_scatter")] == calls["plain"][("tp", "reduce_scatter")]
    assert calls["overlap"][("p2p", "send")] == calls["overlap"][("p2p", "recv")] == (t - 1) * rings
    assert calls["overlap"][("tp", "reduce_scatter")] - calls["async"][("tp", "reduce_scatter")] == 3 * rings // 2
    assert ("p2p", "send") not in calls["async"]
    assert calls["torch"][("tp", "all_gather")] == calls["plain"][("tp", "all_gather")] - rings
    assert calls["torch"][("tp", "reduce_scatter")] == calls["overlap"][("tp", "reduce_scatter")] + 3 * regathers
    assert calls["torch"][("p2p", "send")] == calls["overlap"][("p2p", "send")]

    def forward_gemms(on):
        out: dict[str, list[int]] = {}
        for e in runs[on].result.trace.events:
            if e.rank == 0 and e.name.startswith("F0:block0/matmul"):
                out.setdefault(e.name.rsplit("/", 1)[1], []).append(e.end - e.start)
        return out
    whole, pieces = forward_gemms("async"), forward_gemms("overlap")
    assert len(pieces["matmul"]) == t * len(whole["matmul"]) and len(pieces["matmul_partial"]) == 4 * len(
        whole["matmul_partial"])
    assert max(pieces["matmul"][:t]) < whole["matmul"][0] < sum(pieces["matmul"][:t])  # (smaller GEMMs: less efficient)
    hidden = {on: r.report["communication_overlap"]["hidden_fraction"] for on, r in runs.items()}
    steps = {on: r.report["steady_step_ns"] for on, r in runs.items()}
    assert hidden["overlap"] > hidden["torch"] > hidden["async"] > hidden["plain"]
    assert steps["overlap"] < min(steps["torch"], steps["async"]) and max(steps["torch"], steps["async"]) < steps["plain"]


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[4], LAYOUTS[0] + ["parallel.sp=false"]],
                         ids=["gpt sp", "llama op", "gpt no sp"])
def test_megatrons_column_parallel_backward_is_bit_exact(layout):
    """parallel.tp_async_backward alone: the input gathered again (with sp), the reduction under the weight
    gradients (an all-reduce without sp)."""
    report = run_scenario(load(None, SMALL + layout + ["parallel.tp_comm_overlap=false",
                                                       "parallel.tp_async_backward=true"]), trace=False).report
    assert report["verification"]["passed"], report["verification"]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_planners_estimate_charges_what_each_hides(arch):
    """The estimate (analysis/estimate.py) charges a layer's four tp collectives a pass pair; Megatron's
    async backward hides one of the four (the backward's input-gradient reduction), the overlap all but
    one piece of t of the other three, and of that one too where it is one GEMM's (the GPT's; torch's
    async TP leaves the Llama's, a sum, exposed): what each saves against the plain order is a quarter,
    (t - 1)/t of it (the GPT) or three quarters of that (the Llama), and with both flags the quarter and
    three quarters of (t - 1)/t."""
    from simcluster.analysis.estimate import Layout, estimate

    t = 8
    layout = Layout(tp=t, pp=1, cp=1, dp=1, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    big = BIG + [f"model.arch={arch}"] + (["model.kv_heads=8"] if arch == "llama" else [])
    seconds = {on: estimate(load(None, big + flags(on)), layout).seconds for on in FLAGS}
    saved = {on: seconds["plain"] - seconds[on] for on in ("async", "overlap", "torch")}
    assert saved["overlap"] > saved["torch"] > saved["async"] > 0
    alone = (t - 1) / t * (1 if arch == "gpt" else 3 / 4)
    assert saved["torch"] / saved["async"] == pytest.approx(alone / (1 / 4), rel=1e-9)
    assert saved["overlap"] / saved["async"] == pytest.approx((1 / 4 + 3 / 4 * (t - 1) / t) / (1 / 4), rel=1e-9)


def test_a_backward_that_gathers_the_wrong_input_again_is_caught(monkeypatch):
    """The broken variant of the async backward: the input it gathers again for the weight gradients is not
    the one the forward multiplied (twice it), so only a run that uses the re-gathered input is caught."""
    reduce_under = tensor_parallel.reduce_under

    def broken(ctx, partial, then, group, sp, overlap, mine, kept, *rest):
        return (yield from reduce_under(ctx, partial, then, group, sp, overlap, ctx.ops.add(mine, mine), kept, *rest))
    monkeypatch.setattr(tensor_parallel, "reduce_under", broken)
    args = SMALL + LAYOUTS[0] + ["parallel.tp_comm_overlap=false"]
    assert run_scenario(load(None, args + ["parallel.tp_async_backward=false"]), trace=False).report[
        "verification"]["passed"]  # (the forward's gathered input: the broken gather is never used)
    assert not run_scenario(load(None, args + ["parallel.tp_async_backward=true"]), trace=False).report[
        "verification"]["passed"]


def test_reduce_scatter_pieces_put_back_in_the_wrong_order_are_caught(monkeypatch):
    """The broken variant of the pieces a reduce-scatter runs in (the forward's output projections; with the
    overlap alone, the GPT's QKV and fc1 input gradients too): the reduced pieces concatenated last first."""
    def broken(ctx, x, w, group, sp, overlap, local_sum=False):
        ops = ctx.ops
        works = [ctx.comm.reduce_scatter(ops.matmul(x, piece, partial=True), group=group, dim=1, donate=True,
                                         async_op=True) for piece in ops.split(w, tensor_parallel.RS_SPLITS, -1)]
        return ops.concat([ops.finalize(p) for p in (yield works)][::-1], -1)
    args = SMALL + LAYOUTS[1] + ["parallel.tp_async_backward=false"]
    assert run_scenario(load(None, args), trace=False).report["verification"]["passed"]
    monkeypatch.setattr(tensor_parallel, "matmul_reduce", broken)
    assert not run_scenario(load(None, args), trace=False).report["verification"]["passed"]


def test_torchs_reduce_scatters_sum_on_the_compute_stream():
    """torch's fused matmul-reduce-scatter pushes each rank's partial rows to it and sums the tp partials
    with one torch.sum on the compute stream; Transformer Engine's pipelined reduce-scatter sums inside its
    communication kernels. So torch's async TP charges a kernel per fused reduce-scatter (a block's two
    output projections forward; the GPT's QKV and fc1 input gradients backward), reading the 8 partials of
    this rank's output, 2 x 512 tokens x 4,096 bf16, and writing it: (8 + 1) x 8 MiB at the H100 preset's
    3,350 GB/s x 0.8 (its memory_efficiency), about 28 us each; Megatron-LM's order charges none."""
    runs = {on: run_scenario(load(None, BIG + flags(on))) for on in ("overlap", "torch")}
    sums = {on: [e.end - e.start for e in r.result.trace.events
                 if e.rank == 0 and e.name.endswith("/reduce_scatter_sum")] for on, r in runs.items()}
    steps, layers = 3, 2  # (BIG: the default 3 steps, one micro-batch of both sequences each)
    assert sums["overlap"] == [] and len(sums["torch"]) == steps * layers * (2 + 2)
    expected_ns = 9 * 2 * 512 * 4096 * 2 / (3350e9 * 0.8) * 1e9
    assert all(d == pytest.approx(expected_ns, rel=0.05) for d in sums["torch"])
