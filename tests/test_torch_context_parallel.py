"""Context parallelism on torch.distributed (gloo) gives the emulator's bytes."""

import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from byte_compare import assert_same_bytes  # noqa: E402
from gpu_backend.runner import spawn  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.model.gpt import GPTConfig  # noqa: E402
from simcluster.parallel.context_parallel import CPConfig, assemble, context_parallel  # noqa: E402
from simcluster.parallel.data_parallel import DPConfig, reference  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402
from simcluster.topology.presets import preset  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("attention", ["ulysses", "ring", "allgather"])
def test_gloo_matches_the_emulator_byte_for_byte(attention):
    model = GPTConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=4, vocab=9, dropout=0.1)
    data = DPConfig(model=model, global_batch=2, steps=2, precision="bf16")
    cfg = CPConfig(data=data, attention=attention)
    mesh = DeviceMesh(dp=2, cp=2)
    real = spawn(context_parallel, cfg, mesh=mesh, backend="gloo")
    emulated = simulate(context_parallel, cfg, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=4)).results
    coords = [mesh.coords(r) for r in range(4)]
    a, b = assemble(emulated, coords), assemble(real, coords)
    assert_same_bytes(b, a)  # torch.distributed gives the emulator's bytes
    assert_same_bytes(b, reference(data), only_wanted=True)  # and both equal one device
