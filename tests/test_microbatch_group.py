"""`parallel.microbatch_group`: the interleaved schedule's N, the micro-batches that go through a chunk before
the next chunk's turn (Megatron-LM's --microbatch-group-size-per-vp-stage; Llama 3 405B's pipeline, which set
it so that the micro-batch count need not be a multiple of p). Its order, its bubble and its memory, what it
refuses, and the same bytes as one device."""

from __future__ import annotations

import pytest

import simcluster.parallel.pipeline_schedules as schedules
from simcluster.config.imports import megatron
from simcluster.config.scenario import load
from simcluster.config.schema import ScenarioError
from simcluster.engine import simulate
from simcluster.parallel.pipeline import ACTIVATION, UniformPipeline, pipeline_uniform, uniform_cluster
from simcluster.parallel.pipeline_schedules import PipelineShape, Schedule, interleaved
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_scenario


def forwards(shape, stage):
    """(micro-batch, this stage's chunk) of each forward pass, in order."""
    return [(j, g // shape.stages) for kind, j, g in interleaved(shape, stage) if kind == "F"]


def test_groups_of_n_go_through_each_chunk_in_turn():
    """m = 5 on p = 2 stages of v = 2 chunks with N = 3: micro-batches 0-2 through chunk 0, then chunk 1, then
    3-4 (what is left) through chunk 0 and chunk 1, as Megatron-LM's get_schedule_table orders them. N = p
    (the default) is Narayanan et al.'s schedule: groups of p."""
    assert forwards(PipelineShape(2, 5, 2, 3), 0) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0),
                                                      (3, 1), (4, 1)]
    assert forwards(PipelineShape(2, 4, 2), 1) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    for stage in range(4):
        assert interleaved(PipelineShape(4, 8, 3), stage) == interleaved(PipelineShape(4, 8, 3, 4), stage)


def run(p, m, v, n):
    cfg = UniformPipeline(micro_batches=m, schedule=Schedule.INTERLEAVED, virtual=v, group=n, t_f=1200, t_b=1200,
                          t_w=1200)
    return simulate(pipeline_uniform, cfg, mesh=DeviceMesh(pp=p), cluster=uniform_cluster(p), mode="meta").trace


@pytest.mark.parametrize("p, m, v, n", [(2, 6, 2, 3), (4, 8, 2, 8), (4, 10, 2, 5), (4, 6, 2, 6), (2, 5, 3, 5),
                                        (4, 12, 3, 6), (3, 7, 2, 4)])
