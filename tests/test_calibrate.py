"""Hardware profiles: `simcluster calibrate` writes one on this CPU; a scenario with a profile is timed by it."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from simcluster.config.scenario import ScenarioError, load
from simcluster.run.runner import run_scenario
from simcluster.topology import profile
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import preset
from simcluster.topology.profile import Gemm


def write_profile(path, scale=1.0, overhead_ns=0, latency_ns=0, sixteen=None, kernels=(), shares_cores=False,
                  rates=(), host_share=()):
    """A made-up profile; `scale` multiplies every rate in it; `sixteen`: its 16-bit run's bandwidth;
    `kernels`: (name, dtype, GB/s) measured one by one; `shares_cores`: a CPU's collectives."""
    gemm = [Gemm(d, 1, s, s, s, scale * r) for d, r0 in (("bf16", 40.0), ("fp32", 10.0))
            for s, r in ((64, r0 / 4), (4096, r0))]
    profile.write(path, device="test device", peak_tflops=scale * 40.0, peak_tflops_fp32=scale * 10.0,
                  memory_gbyte_per_s=scale * 500.0, kernel_overhead_ns=overhead_ns, gemm=gemm,
                  link=(scale * 50.0, latency_ns), allreduce=[], ranks=2, backend="gloo", memory_gbyte=None, notes=[],
                  memory_gbyte_per_s_16bit=sixteen, kernels=[profile.Kernel(*k) for k in kernels],
                  shares_cores=shares_cores, collective_rates=rates, host_share=host_share)
    return path


def test_a_collective_measured_apart_runs_at_its_share_of_the_link(tmp_path):
    """gloo's all-gather and reduce-scatter on a CPU reach a fraction of the rate its all-reduce was
    fitted to (measured here: 0.5-0.6 and 0.3-0.4): calibrate measures them apart, and a run's gathers
    and scatters take that much longer; an all-reduce, not measured apart, is as it was."""
    def step(rates, zero):
        path = write_profile(tmp_path / f"{len(rates)}.toml", rates=rates)
        return run_scenario(load(None, SMALL_DDP + [f"cluster.profile={path}", f"parallel.zero={zero}"])).report["step_time_ns"]
    slow = (("all_gather", 0.01), ("reduce_scatter", 0.01))
    assert step(slow, 3) > step((), 3)
    assert step(slow, 0) == step((), 0)
    assert dict(profile.load(tmp_path / "2.toml").collective_rates) == {"all_gather": 0.01, "reduce_scatter": 0.01}
    with pytest.raises(profile.ProfileError, match="collective_rates must be a table"):
        profile.parse((tmp_path / "2.toml").read_text().replace("all_gather =", "broadcast ="), "p.toml")


SMALL_DDP = ["run.numerics=meta", "model.dtype=fp32", "model.layers=1", "model.hidden=256", "model.heads=4",
             "model.ffn_hidden=1024", "model.seq=64", "model.vocab=512", "parallel.dp=2", "cluster.gpus_per_node=2"]


def test_a_kernel_measured_by_name_runs_at_its_own_bandwidth(tmp_path):
    """calibrate times some kernels alone (the fused AdamW moves its bytes far faster than the mix of
    activation kernels, the weights' generator far slower); a run's kernel of that name, in a run of
    that dtype, is timed at it: in the engine too, where a kernel's name carries its label."""
    slow_adam = write_profile(tmp_path / "a.toml", kernels=[("adam", "fp32", 5.0)])
    cluster = Cluster(profile.apply(preset("dgx-a100"), profile.load(slow_adam)))
    assert cluster.kernel_ns(10.0, 1e6, "fp32", "O0/adam") == 200_000  # 1 MB at 5 GB/s
    assert cluster.kernel_ns(10.0, 1e6, "fp32", "gelu") == cluster.kernel_ns(10.0, 1e6, "bf16", "adam") == 2000

    def adam_ns(path):
        out = run_scenario(load(None, SMALL_DDP + [f"cluster.profile={path}"]))
        return [e.end - e.start for e in out.result.trace if e.name.endswith("/adam")], out.report["step_time_ns"]
    (slow, slow_step), (plain, plain_step) = adam_ns(slow_adam), adam_ns(write_profile(tmp_path / "b.toml"))
    big = [i for i, t in enumerate(plain) if t > 1000]  # (the largest units': memory-bound)
    assert big and len(slow) == len(plain) and all(slow[i] > 50 * plain[i] for i in big)
    assert slow_step > plain_step
    with pytest.raises(profile.ProfileError, match="kernels"):
        profile.parse(slow_adam.read_text().replace('name = "adam", ', ""), "p.toml")


