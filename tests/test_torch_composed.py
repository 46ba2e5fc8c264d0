"""The composed GPT program on torch.distributed (gloo) gives the emulator's bytes in exact mode:
each family alone, and a 4D layout on 8 processes."""

import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from byte_compare import assert_same_bytes  # noqa: E402
from gpu_backend.runner import spawn  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.model.gpt import GPTConfig  # noqa: E402
from simcluster.parallel.composed import assemble, composed  # noqa: E402
from simcluster.parallel.data_parallel import DPConfig, reference  # noqa: E402
from simcluster.parallel.plan import Plan  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402
from simcluster.topology.presets import preset  # noqa: E402

pytestmark = pytest.mark.torch


def same_on_gloo(data, mesh, **options):
    plan = Plan(data=data, **options)
    real = spawn(composed, plan, mesh=mesh, backend="gloo")
    emulated = simulate(composed, plan, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=mesh.world_size)).results
    coords = [mesh.coords(r) for r in range(mesh.world_size)]
    a, b = assemble(emulated, coords, plan), assemble(real, coords, plan)
    assert_same_bytes(b, a)  # torch.distributed gives the emulator's bytes
    assert_same_bytes(b, reference(data), only_wanted=True)  # and both equal one device


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel(stage):
    model = GPTConfig(layers=1, hidden=8, heads=2, ffn_hidden=12, seq=4, vocab=10, dropout=0.1)
    data = DPConfig(model=model, global_batch=6, micro_batches=2, steps=3, zero=stage,
                    precision="bf16" if stage % 2 else "fp32")
    same_on_gloo(data, DeviceMesh(dp=3))


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel(sp):
    model = GPTConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=4, vocab=8, tied_head=True, dropout=0.1)
    data = DPConfig(model=model, global_batch=4, micro_batches=2, steps=2, precision="bf16")
    same_on_gloo(data, DeviceMesh(dp=2, tp=2), sp=sp)


@pytest.mark.parametrize("attention", ["ulysses", "ring", "allgather"])
def test_context_parallel(attention):
    model = GPTConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=4, vocab=9, dropout=0.1)
    data = DPConfig(model=model, global_batch=2, steps=2, precision="bf16")
    same_on_gloo(data, DeviceMesh(dp=2, cp=2), attention=attention)


@pytest.mark.parametrize("schedule,p,v,dp", [("gpipe", 2, 1, 2), ("1f1b", 4, 1, 1), ("interleaved", 2, 2, 1),
                                             ("zb-h1", 3, 1, 1)])
def test_pipeline(schedule, p, v, dp):
    model = GPTConfig(layers=p * v + 1, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False, dropout=0.1)
    m = 2 * p
    data = DPConfig(model=model, global_batch=dp * m, micro_batches=m, steps=2, precision="bf16")
    same_on_gloo(data, DeviceMesh(dp=dp, pp=p), schedule=schedule, virtual=v)


@pytest.mark.parametrize("zero,attention", [(3, "ring")])
def test_4d(zero, attention):
    """pp2 x cp2 x tp2 with SP, dropout and selective recomputation, ZeRO-3 over cp: 8 processes."""
    model = GPTConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=8, vocab=8, tied_head=False, dropout=0.1,
                      recompute="selective")
    data = DPConfig(model=model, global_batch=2, micro_batches=2, steps=2, precision="bf16", zero=zero)
    same_on_gloo(data, DeviceMesh(pp=2, cp=2, tp=2), sp=True, attention=attention, schedule="1f1b")
