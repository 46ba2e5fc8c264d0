"""DDP and ZeRO-1/2/3 on torch.distributed (gloo) give the emulator's bytes in exact mode."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from gpu_backend.runner import spawn  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.model.gpt import GPTConfig  # noqa: E402
from simcluster.parallel.data_parallel import DPConfig, assemble, reference  # noqa: E402
from simcluster.parallel.ddp import ddp  # noqa: E402
from simcluster.parallel.zero import zero  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402
from simcluster.topology.presets import preset  # noqa: E402

pytestmark = pytest.mark.torch


def flat(result):
    out = {}
    for key, value in result.items():
        if key == "sharded":
            continue
        if isinstance(value, dict):
            out |= {f"{key}.{k}": np.asarray(v) for k, v in value.items()}
        else:
            out |= {f"{key}[{i}]": np.asarray(v) for i, v in enumerate(value)}
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gloo_matches_the_emulator_byte_for_byte(stage):
    cfg = DPConfig(model=GPTConfig(layers=1, hidden=8, heads=2, ffn_hidden=12, seq=4, vocab=10, dropout=0.1),
                   global_batch=6, micro_batches=2, steps=3, zero=stage, precision="bf16" if stage % 2 else "fp32")
    mesh = DeviceMesh(dp=3)
    program = ddp if stage == 0 else zero
    real = spawn(program, cfg, mesh=mesh, backend="gloo")
    emulated = simulate(program, cfg, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=3)).results
    for r in range(3):
        a, b = flat(emulated[r]), flat(real[r])
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), (stage, r, k)
    # and both equal one device
    got = assemble(real, [mesh.coords(r) for r in range(3)], cfg)
    want = reference(cfg)
    assert all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in want) and got.keys() == want.keys()