def test_collectives_on_a_cpus_cores_take_turns_with_its_kernels(tmp_path):
    """On a CPU a collective runs on the cores that compute (gloo's threads): calibrate says so, and the
    run's communication then runs on the stream that issued it, overlapping nothing: the step is its
    kernels' time plus its communication's. Without it the gradients' all-reduce hides under the
    backward pass."""
    def overlap(shares):
        """ns of rank 0's communication under its kernels, and its step"""
        path = write_profile(tmp_path / f"{shares}.toml", shares_cores=shares, latency_ns=1000)
        out = run_scenario(load(None, SMALL_DDP + [f"cluster.profile={path}", "model.layers=4"]))
        mine = [e for e in out.result.trace if e.rank == 0 and e.end > e.start]
        comm, kernels = [e for e in mine if e.group], [e for e in mine if not e.group]
        both = sum(max(0, min(c.end, k.end) - max(c.start, k.start)) for c in comm for k in kernels)
        return both, len(comm), out.report["step_time_ns"]
    (serial, n, serial_step), (overlapped, _, overlapped_step) = overlap(True), overlap(False)
    assert n > 0 and serial == 0 and overlapped > 0 and overlapped_step < serial_step
    assert profile.load(tmp_path / "True.toml").shares_cores and not profile.load(tmp_path / "False.toml").shares_cores
    with pytest.raises(profile.ProfileError, match="collectives_share_cores must be true or false"):
        profile.parse((tmp_path / "True.toml").read_text().replace("= true", "= 1"), "p.toml")


def test_a_16bit_run_moves_its_bytes_at_the_bandwidth_measured_for_one(tmp_path):
    """A CPU widens 16-bit data to compute on it: its elementwise kernels move half the bytes in no less
    time, and calibrate measures the bandwidth a 16-bit run's kernels reach apart. A kernel of a 16-bit
    run is timed at it; fp32 at the other; a profile without it times both at the one figure."""
    measured = Cluster(profile.apply(preset("dgx-a100"), profile.load(write_profile(tmp_path / "a.toml", sixteen=125.0))))
    one = Cluster(profile.apply(preset("dgx-a100"), profile.load(write_profile(tmp_path / "b.toml"))))
    assert measured.kernel_ns(10.0, 1e6, "bf16") == measured.kernel_ns(10.0, 1e6, "fp16") == 8000  # 1 MB at 125 GB/s
    assert measured.kernel_ns(10.0, 1e6, "fp32") == one.kernel_ns(10.0, 1e6, "bf16") == 2000  # at 500 GB/s
    assert profile.load(tmp_path / "a.toml").memory_gbyte_per_s_16bit == 125.0
    assert profile.load(tmp_path / "b.toml").memory_gbyte_per_s_16bit is None


def test_a_gemm_runs_at_the_rate_measured_nearest_its_shape(tmp_path):
    spec = profile.apply(preset("dgx-a100"), profile.load(write_profile(tmp_path / "p.toml", overhead_ns=700)))
    cluster = Cluster(spec)
    for m, n, k, rate in ((64, 64, 64, 10.0), (48, 80, 100, 10.0), (4096, 4096, 4096, 40.0),
                          (3000, 5000, 2048, 40.0)):
        flops = 2 * m * n * k
        assert cluster.kernel_ns((1, m, n, k), 0, "bf16") == math.ceil(flops / (rate * 1e3)) + 700
    # fp32 has its own table; fp16 is timed as bf16 (one tensor-core rate)
    assert cluster.kernel_ns((1, 64, 64, 64), 0, "fp32") == math.ceil(2 * 64**3 / 2.5e3) + 700
    assert cluster.kernel_ns((1, 64, 64, 64), 0, "fp16") == cluster.kernel_ns((1, 64, 64, 64), 0, "bf16")
    # the measured figures replace the preset's, and the report says where they came from
    assert (spec.hbm_gbyte_per_s, spec.memory_efficiency, spec.nvlink_bytes_per_ns) == (500.0, 1.0, 50.0)
    assert spec.nic_bytes_per_ns == preset("dgx-a100").nic_bytes_per_ns  # one host measures no NIC
    assert spec.as_dict()["profile"] == str(tmp_path / "p.toml") and spec.as_dict()["device"] == "test device"


