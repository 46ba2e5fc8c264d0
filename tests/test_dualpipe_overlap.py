"""DualPipe's overlap (DeepSeek-V3 report, section 3.2.1): a forward and a backward pass of two micro-batches
run together, each computing while the other's communication -- the expert all-to-all above all -- is in
flight. The same numbers as one device; a shorter step, more communication hidden, no less compute; the
same kernels for one layer."""

import json

import pytest

from simcluster.config.scenario import load
from simcluster.engine import CollectiveMismatchError
from simcluster.parallel import pipeline, tape
from simcluster.parallel.pipeline_schedules import PipelineShape, pairs, passes
from simcluster.run.runner import run_scenario


def written(stage: int) -> list[str]:
    return [f"{k}{j}.{g}" for k, j, g in passes("dualpipe", PipelineShape(4, 8), stage)]


def test_the_pairs_are_deepseeks_forward_backward_chunks():
    """Read off deepseek-ai/DualPipe's dualpipe.py step by step for 4 stages and 8 micro-batches. Stage 0
    (h = 0): step 4 runs once, _forward_backward_chunk(0, 1) then (1, 0); step 5 once, a backward then
    (1, 0). Stage 1 (h = 1, a middle stage): step 4 twice, the first F0 and B1 not overlapped ("to further
    reduce bubble size"); no step 5."""
    assert sorted(pairs("dualpipe", PipelineShape(4, 8), 0)) == [7, 9, 12]
    assert [written(0)[i:i + 2] for i in (7, 9, 12)] == [["F3.0", "B5.7"], ["F6.7", "B0.0"], ["F7.7", "B1.0"]]
    assert sorted(pairs("dualpipe", PipelineShape(4, 8), 1)) == [6, 8, 10]
    assert written(1)[4:6] == ["F2.1", "B4.6"]  # (step 4's first, apart)
    assert [written(1)[i:i + 2] for i in (6, 8, 10)] == [["F6.6", "B0.1"], ["F3.1", "B5.6"], ["F7.6", "B1.1"]]
    assert not pairs("zb-v", PipelineShape(4, 8), 0) and not pairs("1f1b", PipelineShape(4, 8), 0)


# scenarios/deepseek_v3.toml's model with its expert-parallel group across nodes (2 GPUs a node, tp inside)
ACROSS = ["cluster.gpus_per_node=2", "cluster.nodes=4", "run.steps=1"]


def one_after_the_other(ctx, first, second):
    """A broken `together`: the paired passes run back to back."""
    return [(yield from first), (yield from second)]


def test_the_overlap_hides_the_all_to_all_under_the_other_pass_with_the_same_numbers(monkeypatch):
    together = run_scenario(load("deepseek_v3", ACROSS)).report
    apart = run_scenario(load("deepseek_v3", ACROSS + ["parallel.dualpipe_overlap=false"])).report
    assert together["verification"]["bit_exact"] and apart["verification"]["bit_exact"]
    assert together["layer"] == apart["layer"]  # (one layer's kernels, though the other pass's come between)
    hidden = [sum(v["hidden_ns"] for v in r["communication_overlap"]["per_rank"].values()) for r in (apart, together)]
    assert apart["step_time_ns"] > together["step_time_ns"] and hidden[1] > hidden[0]
    # (no shorter than its busiest rank's kernels: what is hidden is communication, not compute)
    assert together["step_time_ns"] >= max(b["compute"] for b in together["busy_ns"].values())
    monkeypatch.setattr(pipeline, "together", one_after_the_other)
    broken = run_scenario(load("deepseek_v3", ACROSS)).report
    assert broken["step_time_ns"] == apart["step_time_ns"]


AT_SCALE = ["model.layers=8", "model.moe_first_dense=1", "parallel.dp=16", "parallel.ep=8", "parallel.pp=4",
            "parallel.tp=1", "parallel.sp=false", "model.global_batch=128", "run.numerics=meta",
            "cluster.gpus_per_node=8", "cluster.nodes=8"]


def test_a_replayed_block_takes_its_turns_where_the_python_does(monkeypatch):
    """Meta mode replays a block's recorded work (tape.py); under DualPipe's overlap each recorded wait is a
    turn, so a replay yields it even when its work is already complete. Taped and untaped runs give the same
    report; a replay that skips the complete waits takes its turns elsewhere than its peers
    do, and issues its collectives in another order."""
    def report() -> str:
        r = run_scenario(load("deepseek_v3", AT_SCALE)).report
        return json.dumps({k: v for k, v in r.items() if k != "simulation"}, sort_keys=True)

    taped = report()
    with monkeypatch.context() as m:
        m.setattr(tape.Tapes, "of", classmethod(lambda cls, ctx: None))
        assert report() == taped
    replay = tape.Tapes._replay

    def skipping(self, t, layer, grads, defer):
        every, self.comm.every_wait = self.comm.every_wait, False
        try:
            return (yield from replay(self, t, layer, grads, defer))
        finally:
            self.comm.every_wait = every
    monkeypatch.setattr(tape.Tapes, "_replay", skipping)
    with pytest.raises(CollectiveMismatchError):
        report()
