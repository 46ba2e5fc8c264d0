"""On a machine with CUDA: a scenario on NCCL, one rank per GPU, from the command line, byte-identical
to the emulator in exact mode and within the derived bound in fast mode (the CPU twins are in
test_torch_composed.py, on gloo)."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.torch]


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_a_scenario_on_nccl_agrees_with_the_emulator(numerics):
    import torch

    n = min(torch.cuda.device_count(), 2)
    args = [sys.executable, "-m", "simcluster.cli", "run", "--backend", "torch", "--dist-backend", "nccl", "--json",
            "--set", f"parallel.dp={n}", "--set", f"cluster.gpus_per_node={n}", "--set", f"run.numerics={numerics}",
            "--set", "run.steps=2", "--set", "model.global_batch=4"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    section = json.loads(done.stdout)["torch"]
    assert section["backend"] == "nccl" and section["device"] == "cuda"
    assert section["against_emulator"]["passed"] and section["verification"]["passed"]
    assert section["memory_measure"] == "torch.cuda.max_memory_allocated"