def test_a_gemm_writing_partial_sums_runs_at_the_rate_measured_for_those(tmp_path):
    """A CPU writes a 16-bit GEMM's fp32 partial sums (weight gradients) with another kernel than its 16-bit
    GEMM (a third of its rate, measured): a profile measures them apart (`partial = true`), and a GEMM the
    program leaves partial (ops.py records it as GEMM_PARTIAL, in the engine under its label) is timed at
    them; where a profile has none (fp32 here), as any other GEMM of its dtype."""
    from simcluster.numerics.modes import make_ops
    from simcluster.numerics.ops import GEMM_PARTIAL
    import numpy as np

    path = write_profile(tmp_path / "p.toml")
    text = path.read_text().replace("gemm = [", "gemm = [\n  {dtype = \"bf16\", batch = 1, m = 4096, n = 4096, "
                                    "k = 4096, tflops = 5.0, partial = true},")
    path.write_text(text)
    measured = profile.load(path)
    assert [g.partial for g in measured.gemm].count(True) == 1
    cluster = Cluster(profile.apply(preset("dgx-a100"), measured))
    flops = 2 * 4096**3
    assert cluster.kernel_ns((1, 4096, 4096, 4096), 0, "bf16", "B3/" + GEMM_PARTIAL) == math.ceil(flops / 5e3)
    assert cluster.kernel_ns((1, 4096, 4096, 4096), 0, "bf16", "B3/matmul") == math.ceil(flops / 40e3)
    assert cluster.kernel_ns((1, 4096, 4096, 4096), 0, "fp32", GEMM_PARTIAL) == math.ceil(flops / 10e3)
    assert cluster.named_rates  # (the engine keys its durations by name: two GEMMs of one shape differ)
    assert profile.apply(preset("dgx-a100"), measured).matmul_efficiency == 1.0  # (peak: not the partial's)
    # what ops.py records: the name says whether the sums stay partial
    names = []
    ops = make_ops("fast", lambda name, work, nbytes: names.append(name))
    a, b = np.ones((4, 8), np.float32), np.ones((8, 2), np.float32)
    ops.matmul(a, b), ops.matmul(a, b, partial=True), ops.einsum("ik,kj->ij", a, b, partial=True)
    assert names == ["matmul", GEMM_PARTIAL, "einsum_partial"]
    # written and read back; a table of partial GEMMs alone is refused
    profile.write(tmp_path / "q.toml", device="d", peak_tflops=1.0, peak_tflops_fp32=1.0, memory_gbyte_per_s=1.0,
                  kernel_overhead_ns=0, gemm=list(measured.gemm), link=None, allreduce=[], ranks=1, backend="gloo",
                  memory_gbyte=None, notes=[])
    assert profile.load(tmp_path / "q.toml").gemm == measured.gemm
    only = "\n".join(line for line in text.splitlines() if "tflops" not in line or "partial" in line)
    with pytest.raises(profile.ProfileError, match="only partial GEMMs"):
        profile.parse(only, "p.toml")
    fp16_partial = profile.parse(text.replace('"bf16", batch = 1, m = 4096, n = 4096, k = 4096, tflops = 5.0',
                                              '"fp16", batch = 1, m = 4096, n = 4096, k = 4096, tflops = 5.0'), "p.toml")
    assert fp16_partial.dtypes == ("bf16", "fp32")  # (partial-sum GEMMs alone measure no dtype)
    assert fp16_partial.gemm_rate(1, 4096, 4096, 4096, "bf16", partial=True) == 5.0  # (fp16's stand for bf16's)
    with pytest.raises(profile.ProfileError, match="partial must be true or false"):
        profile.parse(text.replace("partial = true", "partial = 1"), "p.toml")


