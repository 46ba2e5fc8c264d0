"""Every pipeline schedule on torch.distributed (gloo) gives the emulator's bytes in exact mode."""

import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from byte_compare import assert_same_bytes  # noqa: E402
from gpu_backend.runner import spawn  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.model.gpt import GPTConfig  # noqa: E402
from simcluster.parallel.data_parallel import DPConfig, reference  # noqa: E402
from simcluster.parallel.pipeline import PipelineConfig, assemble, pipeline  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402
from simcluster.topology.presets import preset  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("schedule,p,v,dp", [("gpipe", 2, 1, 2), ("1f1b", 4, 1, 1), ("interleaved", 2, 2, 1),
                                             ("zb-h1", 3, 1, 1)])
def test_gloo_matches_the_emulator_byte_for_byte(schedule, p, v, dp):
    model = GPTConfig(layers=p * v + 1, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False, dropout=0.1)
    m = 2 * p
    data = DPConfig(model=model, global_batch=dp * m, micro_batches=m, steps=2, precision="bf16")
    cfg = PipelineConfig(data=data, schedule=schedule, virtual=v)
    mesh = DeviceMesh(dp=dp, pp=p)
    real = spawn(pipeline, cfg, mesh=mesh, backend="gloo")
    emulated = simulate(pipeline, cfg, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=dp * p)).results
    coords = [mesh.coords(r) for r in range(mesh.world_size)]
    a, b = assemble(emulated, coords), assemble(real, coords)
    assert_same_bytes(b, a)  # torch.distributed gives the emulator's bytes
    assert_same_bytes(b, reference(data), only_wanted=True)  # and both equal one device
