"""A GPU under a power limit (`cluster.power_limit_w`) and FlashAttention's own rate
(`cluster.attention_efficiency`): what each slows, and what it leaves alone.

The expected figures come from the sources, not from the code: NVIDIA rates one 132-SM GH100 at 989
dense bf16 TFLOP/s as the 700 W H100 SXM5 and at 835 as the 400 W H100 NVL (the H100 datasheet), so at
400 W a compute-bound kernel must take 989/835 of its 700 W time, and between the two the clock goes
as a power law through both points."""

from __future__ import annotations

import math

import pytest

from simcluster.analysis.estimate import Layout, estimate
from simcluster.cli import main
from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import preset

from kernel_time import A_GEMM, busy_ns

H100 = preset("dgx-h100")
SXM_W, SXM_TFLOPS, NVL_W, NVL_TFLOPS = 700, 989, 400, 835  # NVIDIA H100 datasheet


def test_at_the_nvl_boards_limit_a_gemm_runs_at_the_nvl_boards_rating():
    capped = H100.with_overrides(power_limit_w=float(NVL_W))
    assert busy_ns(capped, A_GEMM) / busy_ns(H100, A_GEMM) == pytest.approx(SXM_TFLOPS / NVL_TFLOPS, rel=1e-4)
    # ... and the attention kernel and any other compute-bound one with it
    for name in ("block0/flash_attention", "block0/flash_attention_backward", "block0/rope"):
        assert busy_ns(capped, 1e12, 0.0, name) / busy_ns(H100, 1e12, 0.0, name) == pytest.approx(
            SXM_TFLOPS / NVL_TFLOPS, rel=1e-4)


@pytest.mark.parametrize("watts", [350, 500, 600, 700])
def test_between_the_ratings_the_clock_follows_the_power_law_through_both(watts):
    exponent = math.log(SXM_TFLOPS / NVL_TFLOPS) / math.log(SXM_W / NVL_W)
    capped = H100.with_overrides(power_limit_w=float(watts))
    assert busy_ns(H100, A_GEMM) / busy_ns(capped, A_GEMM) == pytest.approx((watts / SXM_W) ** exponent, rel=1e-4)
    assert capped.clock_scale == pytest.approx((watts / SXM_W) ** exponent)


def test_memory_bound_kernels_links_and_the_datasheet_peak_keep_their_rates():
    capped = H100.with_overrides(power_limit_w=500.0)
    copy = (1e6, 4e9, "block0/rmsnorm")  # 1 MFLOP moving 4 GB: HBM-bound
    assert busy_ns(capped, *copy) == busy_ns(H100, *copy)
    assert Cluster(capped).capacity == Cluster(H100).capacity
    assert capped.peak_tflops == H100.peak_tflops  # MFU's denominator stays the datasheet's


def test_a_capped_step_is_slower_by_no_more_than_the_clock_and_mfu_falls_with_it():
    args = ["run.numerics=meta", "cluster.preset=dgx-h100", "model.layers=2", "model.hidden=1024", "model.heads=8",
            "model.ffn_hidden=4096", "model.seq=1024", "model.vocab=1024", "model.global_batch=8",
            "cluster.gpus_per_node=2", "parallel.dp=2", "run.steps=1"]
    free, capped = (run_scenario(load(None, args + extra), trace=False).report
                    for extra in ([], ["cluster.power_limit_w=500"]))
    slower = capped["step_time_ns"] / free["step_time_ns"]
    assert 1.0 < slower <= 1 / H100.with_overrides(power_limit_w=500.0).clock_scale + 1e-9
    assert capped["mfu"] == pytest.approx(free["mfu"] / slower, rel=1e-4)
    assert capped["cluster"]["clock_scale"] == pytest.approx(0.9033, abs=1e-4)
    assert "clock_scale" not in free["cluster"]