def test_any_group_keeps_the_bubble_and_holds_v_minus_1_groups_more(p, m, v, n):
    """The bubble stays (p - 1)(t_f + t_b + t_w)/v on every stage, m a multiple of p or not; stage 0 holds
    the warm-up's 2(p - 1) + (v - 1)N chunk-passes and one more (at most all m v), each 1/v of a stage's
    activations."""
    trace = run(p, m, v, n)
    assert [trace.end - sum(e.duration for e in trace.lane(s, "compute")) for s in range(p)] == [
        (p - 1) * 3600 // v] * p
    held = min(2 * (p - 1) + (v - 1) * n + 1, m * v)  # (all of them, where the warm-up is the whole step)
    assert trace.memory_peaks()[0]["activations"] == held * ACTIVATION // v


def test_a_warm_up_shorter_than_the_groups_is_caught(monkeypatch):
    """The broken variant: the warm-up counted with p where the groups are N > p; a stage then runs a
    backward pass before the forward pass it needs."""
    whole = schedules.interleaved

    def broken(shape, stage):
        ops = whole(shape, stage)
        short = 2 * (shape.stages - stage - 1) + (shape.virtual - 1) * shape.stages
        forward, backward = [o for o in ops if o[0] == "F"], [o for o in ops if o[0] == "B"]
        out = forward[:short]
        for i in range(short, len(forward)):
            out += [forward[i], backward[i - short]]
        return out + backward[len(forward) - short:]
    assert broken(PipelineShape(4, 8, 2, 4), 0) == whole(PipelineShape(4, 8, 2, 4), 0)  # (N = p: the same)
    monkeypatch.setitem(schedules.BUILDERS, Schedule.INTERLEAVED, broken)
    with pytest.raises(Exception, match="releases activations buffer"):
        run(4, 8, 2, 8)


SMALL = ["run.numerics=exact", "run.steps=2", "model.layers=4", "model.hidden=16", "model.heads=2",
         "model.ffn_hidden=32", "model.seq=8", "model.vocab=32", "model.global_batch=3", "model.micro_batch=1",
         "model.tied_head=false", "cluster.gpus_per_node=2", "parallel.dp=1", "parallel.pp=2",
         "parallel.schedule=interleaved", "parallel.virtual_stages=2"]


def test_three_micro_batches_on_two_stages_are_bit_exact_with_a_group_of_three():
    report = run_scenario(load(None, SMALL + ["parallel.microbatch_group=3"]), trace=False).report
    assert report["verification"]["passed"], report["verification"]


@pytest.mark.parametrize("group, said", [
    (0, "multiple of pp=2: .* or parallel.microbatch_group"),
    (1, "micro-batch group N=1 must lie in \\[p, m\\] = \\[2, 3\\]"),
    (4, "micro-batch group N=4 must lie in \\[p, m\\] = \\[2, 3\\]")])
def test_a_group_the_schedule_cannot_run_is_refused_in_one_line(group, said):
    with pytest.raises(ScenarioError, match=said):
        run_scenario(load(None, SMALL + [f"parallel.microbatch_group={group}"]), trace=False)


def test_a_group_that_leaves_fewer_than_p_is_refused():
    with pytest.raises(ValueError, match="m=5 to be a multiple of N=4, or to leave at least p=2"):
        schedules.check(Schedule.INTERLEAVED, PipelineShape(2, 5, 2, 4), layers=4)


def test_megatrons_group_is_imported():
    doc, _ = megatron("--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 2 "
                      "--seq-length 8 --micro-batch-size 1 --global-batch-size 6 --num-layers-per-virtual-pipeline-stage 1 "
                      "--microbatch-group-size-per-vp-stage 3".split(), nodes=1, gpus_per_node=2)
    assert (doc["parallel"]["microbatch_group"], doc["parallel"]["schedule"]) == (3, "interleaved")


def test_the_planners_estimate_holds_the_larger_warm_up():
    """`plan`'s closed form holds stage 0's warm-up too: N = 6 instead of 2 on 2 stages of 2 chunks adds
    (v - 1)(N - p)/v = 2 micro-batches' activations of a stage's layers to the estimate."""
    from simcluster.analysis.estimate import Layout, estimate
    from simcluster.model.activations import layer_activations
    args = ["run.numerics=meta", "model.layers=8", "model.hidden=1024", "model.heads=8", "model.ffn_hidden=4096",
            "model.seq=2048", "model.vocab=1024", "model.global_batch=6", "cluster.gpus_per_node=2",
            "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.dtype=bf16"]
    layout = Layout(tp=1, pp=2, cp=1, dp=1, zero=1, micro_batch=1, recompute="none", schedule="interleaved", virtual=2)
    two, six = (estimate(load(None, args + [f"parallel.microbatch_group={n}"]), layout) for n in (2, 6))
    per_layer = sum(layer_activations(s=2048, b=1, h=1024, a=8, dtype="bf16", attention_kernel="flash",
                                      dropout=False).values())
    assert six.memory_bytes - two.memory_bytes == pytest.approx(2 * 4 * per_layer, rel=1e-9)


def test_fewer_micro_batches_than_stages_are_refused_as_before():
    """Without a group set, m < p is the old refusal (a multiple of p), not a word about N."""
    with pytest.raises(ValueError, match="m=1 to be a multiple of p=2"):
        schedules.check(Schedule.INTERLEAVED, PipelineShape(2, 1, 2), layers=4)