def test_a_profile_twice_as_fast_halves_the_predicted_step(tmp_path):
    """Every rate doubled (GEMMs by shape, memory, links, peaks), no overheads or latencies: every kernel
    and every transfer takes half as long, so the step does (to whole-ns rounding)."""
    base = ["run.numerics=meta", "parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "cluster.gpus_per_node=4",
            "model.layers=2", "model.hidden=256", "model.heads=4", "model.ffn_hidden=1024", "model.seq=128",
            "model.vocab=512", "model.global_batch=8"]
    steps = {}
    for scale in (1.0, 2.0):
        path = write_profile(tmp_path / f"p{scale}.toml", scale)
        steps[scale] = run_scenario(load(None, base + [f"cluster.profile={path}"])).report["step_time_ns"]
    preset_step = run_scenario(load(None, base)).report["step_time_ns"]
    assert abs(2 * steps[2.0] - steps[1.0]) <= 0.002 * steps[1.0], steps
    assert steps[1.0] != preset_step


def test_a_profile_is_found_beside_its_scenario(tmp_path):
    write_profile(tmp_path / "here.toml")
    (tmp_path / "s.toml").write_text('[cluster]\nprofile = "here.toml"\ngpus_per_node = 8\n')
    assert load(str(tmp_path / "s.toml")).cluster_spec().device == "test device"


def test_profile_mistakes_are_one_line(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read the hardware profile"):
        load(None, [f"cluster.profile={tmp_path / 'missing.toml'}"]).cluster_spec()
    (tmp_path / "bad.toml").write_text("device = 'x'\n")
    with pytest.raises(ScenarioError, match="no gemm table"):
        load(None, [f"cluster.profile={tmp_path / 'bad.toml'}"]).cluster_spec()
    p = tmp_path / "fp32only.toml"
    p.write_text(write_profile(tmp_path / "p.toml").read_text().replace('"bf16"', '"fp32"'))
    with pytest.raises(ScenarioError, match="no bf16 GEMMs measured"):
        load(None, [f"cluster.profile={p}", "model.dtype=bf16"]).cluster_spec()
    (tmp_path / "neg.toml").write_text(write_profile(tmp_path / "p.toml").read_text().replace(
        "memory_gbyte_per_s = 500.0", "memory_gbyte_per_s = -1"))
    with pytest.raises(ScenarioError, match="memory_gbyte_per_s must be positive"):
        load(None, [f"cluster.profile={tmp_path / 'neg.toml'}"]).cluster_spec()


torch_required = pytest.mark.skipif(not __import__("importlib").util.find_spec("torch"),
                                    reason="calibrate measures with torch (the test set-up installs it)")


@torch_required
def test_the_link_fit_recovers_alpha_and_beta():
    from gpu_backend.calibrate import fit_link

    sizes = [1 << e for e in range(10, 24, 2)]
    for ranks in (2, 4, 8):
        ring = 2 * (ranks - 1) / ranks
        seconds = [2 * (ranks - 1) * 7e-6 + ring * b / 3e9 for b in sizes]  # 7 us a step, 3 GB/s
        bandwidth, latency = fit_link(sizes, seconds, ranks)
        assert abs(bandwidth - 3.0) < 1e-6 and latency == 7000


@torch_required
def test_a_noisy_link_fit_keeps_a_latency():
    """A slow largest message tips the least-squares line below the origin; the latency is then the
    smallest message's time (an all-reduce of 1 KiB is latency), not zero, which would make a small
    scenario's collectives free (seen on this shared machine: a CPU profile timing a run 3x an A100)."""
    from gpu_backend.calibrate import fit_link

    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 22]
    seconds = [2e-4, 2e-4, 3e-4, 60e-3]  # latency-bound, then one noisy large message
    bandwidth, latency = fit_link(sizes, seconds, 2)
    assert bandwidth > 0 and latency == round(2e-4 / 2 * 1e9)
    # the small messages slowest (seen in the suite: gloo's first calls): no slope at all
    sizes = [4096, 16384, 65536, 262144, 1048576]
    seconds = [3.5e-3, 3.3e-3, 4.27e-4, 4.65e-4, 6.11e-4]
    bandwidth, latency = fit_link(sizes, seconds, 2)
    assert abs(bandwidth - 1048576 / 6.11e-4 / 1e9) < 1e-9 and latency == round(4.27e-4 / 2 * 1e9)


