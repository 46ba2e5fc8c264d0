"""What a GPU's compute-bound kernels keep of their benchmark rates through a training run
(`cluster.sustained_compute`): what it slows, what it leaves alone, and that a measured profile is
taken as it is. The H100's figure is fitted to a published run (topology/presets.py); the fit itself is
checked in tests/test_fidelity.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from simcluster.analysis.estimate import Layout, estimate
from simcluster.cli import main
from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario
from simcluster.topology import profile
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import preset

from kernel_time import A_GEMM, busy_ns

H100, A100 = preset("dgx-h100"), preset("dgx-a100")
SMALL = ["run.numerics=meta", "cluster.preset=dgx-h100", "model.hidden=1024", "model.heads=8", "model.ffn_hidden=4096",
         "model.seq=1024", "model.vocab=1024", "model.global_batch=8", "cluster.gpus_per_node=1", "parallel.dp=1"]


def test_the_h100_keeps_0_76_of_its_benchmark_rates_and_the_a100_all_of_them():
    assert H100.sustained_compute == 0.76 and A100.sustained_compute == 1.0
    assert H100.gemm_tflops == pytest.approx(989 * 0.801 * 0.76)  # MAMF's share of the datasheet peak, sustained


@pytest.mark.parametrize("work,name", [(A_GEMM, ""), (1e12, "block0/flash_attention"),
                                       (1e12, "block0/flash_attention_backward"), (1e12, "block0/rope")])
def test_every_compute_bound_kernel_takes_1_over_its_share_longer(work, name):
    benchmark = H100.with_overrides(sustained_compute=1.0)
    assert busy_ns(H100, work, 0.0, name) / busy_ns(benchmark, work, 0.0, name) == pytest.approx(1 / 0.76, rel=1e-4)


def test_memory_bound_kernels_links_and_the_datasheet_peak_keep_their_rates():
    benchmark = H100.with_overrides(sustained_compute=1.0)
    copy = (1e6, 4e9, "block0/rmsnorm")  # 1 MFLOP moving 4 GB: HBM-bound
    assert busy_ns(H100, *copy) == busy_ns(benchmark, *copy)
    assert Cluster(H100).capacity == Cluster(benchmark).capacity
    assert H100.peak_tflops == 989.0  # MFU's denominator stays the datasheet's


def test_under_a_power_limit_the_two_factors_multiply():
    capped = H100.with_overrides(power_limit_w=500.0)
    assert capped.compute_scale == pytest.approx(capped.clock_scale * 0.76)
    free = capped.with_overrides(sustained_compute=1.0)
    assert busy_ns(capped, A_GEMM) / busy_ns(free, A_GEMM) == pytest.approx(1 / 0.76, rel=1e-4)


def test_a_measured_profile_is_taken_as_it_was_measured(tmp_path):
    path = tmp_path / "h.toml"
    path.write_text('device = "measured"\npeak_tflops = 900.0\npeak_tflops_fp32 = 60.0\nmemory_gbyte_per_s = 3000.0\n'
                    'kernel_overhead_ns = 2000\n'
                    'gemm = [{dtype = "bf16", batch = 1, m = 4096, n = 4096, k = 4096, tflops = 700.0}]\n')
    measured = profile.apply(H100, profile.load(path))
    assert measured.sustained_compute == 1.0
    # a GEMM of the measured shape at the measured rate, nothing taken off it ...
    assert busy_ns(measured, (1, 4096, 4096, 4096)) == pytest.approx(2 * 4096 ** 3 / 700e3, abs=1)
    # ... unless the scenario sets a share (a calibration is a short run too)
    derated = measured.with_overrides(sustained_compute=0.5)
    assert busy_ns(derated, (1, 4096, 4096, 4096)) == pytest.approx(2 * 4096 ** 3 / 350e3, abs=1)


def test_the_planners_estimate_and_the_report_carry_it():
    layout = Layout(tp=1, pp=1, cp=1, dp=1, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    sustained, benchmark = (estimate(load(None, SMALL + extra), layout).seconds
                            for extra in ([], ["cluster.sustained_compute=1.0"]))
    assert sustained / benchmark == pytest.approx(1 / 0.76, rel=1e-4)  # one GPU: its step is compute
    report = run_scenario(load(None, SMALL), trace=False).report
    assert report["cluster"]["sustained_compute"] == 0.76


def test_the_printed_report_says_so_where_a_preset_has_it(capsys):
    small = [a for arg in SMALL if not arg.startswith("cluster.preset") for a in ("--set", arg)]
    for preset_name, says in (("dgx-h100", True), ("dgx-a100", False)):
        assert main(["run", *small, "--set", f"cluster.preset={preset_name}"]) == 0
        out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # (the table's lines joined)
        assert ("at 0.76 of their benchmark rates through a run" in out) is says


@pytest.mark.parametrize("value, message", [("1.5", "cluster.sustained_compute must be in (0, 1], got 1.5"),
                                            ("0", "cluster.sustained_compute must be in (0, 1], got 0.0")])
def test_a_share_outside_0_to_1_is_one_line_and_exit_2(value, message, capsys):
    assert main(["run", "--set", "run.numerics=meta", "--set", f"cluster.sustained_compute={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_the_benchmark_that_would_measure_it_on_a_gpu_runs_here(capsys):
    """benchmarks/sustained_gemm.py (in benchmarks/gpu_session.sh): MAMF's figure, then a sustained load a
    window at a time, and the share kept. On this CPU it proves the script only; its figure is the GPU's."""
    pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from sustained_gemm import main as sustained_gemm

    share = sustained_gemm(["--device", "cpu", "--size", "64", "--seconds", "0.2", "--window", "0.05", "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert "64 x 64 x 64 fp32 on cpu" in out and out.count(" TFLOP/s (") == 4  # four readings
    assert 0 < share and f"kept through the last 0.1 s: {share:.3f} of the MAMF figure" in out
    assert "fitted to a published run: 0.76)" in out  # (the preset's own figure, read from it)
    share = sustained_gemm(["--kernel", "attention", "--device", "cpu", "--size", "128", "--seconds", "0.2", "--window",
                            "0.05", "--dtype", "fp32"])  # (does attention throttle as GEMMs do? the same, for SDPA)
    out = capsys.readouterr().out
    assert "causal attention, 128 tokens x 32 heads of 128, fp32 on cpu" in out and out.count(" TFLOP/s (") == 4
    assert 0 < share and f"kept through the last 0.1 s: {share:.3f} of the MAMF figure" in out
