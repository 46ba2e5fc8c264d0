"""ZeRO-Offload and ZeRO-Infinity: copies between memory tiers over PCIe and NVMe, CPU Adam on the
host's cores, memory per tier, the bytes a step moves, and the delayed parameter update (its own
single-device definition, and the overlap it buys)."""

import math

import numpy as np
import pytest

from simcluster.config.scenario import ScenarioError, load
from simcluster.engine import simulate
from simcluster.model.gpt import ModelConfig, train
from simcluster.numerics.modes import make_ops
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.data_parallel import TrainingConfig, padded, unit_size
from simcluster.parallel.parallelism import Parallelism
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_scenario
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import preset

MB = 1 << 20  # fp32 elements of a copy: 4 MiB, so bandwidth shows


def copies(pairs, elements=MB):
    """A program in which every rank copies `elements` fp32 values along each (src, dst), one after
    another, each on its own stream and waited for at once."""
    def program(ctx):
        for src, dst in pairs:
            yield ctx.comm.copy(MetaTensor((elements,), "fp32"), src=src, dst=dst)
    return program


def durations(run, rank=0):
    return [e.end - e.start for e in run.trace if e.rank == rank and e.kind == "copy"]


def test_a_copy_takes_its_latency_plus_its_bytes_over_the_pcie_link():
    spec = preset("dgx-a100", gpus_per_node=1)
    run = simulate(copies([("gpu", "cpu"), ("cpu", "gpu")]), mesh=DeviceMesh(), cluster=spec, mode="meta")
    rate = 32.0 * 0.8  # A100: PCIe Gen4 x16, 32 GB/s each way; 80 % of it for a pinned copy
    assert durations(run) == [5000 + math.ceil(4 * MB / rate)] * 2


def test_a_node_shares_its_nvme_drives_and_a_transfer_runs_at_its_slowest_link():
    spec = preset("dgx-a100", gpus_per_node=8)
    alone = simulate(copies([("gpu", "nvme")]), mesh=DeviceMesh(), cluster=preset("dgx-a100", gpus_per_node=1),
                     mode="meta")
    assert durations(alone) == [5000 + math.ceil(4 * MB / 24.0)]  # NVMe's 24 GB/s, below PCIe's 25.6
    together = simulate(copies([("cpu", "nvme")]), mesh=DeviceMesh(dp=8), cluster=spec, mode="meta")
    assert durations(together, rank=3) == [5000 + math.ceil(8 * 4 * MB / 24.0)]  # eight ranks, one node's drives
    two_nodes = simulate(copies([("cpu", "nvme")]), mesh=DeviceMesh(dp=2), cluster=preset("dgx-a100", gpus_per_node=1,
                         nodes=2), mode="meta")
    assert durations(two_nodes, rank=1) == [5000 + math.ceil(4 * MB / 24.0)]  # each node its own
    names = Cluster(spec)
    assert [names.link_name(x) for x in names.copy_route(9 % 8, "nvme", "gpu")] == ["node0:nvme-read", "rank1:pcie-h2d"]


def test_cpu_adam_runs_at_the_presets_throughput_shared_by_the_nodes_gpus():
    n = 1 << 22

    def program(ctx):
        with ctx.stream("cpu"):
            p = MetaTensor((n,), "fp32")
            ctx.ops.adam(p, p, p, p, 1, lr=1e-3)
        yield from ()

    for name, gpus, rate in (("dgx-a100", 8, 7.3), ("dgx-h100", 8, 11.0), ("dgx-a100", 2, 7.3)):
        run = simulate(program, mesh=DeviceMesh(dp=gpus), cluster=preset(name, gpus_per_node=gpus), mode="meta")
        (event,) = [e for e in run.trace if e.stream == "cpu" and e.rank == gpus - 1]
        # n parameters at the node's rate over its GPUs (rate: billions a second = parameters a ns)
        assert event.end - event.start == math.ceil(n / (rate / gpus)) + 1000


SMALL = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.ffn_hidden=64", "model.seq=16",
         "model.vocab=64", "model.global_batch=8", 'model.dtype="bf16"', "model.tied_head=false",
         "cluster.gpus_per_node=4", "parallel.dp=4", "run.steps=2"]


def run(*extra):
    return run_scenario(load(None, SMALL + list(extra))).report


