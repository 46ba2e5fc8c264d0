"""The same programs on torch.distributed (gloo, 4 spawned processes) give the emulator's results."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from gpu_backend.backend import spawn  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.numerics.tensor import Partial  # noqa: E402
from simcluster.parallel.collectives_demo import collectives_demo  # noqa: E402
from simcluster.parallel.tp_dp_mlp import MLPConfig, train_mlp  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402

pytestmark = pytest.mark.torch


def test_collectives_demo_on_gloo_matches_the_emulator():
    mesh = DeviceMesh(dp=2, tp=2)
    real = spawn(collectives_demo, 0, mesh=mesh, backend="gloo")
    emulated = simulate(collectives_demo, 0, mesh=mesh).results
    checked = 0
    for r in range(4):
        assert set(real[r]) == set(emulated[r])
        for name, want in emulated[r].items():
            got = real[r][name]
            if want is None:
                assert got is None, (r, name)
            elif isinstance(want, Partial):  # exact partials: byte-identical limbs
                assert got.limbs.tobytes() == want.limbs.tobytes(), (r, name)
            elif want.dtype.kind in "iu" or name.startswith("all_gather"):  # integers, moved data: bytes
                assert got.tobytes() == want.tobytes(), (r, name)
            else:  # floats: the reduction order of gloo may differ from the emulator's
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"rank {r} {name}")
            checked += 1
    assert checked == 4 * 14


@pytest.mark.slow  # (the command-line mlp test in test_torch_composed.py runs by default)
def test_exact_mlp_on_gloo_is_byte_identical_to_the_emulator():
    mesh = DeviceMesh(dp=2, tp=2)
    cfg = MLPConfig(hidden=8, ffn_hidden=16, tokens=8, steps=2)
    real = spawn(train_mlp, cfg, mesh=mesh, backend="gloo")
    emulated = simulate(train_mlp, cfg, mesh=mesh).results
    for r in range(4):
        for name in ("y", "w1", "w2", "dw1", "dw2"):
            assert real[r][name].tobytes() == emulated[r][name].tobytes(), (r, name)
        assert [x.tobytes() for x in real[r]["loss"]] == [x.tobytes() for x in emulated[r]["loss"]]


def test_a_gap_between_measured_and_predicted_is_explained():
    """Past 2x either way the run says what it knows: the prediction's hardware is not this machine's
    (no calibrated profile), the ranks shared too few cores; within 2x it says nothing."""
    import os

    from gpu_backend.scenario_run import apart
    from simcluster.config.scenario import build

    sc = build({}, ["parallel.dp=2", "cluster.gpus_per_node=2"])
    near = {"step_time_s": {"0": 1.5, "1": 1.2}, "predicted_step_time_s": 1.0, "device": "cpu", "processes": 2}
    assert apart(sc, near) == []
    far = dict(near, step_time_s={"0": 370e-3}, predicted_step_time_s=228e-6, processes=(os.cpu_count() or 1) + 1)
    said = " ".join(apart(sc, far))
    assert "1.62e+03x" in said and "dgx-a100" in said and "simcluster calibrate" in said and "shared" in said
    assert apart(sc, dict(near, step_time_s={"0": 0.1})) != []  # (10x faster is apart too)


def test_a_cpu_run_says_whose_memory_the_prediction_fits():
    """The predicted peak (and its 'fits') is the scenario's GPU's; a CPU run's measured peak is host memory:
    the measured table says both, and a GPU run's says nothing of the kind."""
    from rich.console import Console

    from simcluster.viz.outcome_view import measured_table

    section = {"backend": "gloo", "device": "cpu", "memory_measure": "the process's peak resident set (host memory)",
               "step_time_s": {"0": 0.1}, "predicted_step_time_s": 0.1, "peak_memory_bytes": {"0": 2 << 20}}
    report = {"torch": section, "memory": {"capacity_bytes": 80 << 30, "fits": True},
              "cluster": {"device": "A100-SXM4-80GB"}, "memory_peak_bytes": {"0": {"total": 1 << 20}}}

    def shown(rep):
        console = Console(width=200, record=True)
        console.print(measured_table(rep))
        return " ".join(console.export_text().split())
    assert "predicted: on the scenario's A100-SXM4-80GB (85.9 GB each: fits), not this host's memory" in shown(report)
    gpu = dict(report, torch=dict(section, backend="nccl", device="cuda"))
    assert "scenario's" not in shown(gpu)
