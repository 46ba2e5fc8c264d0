"""The compute model: GEMMs by tile and wave, fused elementwise kernels, NCCL's share of a link, and
the data-parallel reduction after the backward pass (Megatron-LM 2021) or under it."""

import math

import pytest

from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import preset

A100, H100 = preset("dgx-a100"), preset("dgx-h100")


def gemm_ns(spec, m, n, k, batch=1):
    return Cluster(spec).kernel_ns((batch, m, n, k), 0.0, "bf16")


def ideal_ns(spec, m, n, k, batch=1):
    """2mnk at the achievable matmul rate, plus the launch gap: what a GEMM costs with no quantisation."""
    return math.ceil(2 * batch * m * n * k / (spec.peak_tflops * 1e3 * spec.matmul_efficiency * spec.compute_scale)) + \
        spec.kernel_overhead_ns


def test_a_gemm_that_fills_whole_waves_runs_at_the_achievable_rate():
    # 2048 x 6912 = 16 x 54 tiles of 128 = 864 = 8 waves of 108 SMs exactly
    assert gemm_ns(A100, 2048, 6912, 2304) == ideal_ns(A100, 2048, 6912, 2304)
    # 132 SMs: 16 x 33 tiles = 528 = 4 waves on an H100
    assert gemm_ns(H100, 2048, 33 * 128, 4096) == ideal_ns(H100, 2048, 33 * 128, 4096)


def test_a_partial_wave_costs_a_whole_one():
    # 2048 x 2304: 288 tiles are 2.67 waves: the third wave is paid in full
    assert gemm_ns(A100, 2048, 2304, 2304) == ideal_ns(A100, 2048, 3 * 108 * 128 ** 2 // 2048, 2304)
    # one column past a whole number of waves costs one more wave: 108 tiles (one wave) of 128 x 128
    one_wave = gemm_ns(A100, 128 * 12, 128 * 9, 4096)
    assert gemm_ns(A100, 128 * 12, 128 * 9 + 1, 4096) > 1.9 * one_wave - A100.kernel_overhead_ns
    # ... and a ragged tile costs a whole tile: 129 rows take what 256 do
    assert gemm_ns(A100, 129, 128 * 108, 4096) == gemm_ns(A100, 256, 128 * 108, 4096)


def test_a_narrow_gemm_splits_its_k_and_a_dot_product_is_memory_bound():
    # 16 x 16 output tiles: one tile, split over the SMs along k
    narrow = gemm_ns(A100, 16, 16, 108 * 1024)
    assert narrow == math.ceil(2 * 1024 * 16 * 16 * 108 / (312e3 * 0.859)) + A100.kernel_overhead_ns
    # a dot product of 122 M elements: its bytes, not its padded tile, bound it
    k, nbytes = 122_683_392, 2 * 122_683_392 * 2
    c = Cluster(A100)
    assert c.kernel_ns((1, 1, 1, k), nbytes, "bf16") == math.ceil(nbytes / (A100.hbm_gbyte_per_s * A100.memory_efficiency)) + A100.kernel_overhead_ns


def test_links_carry_what_nccl_gets_of_them():
    c = Cluster(A100)
    assert c.capacity[0] == pytest.approx(300 * 0.8) and c.capacity[2] == pytest.approx(25 * 0.96)


SMALL = ["run.steps=1", "model.layers=2", "model.hidden=64", "model.heads=4", "model.ffn_hidden=256", "model.seq=16",
         "model.vocab=64", "model.global_batch=4", "model.dropout=0.1", "cluster.nodes=1", "cluster.gpus_per_node=4",
         "parallel.dp=2", "parallel.tp=2", "parallel.zero=0"]


def kernels(outcome):
    names = {}
    for e in outcome.result.full_trace():
        if e.stream == "compute":
            op = e.name.rsplit("/", 1)[-1]
            names[op] = names.get(op, 0) + 1
    return names


@pytest.mark.parametrize("attention", ["unfused", "flash"])
def test_fused_kernels_change_the_cost_never_the_numbers(attention):
    runs = {f: run_scenario(load(None, SMALL + [f"model.fused_kernels={str(f).lower()}",
                                               f"model.attention_kernel={attention}"])) for f in (True, False)}
    for o in runs.values():
        assert o.report["verification"]["passed"], o.report["verification"]
    fused, eager = kernels(runs[True]), kernels(runs[False])
    assert fused["bias_gelu"] == eager["gelu"] and "bias_gelu" not in eager
    assert fused["bias_dropout_add"] == 2 * fused["bias_gelu"]  # after attention and after the MLP
    assert "gelu" not in fused and "finalize" not in fused and "finalize" not in eager
    assert ("scale_mask_softmax" in fused) == (attention == "unfused")
    assert sum(fused.values()) < sum(eager.values())
    assert runs[True].report["step_time_ns"] < runs[False].report["step_time_ns"]


def test_dropout_runs_as_pytorchs_dropout_kernels():
    """Unfused attention with dropout (Megatron-LM 2021): per block, one dropout kernel on the
    attention probabilities (reading them, writing them dropped and their 1-byte mask) and the mask
    of each residual branch drawn inside its bias + dropout + add; in backward one masked scale for
    the probabilities' gradient and one for each residual branch, the embeddings' likewise."""
    o = run_scenario(load(None, SMALL + ["model.attention_kernel=unfused"]))
    assert o.report["verification"]["passed"], o.report["verification"]
    forward, backward = {}, {}
    for e in o.result.full_trace([0]):
        if e.stream == "compute" and e.kind in ("forward", "backward") and ":" in e.name:
            unit, op = e.name.split(":", 1)[1].rsplit("/", 1)
            (forward if e.kind == "forward" else backward).setdefault(unit, []).append((op, e.end - e.start))
    layers, b, a, s = 2, 4 // 2, 4 // 2, 16  # micro-batch: the global batch over dp; tp's share of the heads
    assert [op for op, _ in forward["embed"]].count("dropout") == 1
    for i in range(layers):
        ops = [op for op, _ in forward[f"block{i}"]]
        assert ops.count("dropout") == 1 and ops.count("bias_dropout_add") == 2, ops
        assert "dropout_mask" not in ops and "mask" not in ops and "scale" not in ops, ops
        assert [op for op, _ in backward[f"block{i}"]].count("dropout_backward") == 3
        assert not {"dropout_mask", "mask"} & {op for op, _ in backward[f"block{i}"]}
        # the probabilities' dropout: b a s^2 elements read and written in bf16, and a byte of mask each
        ns = dict(forward[f"block{i}"])["dropout"]
        assert ns == math.ceil(b * a * s * s * 5 / (A100.hbm_gbyte_per_s * A100.memory_efficiency)) + A100.kernel_overhead_ns
    assert [op for op, _ in backward["embed"]].count("dropout_backward") == 1


def test_gradient_reduction_after_the_backward_changes_the_time_not_the_numbers():
    runs = {o: run_scenario(load(None, SMALL + [f"parallel.overlap_grad_reduce={str(o).lower()}", "parallel.tp=1",
                                               "parallel.dp=4", "model.layers=4"])) for o in (True, False)}
    for o in runs.values():
        assert o.report["verification"]["passed"], o.report["verification"]
    for overlap, o in runs.items():
        trace = o.result.full_trace([0])
        backward_end = max(e.end for e in trace if e.kind == "backward")
        first_reduce = min(e.start for e in trace if e.stream == "comm:dp" and e.name != "loss")
        assert (first_reduce < backward_end) == overlap, (overlap, first_reduce, backward_end)
    assert runs[False].report["step_time_ns"] > runs[True].report["step_time_ns"]