def owned(dp=4):
    """Parameters in a rank's chunks: each unit's flat buffer padded to a multiple of dp, split dp ways."""
    cfg = ModelConfig(layers=2, hidden=32, heads=4, ffn_hidden=64, seq=16, vocab=64, tied_head=False)
    return sum(padded(unit_size(cfg, u), dp) // dp for u in ["embed", "block0", "block1", "head"])


def rows(report):
    return {(r["group"], r["collective"]): r for r in report["communication"]}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_offload_moves_each_ranks_16_bit_gradients_down_and_weights_up(zero):
    """Ren et al. 2021: 2 psi bytes of fp16 gradients down and 2 psi of parameters up a step (psi: the
    rank's partition); the fp32 master and moments (12 bytes a parameter) in the host's memory."""
    report = run(f"parallel.zero={zero}", 'parallel.offload_optimizer="cpu"')
    assert report["verification"]["passed"]
    r, k = rows(report), owned()
    assert r[("gpu->cpu", "copy")]["bytes_per_rank"] == 2 * 2 * k  # two steps of bf16 gradient chunks
    assert r[("cpu->gpu", "copy")]["bytes_per_rank"] == 2 * 2 * k
    peak = report["memory_peak_bytes"]["0"]
    assert peak["cpu:optimizer"] == 12 * k and "optimizer" not in peak
    assert peak["cpu:gradients"] == 2 * k
    host = report["memory"]["host"]["cpu"]
    assert host["peak_bytes_per_node"] == 4 * peak["cpu"] and host["capacity_bytes_per_node"] == 2048 * 2**30


def test_zero_infinity_keeps_the_weight_chunks_on_nvme_and_fetches_them_for_every_use():
    report = run("parallel.zero=3", 'parallel.offload_optimizer="nvme"', 'parallel.offload_params="nvme"')
    assert report["verification"]["passed"]
    r, k = rows(report), owned()
    peak = report["memory_peak_bytes"]["0"]
    assert peak["nvme:parameters"] == 2 * k and peak["nvme:optimizer"] == 12 * k and "parameters" not in peak
    # each step: the state read and written back (master, m, v: 12 bytes), the new chunks written (2);
    # each unit's chunk read for its forward and again for its backward
    assert r[("nvme->cpu", "copy")]["bytes_per_rank"] == 2 * 12 * k
    assert r[("cpu->nvme", "copy")]["bytes_per_rank"] == 2 * (12 + 2) * k
    assert r[("nvme->gpu", "copy")]["bytes_per_rank"] == 2 * 2 * 2 * k
    assert report["memory"]["host"]["nvme"]["fits"]


def test_the_delayed_update_hides_the_host_step_under_the_next_one():
    slow = "cluster.cpu_adam_gparam_per_s=0.3"  # a host slow enough that its step is about the device's
    serial = run("parallel.zero=2", 'parallel.offload_optimizer="cpu"', slow, "run.steps=4")
    hidden = run("parallel.zero=2", 'parallel.offload_optimizer="cpu"', slow, "run.steps=4", "parallel.delayed_update=true")
    assert serial["verification"]["passed"] and hidden["verification"]["passed"]
    host, device = (serial["busy_ns"]["0"][s] / 4 for s in ("cpu", "compute"))
    assert host > device / 2  # (the premise)
    assert serial["step_time_ns"] >= host + device  # the device waits for the host's step, every step
    # with the update delayed, the shorter of the two runs under the longer: most of it is saved
    assert hidden["step_time_ns"] >= max(host, device)
    assert serial["step_time_ns"] - hidden["step_time_ns"] > 0.75 * min(host, device)


def test_the_delayed_update_computes_each_step_with_the_weights_from_before_the_last_update():
    cfg = ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=8, seq=4, vocab=8, tied_head=False)
    ops = make_ops("exact")
    delayed = train(ops, cfg, steps=2, batch_size=2, delayed_update=True)
    frozen = train(ops, cfg, steps=2, batch_size=2, lr=0.0)  # step 1 at the initial weights too
    plain = train(ops, cfg, steps=2, batch_size=2)
    for k in delayed["grads"]:
        assert delayed["grads"][k].tobytes() == frozen["grads"][k].tobytes()
    assert any(delayed["grads"][k].tobytes() != plain["grads"][k].tobytes() for k in plain["grads"])
    # and the update applies step 1's (stale) gradients to the master that step 0 updated
    assert any(delayed["params"][k].tobytes() != plain["params"][k].tobytes() for k in plain["params"])


def test_a_run_with_the_delayed_update_fails_against_the_plain_reference(monkeypatch):
    """The verification compares with the delayed definition: told the plain one, it fails."""
    import simcluster.run.job as job

    plain = job.reference

    def without_delay(cfg, mode="exact"):
        from dataclasses import replace
        return plain(replace(cfg, delayed_update=False), mode)
    monkeypatch.setattr(job, "reference", without_delay)
    report = run("parallel.zero=2", 'parallel.offload_optimizer="cpu"', "parallel.delayed_update=true")
    assert not report["verification"]["passed"]


