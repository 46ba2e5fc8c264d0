"""ZeRO-1/2's gather of the new weights under the next forward pass (parallel.overlap_param_gather,
Megatron's --overlap-param-gather): the same numbers as one device on every layout that waits for other
units' weights (a tied head's embedding on the last stage, a block's experts, DualPipe's two copies); a
shorter step where the gather crosses nodes, by no more than the communication newly hidden."""

import pytest

from simcluster.analysis.estimate import Layout, estimate
from simcluster.config.scenario import load
from simcluster.parallel import dp_wrap
from simcluster.run.runner import run_scenario

ON = "parallel.overlap_param_gather=true"
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden=16"]


@pytest.mark.parametrize("sets", [
    ["parallel.dp=2", "parallel.zero=1", "cluster.gpus_per_node=1", "cluster.nodes=2"],
    ["parallel.dp=2", "parallel.zero=2", "cluster.gpus_per_node=2"],
    ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1", "cluster.gpus_per_node=4", "model.layers=2",
     "model.global_batch=4", "model.micro_batch=1", "model.tied_head=true"],
    ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1", "cluster.gpus_per_node=4", "model.global_batch=8", *MOE],
    ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1", "cluster.gpus_per_node=4", "model.layers=4",
     "parallel.schedule=dualpipe", "model.global_batch=8", "model.micro_batch=1"],
], ids=["zero1-two-nodes", "zero2", "pp2-tied-head", "ep2-experts", "dualpipe"])
def test_the_numbers_are_one_devices(sets):
    v = run_scenario(load(None, [*sets, ON, "run.steps=2"])).report["verification"]  # (step 2 waits in its forward)
    assert v["bit_exact"] and not v["mismatches"], v["mismatches"][:3]


def test_a_unit_that_does_not_wait_for_its_gather_is_caught(monkeypatch):
    """A broken take: a unit's working weights handed out before its gather is waited for (the last step's
    weights in the next step's first forward)."""
    take = dp_wrap.DPWrap.take

    def early(self, unit, ahead=None):
        if self.stage < 3 and unit in self.gathering:
            return self.working
        return (yield from take(self, unit, ahead))
    monkeypatch.setattr(dp_wrap.DPWrap, "take", early)
    r = run_scenario(load(None, ["parallel.dp=2", "parallel.zero=1", "cluster.gpus_per_node=2", ON, "run.steps=2"]))
    assert not r.report["verification"]["bit_exact"]


ACROSS = ["run.numerics=meta", "parallel.dp=4", "cluster.gpus_per_node=2", "cluster.nodes=2", "run.steps=3",
          "model.global_batch=8", "model.hidden=512", "model.ffn_hidden=2048", "model.seq=512"]


@pytest.mark.parametrize("zero", [1, 2])
def test_the_gather_hides_under_the_next_forward(zero):
    apart = run_scenario(load(None, ACROSS + [f"parallel.zero={zero}"])).report
    under = run_scenario(load(None, ACROSS + [f"parallel.zero={zero}", ON])).report
    saved = apart["steady_step_ns"] - under["steady_step_ns"]
    hidden = [r["communication_overlap"]["per_rank"]["0"]["hidden_ns"] for r in (apart, under)]
    assert 0 < saved <= hidden[1] - hidden[0]
    assert apart["memory_peak_bytes"] == under["memory_peak_bytes"]


def test_the_planners_estimate_hides_the_gather_under_a_forward():
    layout = Layout(tp=1, pp=1, cp=1, dp=4, zero=1, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    plain = estimate(load(None, ACROSS + ["parallel.zero=1"]), layout)
    under = estimate(load(None, ACROSS + ["parallel.zero=1", ON]), layout)
    assert under.seconds < plain.seconds and under.memory_bytes == plain.memory_bytes