def test_the_planners_estimate_slows_with_the_clock():
    """One GPU: no communication, so its closed-form step is its compute, slower by the whole clock."""
    args = ["run.numerics=meta", "cluster.preset=dgx-h100", "model.hidden=1024", "model.heads=8", "model.ffn_hidden=4096",
            "model.seq=1024", "model.vocab=1024", "model.global_batch=8", "cluster.gpus_per_node=1", "parallel.dp=1"]
    layout = Layout(tp=1, pp=1, cp=1, dp=1, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    free, capped = (estimate(load(None, args + extra), layout).seconds
                    for extra in ([], [f"cluster.power_limit_w={NVL_W}"]))
    assert capped / free == pytest.approx(SXM_TFLOPS / NVL_TFLOPS, rel=1e-4)


def test_attention_efficiency_sets_the_flash_kernels_rate_and_nothing_elses():
    half = H100.with_overrides(attention_efficiency=H100.attention_efficiency / 2)
    # cuDNN's 631.3 TFLOP/s forward; its backward at 499 of its 609 forward (FlashAttention-3's H100 figures);
    # 0.76 of each through a run (cluster.sustained_compute)
    for name, share in (("block0/flash_attention", 1.0), ("block3/flash_attention_backward", 499 / 609)):
        assert busy_ns(half, 1e12, 0.0, name) == pytest.approx(2 * busy_ns(H100, 1e12, 0.0, name), rel=1e-4)
        assert busy_ns(H100, 1e12, 0.0, name) == pytest.approx(1e12 / (989e3 * 631.3 / 989 * 0.76 * share), abs=1)
    for name in ("block0/flash_merge", "block0/softmax", ""):
        assert busy_ns(half, 1e12, 0.0, name) == busy_ns(H100, 1e12, 0.0, name)
    assert busy_ns(half, A_GEMM) == busy_ns(H100, A_GEMM)


@pytest.mark.parametrize("args, message", [
    (["--set", "cluster.preset=dgx-h100", "--set", "cluster.power_limit_w=800"],
     "cluster.power_limit_w = 800 W is above the H100-SXM5-80GB's rated power (cluster.tdp_w = 700 W)"),
    (["--set", "cluster.preset=dgx-h100", "--set", "cluster.power_limit_w=300"], "is under half the H100-SXM5-80GB's"),
    (["--set", "cluster.preset=tpu-v5p", "--set", "cluster.gpus_per_node=4", "--set", "cluster.power_limit_w=300"],
     "TPU-v5p has none published: set cluster.tdp_w too"),
    (["--set", "cluster.power_limit_w=-5"], "cluster.power_limit_w = -5.0 must be at least 0"),
])
def test_a_power_limit_it_cannot_model_is_one_line_and_exit_2(args, message, capsys):
    assert main(["run", "--set", "run.numerics=meta", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in " ".join(err.split()) and "Traceback" not in err


def test_a_power_limit_on_a_measured_profile_is_refused(tmp_path, capsys):
    from simcluster.topology import profile

    path = tmp_path / "gpu.toml"
    profile.write(path, device="H100", peak_tflops=989.0, peak_tflops_fp32=67.0, memory_gbyte_per_s=3000.0,
                  kernel_overhead_ns=2000, gemm=[profile.Gemm("bf16", 1, 4096, 4096, 4096, 700.0)], link=None, allreduce=[], ranks=1, backend="nccl",
                  memory_gbyte=None, notes=[])
    assert main(["run", "--set", "run.numerics=meta", "--set", f"cluster.profile={path}",
                 "--set", "cluster.preset=dgx-h100", "--set", "cluster.power_limit_w=500"]) == 2
    assert "measure it under the limit (nvidia-smi -pl)" in " ".join(capsys.readouterr().err.split())


def test_a_runs_flash_kernels_take_attention_efficiency_and_unfused_attention_does_not():
    """Through a whole step (the engine's kernel names, labels and all): halving attention_efficiency
    doubles exactly the flash kernels' busy time."""
    args = ["run.numerics=meta", "cluster.preset=dgx-h100", "model.arch=llama", "model.layers=2", "model.hidden=1024",
            "model.heads=8", "model.ffn_hidden=2048", "model.seq=2048", "model.vocab=1024", "model.global_batch=2",
            "cluster.gpus_per_node=1", "parallel.dp=1", "run.steps=1"]

    def busy(extra):
        out = {}  # an op's busy time, less its launch gaps
        for e in run_scenario(load(None, args + extra)).result.full_trace():
            if e.stream == "compute":
                op = e.name.rsplit("/", 1)[-1]
                out[op] = out.get(op, 0) + e.end - e.start - H100.kernel_overhead_ns
        return out

    half = f"cluster.attention_efficiency={H100.attention_efficiency / 2}"
    full, slow = busy([]), busy([half])
    for op in ("flash_attention", "flash_attention_backward"):
        assert slow[op] == pytest.approx(2 * full[op], rel=1e-4)
    assert {k: v for k, v in slow.items() if not k.startswith("flash")} == \
        {k: v for k, v in full.items() if not k.startswith("flash")}
    unfused = ["model.attention_kernel=unfused"]
    assert busy(unfused) == busy(unfused + [half])


def test_the_report_says_the_limit_and_the_clock_it_leaves(capsys):
    args = ["run", "--summary", "--set", "run.numerics=meta", "--set", "cluster.preset=dgx-h100",
            "--set", "cluster.power_limit_w=500"]
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # (the table's lines wrapped)
    assert "8 H100-SXM5-80GB, at 500 W of 700 (clock x 0.903)" in text
    assert main(args[:-2]) == 0
    assert " W of " not in capsys.readouterr().out


def test_a_gpu_profile_notes_the_power_limit_it_was_measured_under(monkeypatch):
    """calibrate's profile notes what nvidia-smi says of the GPU's power limit (its rates are that
    clock's); nothing for a CPU, without nvidia-smi, or from output it cannot read."""
    import subprocess
    import types

    torch = pytest.importorskip("torch")
    from gpu_backend.processes import power_limit_note

    asked = []

    def smi(out):
        def run(args, **kw):
            asked.append(args)
            if out is None:
                raise FileNotFoundError("nvidia-smi")
            return types.SimpleNamespace(stdout=out)
        return run

    gpu = torch.device("cuda", 1)
    monkeypatch.setattr(subprocess, "run", smi("500.00, 700.00, 700.00\n"))
    assert power_limit_note(gpu) == "measured under a 500 W power limit (default 700 W, at most 700 W; nvidia-smi)"
    assert asked[-1][-2:] == ["-i", "1"] and "--query-gpu=power.limit,power.default_limit,power.max_limit" in asked[-1]
    assert power_limit_note(torch.device("cpu")) is None
    for out in (None, "", "[N/A], [N/A], [N/A]\n"):
        monkeypatch.setattr(subprocess, "run", smi(out))
        assert power_limit_note(gpu) is None