@torch_required
@pytest.mark.torch
def test_calibrate_on_this_cpu_writes_a_profile_that_times_a_run(tmp_path):
    out = tmp_path / "cpu.toml"
    done = subprocess.run([sys.executable, "-m", "simcluster.cli", "calibrate", "--quick", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = profile.load(out)
    assert set(measured.dtypes) == {"bf16", "fp32"} and measured.link_gbyte_per_s > 0
    assert any(g.batch > 1 for g in measured.gemm)  # attention's batched products
    assert {g.dtype for g in measured.gemm if g.partial} == {"bf16"}  # (fp32 partial sums: the same GEMM)
    assert all(g.tflops > 0 for g in measured.gemm) and measured.memory_gbyte_per_s > 0
    assert measured.memory_gbyte_per_s_16bit > 0  # (bf16 was measured: a 16-bit run's bandwidth too)
    assert {(k.name, k.dtype) for k in measured.kernels} >= {("adam", "fp32"), ("uniform", "bf16"), ("cast", "bf16")}
    # and every kernel of a GPT's and a Llama's step as the program calls it, the fused attention's included
    assert {(k.name, k.dtype) for k in measured.kernels} >= {
        (name, dtype) for dtype in ("fp32", "bf16") for name in
        ("flash_attention", "flash_attention_backward", "gelu_backward", "layer_norm", "rms_norm_backward", "swiglu")}
    assert measured.shares_cores  # (2 ranks on the CPU)
    assert {k for k, _ in measured.collective_rates} == {"all_gather", "reduce_scatter"}
    run = subprocess.run([sys.executable, "-m", "simcluster.cli", "run", "--json", "--set", f"cluster.profile={out}",
                          "--set", "run.numerics=meta"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["cluster"]["device"] == measured.device and report["cluster"]["profile"] == str(out)
    # the profile's rates, not the A100's: a CPU core is hundreds of times slower (less on a small, overhead-bound step)
    a100 = run_scenario(load(None, ["run.numerics=meta"])).report["step_time_ns"]
    assert report["step_time_ns"] > 10 * a100


@torch_required
def test_calibrate_mistakes_are_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "simcluster.cli", "calibrate", "--dtypes", "fp8", "-o",
                           str(tmp_path / "x.toml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "dtype 'fp8' is not valid" in done.stderr and "Traceback" not in done.stderr


@torch_required
def test_a_gpu_takes_no_step_profile(monkeypatch):
    """The step profile times each call as the program makes it: a CPU's kernel runs in the call, a GPU's
    after it returns (so its rates would be the launches': on an H100 they predicted 745 s a step for a
    0.22 s one). On a CPU the ranks measure it; on any other device it is not taken."""
    import torch

    from gpu_backend import calibrate

    asked = []
    monkeypatch.setattr(calibrate, "in_processes", lambda *args, **kw: asked.append(args) or [
        ([profile.Kernel("gelu_backward", "bf16", 3.0)], {"bf16": 0.1}),
        ([profile.Kernel("gelu_backward", "bf16", 2.0)], {"bf16": 0.2})])
    said = []
    on_cpu, shares = calibrate.stepped(torch.device("cpu"), 1e-5, ("bf16",), 2, "gloo", 60, said.append)
    assert len(asked) == 1 and [(k.name, k.dtype, k.gbyte_per_s) for k in on_cpu] == [
        ("gelu_backward", "bf16", 2.0), ("gelu_backward", "fp16", 2.0)]  # the slower rank's, and fp16 takes bf16's
    assert shares == [("bf16", 0.2), ("fp16", 0.2)]
    assert calibrate.stepped(torch.device("meta"), 1e-5, ("bf16",), 1, "nccl", 60, said.append) == ([], [])
    assert len(asked) == 1 and "launches" in said[-1]


def test_a_kernel_measured_at_two_sizes_runs_at_the_rate_between_for_its_own(tmp_path):
    """A step profile measures a kernel at two sizes (4 MB at 2 GB/s, 64 MB at 8 GB/s): a call of 16 MB, a
    geometric halfway, runs at 4 GB/s (log-linear between them); below the smallest and above the largest, at
    theirs; a kernel measured without a size at its one rate everywhere. The sizes survive the file."""
    path = write_profile(tmp_path / "p.toml", kernels=[("gelu", "fp32", 8.0, 64e6), ("gelu", "fp32", 2.0, 4e6),
                                                       ("adam", "fp32", 5.0)])
    cluster = Cluster(profile.apply(preset("dgx-a100"), profile.load(path)))
    assert cluster.kernel_ns(1.0, 16e6, "fp32", "L0/gelu") == 4_000_000  # 16 MB at 4 GB/s
    assert cluster.kernel_ns(1.0, 1e6, "fp32", "gelu") == 500_000  # at the smallest's 2 GB/s
    assert cluster.kernel_ns(1.0, 128e6, "fp32", "gelu") == 16_000_000  # at the largest's 8 GB/s
    assert cluster.kernel_ns(1.0, 16e6, "fp32", "adam") == 3_200_000  # its one rate, 5 GB/s
    assert cluster.kernel_ns(1.0, 16e6, "fp32", "relu") == 32_000  # not measured: the elementwise 500 GB/s
    assert profile.kernel_rate(((2.0, 1.0), (4.0, 3.0)), 8.0) == pytest.approx(3 ** 0.5)  # log2 8 = 3, halfway


def test_gemm_rate_ties_go_to_the_first_entry():
    g = (Gemm("fp32", 1, 64, 64, 64, 1.0), Gemm("fp32", 1, 256, 256, 256, 2.0))
    p = profile.Profile("x", "x", 1.0, 1.0, 1.0, 0, g)
    assert p.gemm_rate(1, 128, 128, 128, "fp32") == 1.0  # halfway in log space
    assert replace(p, gemm=g[::-1]).gemm_rate(1, 128, 128, 128, "fp32") == 2.0


def test_a_cpu_profiles_uncharged_calls_lengthen_every_kernel_of_that_dtype(tmp_path):
    """A CPU kernel set spends time in calls the cost model charges nothing for (3-6 % of a step's on this
    CPU): with host_share = {fp32 = 0.5} every fp32 kernel, its launch included, takes 1.5x; a bf16 one as
    it was. Out-of-range shares are refused in one line."""
    plain = Cluster(profile.apply(preset("dgx-a100"), profile.load(write_profile(tmp_path / "a.toml", overhead_ns=1000))))
    path = write_profile(tmp_path / "b.toml", overhead_ns=1000, host_share=[("fp32", 0.5)])
    shared = Cluster(profile.apply(preset("dgx-a100"), profile.load(path)))
    assert plain.kernel_ns(1.0, 1e6, "fp32") == 3000 and shared.kernel_ns(1.0, 1e6, "fp32") == 4500  # 1 MB at 500 GB/s
    assert shared.kernel_ns(1.0, 1e6, "bf16") == plain.kernel_ns(1.0, 1e6, "bf16")
    with pytest.raises(profile.ProfileError, match="host_share.fp32 must be a number"):
        profile.parse(path.read_text().replace("fp32 = 0.5", "fp32 = -1"), "p.toml")


def test_a_grid_is_timed_in_turns():
    """Each shape timed once a turn: a busy spell of a shared machine then lands on one timing of many
    shapes, and each figure is the median of its own timings."""
    import torch

    from gpu_backend.calibrate import _spread

    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    seconds = _spread(torch.device("cpu"), fns, 3)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3 and len(seconds) == 2 and all(t >= 0 for t in seconds)


def test_weight_sized_kernels_are_measured_at_two_sizes_as_a_step_calls_them():
    """AdamW with the clipping coefficient's pass (2 of its bytes' tensors, then 7: a run clips by default),
    each at a sixteenth of the copy's size and at the copy's; an fp32 run casts nothing (its working weights
    are the master's), so no cast is timed for it."""
    import torch

    from gpu_backend.calibrate import GRIDS, _timer, kernel_rates

    grid = replace(GRIDS[("cpu", True)], copy_bytes=1 << 20)
    rates = kernel_rates(torch.device("cpu"), grid, _timer(torch.device("cpu")), 0.0, "fp32")
    assert [k.name for k in rates] == ["adam", "flatten", "uniform"] * 2
    n = (1 << 20) // 64  # elements at the smaller size
    assert rates[0].nbytes == (2 + 7) / 2 * 4 * n and rates[3].nbytes == 16 * rates[0].nbytes
    assert all(k.gbyte_per_s > 0 for k in rates)