@pytest.mark.parametrize("fields,says", [
    (dict(zero=0, offload_optimizer="cpu"), "needs zero = 1, 2 or 3"),
    (dict(zero=2, offload_params="cpu"), "needs zero = 3, not 2"),
    (dict(zero=2, offload_optimizer="disk"), "valid: none, cpu, nvme"),
])
def test_offloading_what_a_stage_does_not_shard_is_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        TrainingConfig(**fields)


def test_scenario_mistakes_are_one_line_errors():
    with pytest.raises(ScenarioError, match="delayed parameter update is not modelled"):
        run("parallel.zero=2", "parallel.delayed_update=true", 'run.save_checkpoint="/tmp/x"')
    with pytest.raises(ScenarioError, match="valid: none, cpu, nvme"):
        load(None, SMALL + ['parallel.offload_optimizer="ram"'])


def test_a_copy_between_one_tier_and_itself_is_refused():
    def program(ctx):
        yield ctx.comm.copy(np.zeros(2, np.float32), src="cpu", dst="cpu")
    with pytest.raises(Exception, match="src and dst are both 'cpu'"):
        simulate(program, mesh=DeviceMesh(), cluster=preset("dgx-a100", gpus_per_node=1))


def test_nvme_offload_folds_data_parallel_replicas_only():
    """A node's ranks share its drives: folding tp (or cp) peers would leave their transfers out."""
    cfg = ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=8, seq=4, vocab=8)
    assert Parallelism(data=TrainingConfig(model=cfg, zero=3, offload_params="nvme")).alike(2, 2) == ("dp",)
    assert Parallelism(data=TrainingConfig(model=cfg, zero=3, offload_params="cpu")).alike(2, 2) == ("dp", "tp", "cp")


def test_a_checkpoint_of_an_offloaded_run_resumes_under_another_layout(tmp_path):
    """Offloading moves bytes, not state: ZeRO-Infinity's checkpoint resumes as ZeRO-Offload on half the
    ranks, and the steps after it equal the uninterrupted single-device run's."""
    where = f'run.save_checkpoint="{tmp_path / "ck"}"'
    saved = run("parallel.zero=3", 'parallel.offload_optimizer="nvme"', 'parallel.offload_params="nvme"', where,
                "run.save_at_step=1", "run.steps=3")
    resumed = run("parallel.zero=2", 'parallel.offload_optimizer="cpu"', "parallel.dp=2", "cluster.gpus_per_node=2",
                  f'run.resume="{tmp_path / "ck"}"', "run.steps=3")
    assert saved["verification"]["passed"] and resumed["verification"]["passed"]
    assert resumed["steps"] == 2 and resumed["verification"]["outputs_compared"] > 2


def test_dualpipe_with_offloading_is_a_one_line_error():
    with pytest.raises(ScenarioError, match="DualPipe with offloading is not modelled"):
        run("parallel.zero=3", 'parallel.offload_params="cpu"', "parallel.pp=2", "parallel.dp=2",
            'parallel.schedule="dualpipe"', "model.micro_batch=1", "model.global_batch=16")


def test_the_ledger_keeps_each_tier_apart_and_counts_the_device_alone():
    """The torch backend's ledger: ZeRO-1 offloaded holds 'grads' on the device and on the host at once."""
    from simcluster.model.memory import MemoryLedger

    ledger = MemoryLedger()
    ledger.hold("gradients", "grads", 100)
    ledger.hold("gradients", "grads", 30, "cpu")
    ledger.hold("optimizer", "adam", 1000, "nvme")
    assert ledger.peak_total == 100
    assert (ledger.peak("gradients"), ledger.peak("gradients", "cpu"), ledger.peak("optimizer", "nvme")) == (100, 30, 1000)
    ledger.release("gradients", "grads", "cpu")
    with pytest.raises(ValueError, match="unknown memory tier 'ram'"):
        ledger.hold("gradients", "grads", 1, "ram")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("overwritten", [False, True])
def test_the_delayed_update_keeps_the_weights_it_computes_with(monkeypatch, dtype, overwritten):
    """A step's optimizer writes its results into the last step's weights (Ops.adam's donated master; in
    fp32 on the device the working weights are that master; in 16 bits the working chunks are cast into),
    save with the update delayed, whose next step computes with the old weights. The emulator writes in
    place too, so a wrong write shows: the broken variant writes regardless, and the check fails."""
    import simcluster.parallel.dp_wrap as dp_wrap

    if overwritten:
        monkeypatch.setattr(dp_wrap.DPWrap, "_last_weights_free", lambda self: True)
    report = run(f"model.dtype={dtype}", "parallel.delayed_update=true", "run.steps=3")
    assert report["verification"]["passed"] is not overwritten
