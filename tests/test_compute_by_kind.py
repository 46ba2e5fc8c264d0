"""The report's `compute_ns_by_kind`: each rank's compute stream split into GEMMs, fused attention and every other
kernel, by what the cluster times each kernel as (engine/totals.py `kind_of`), summed by the replay as it goes."""

from __future__ import annotations

import pytest

from simcluster.config.scenario import build, load
from simcluster.engine.interpreter import Interpreter
from simcluster.engine.streams import KERNEL, KERNELS
from simcluster.engine.totals import kind_of
from simcluster.run.job import job_of
from simcluster.run.runner import run_scenario

META = ["run.numerics=meta", "run.steps=2"]
LAYOUTS = [
    [],
    ["model.attention_kernel=unfused", "model.dropout=0.1"],
    ["model.arch=llama", "model.kv_heads=2", "parallel.dp=2", "parallel.tp=4", "parallel.recompute=selective"],
    ["parallel.dp=2", "parallel.pp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
     "model.tied_head=false", "model.micro_batch=1", "model.layers=8"],
    ["parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.attention=ring"],
    ["faults.straggler_rank=1", "faults.straggler_factor=1.5"],
]


@pytest.mark.parametrize("sets", LAYOUTS)
def test_every_ranks_kinds_add_up_to_its_compute_streams_busy_time(sets):
    report = run_scenario(build({}, [*META, *sets]), trace=False).report
    kinds = report["compute_ns_by_kind"]
    assert set(kinds) == {r for r, streams in report["busy_ns"].items() if "compute" in streams}
    for rank, by_kind in kinds.items():
        assert set(by_kind) == {"gemm", "attention", "other"}
        assert sum(by_kind.values()) == report["busy_ns"][rank]["compute"]
        assert by_kind["gemm"] > 0 and by_kind["other"] > 0


def test_a_pipelined_run_simulated_short_extends_the_kinds_as_it_extends_the_busy_time():
    """A pipeline of many micro-batches is simulated at two short counts and extended (run/steady.py's rounds):
    the kinds grow with the rest, and still add up."""
    report = run_scenario(load("llama3_4d"), trace=False).report
    for rank, by_kind in report["compute_ns_by_kind"].items():
        assert sum(by_kind.values()) == report["busy_ns"][rank]["compute"]


def recorded(sets: list[str]) -> list[tuple[str, object]]:
    """(name, work) of every kernel the program records on any rank (phase one, before any timing)."""
    sc = build({}, [*META, *sets])
    job = job_of(sc, fold=False)
    interp = Interpreter(job.mesh, job.mode, cost_dtype=sc.model.dtype)
    interp.run(job.program, *job.args)
    out = []
    for state in interp.state.values():
        for stream in state.streams.values():
            for item in stream.items:
                if item[0] == KERNEL:
                    out.append((item[1], item[3]))
                elif item[0] == KERNELS:
                    out += [(op, work) for op, work, _ in item[3]]
    return out


@pytest.mark.parametrize("sets", [LAYOUTS[1], LAYOUTS[2], ["model.arch=llama", "model.kv_heads=2"],
                                  ["parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", "model.moe_top_k=2"]])
def test_a_kernel_is_a_gemm_exactly_when_the_cluster_times_it_by_its_shape(sets):
    """The kinds follow the cluster's own split (topology/cluster.py `kernel_ns`): a GEMM is what records its
    shape (batch, m, n, k), unfused attention's batched products among them; attention is the fused kernels."""
    kernels = recorded(sets)
    assert kernels
    for name, work in kernels:
        kind = kind_of(name)
        assert (kind == 0) == isinstance(work, tuple), (name, work)
        assert (kind == 1) == name.rpartition("/")[2].startswith("flash_attention"), name
    names = {name.rpartition("/")[2] for name, _ in kernels}
    if "unfused" in " ".join(sets):
        assert "attention_scores" in names and "flash_attention" not in names
