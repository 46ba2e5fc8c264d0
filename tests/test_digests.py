"""A rank sends back a digest for each output the emulator computed the same, the output itself only
where it differs (gpu_backend/digests.py); the launcher rebuilds the rank's result byte for byte."""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from byte_compare import assert_same_bytes  # noqa: E402
from gpu_backend.backend import launch, on_host  # noqa: E402
from gpu_backend.digests import Same, Unsent, digest, digests, restore, summarize  # noqa: E402
from simcluster.engine import simulate  # noqa: E402
from simcluster.model.gpt import ModelConfig  # noqa: E402
from simcluster.numerics.tensor import Partial  # noqa: E402
from simcluster.parallel.composed import assemble, composed  # noqa: E402
from simcluster.parallel.data_parallel import TrainingConfig  # noqa: E402
from simcluster.parallel.parallelism import Parallelism  # noqa: E402
from simcluster.program.mesh import DeviceMesh  # noqa: E402
from simcluster.topology.presets import preset  # noqa: E402


def test_a_digest_tells_dtype_shape_kind_and_every_bit_apart():
    x = np.arange(6, dtype=np.float32)
    flipped = x.copy()
    flipped.view(np.uint32)[5] ^= 1  # the last bit of one element
    kinds = [x, flipped, x.astype(ml_dtypes.bfloat16), x.view(np.int32), x.reshape(2, 3), Partial(x.reshape(6, 1), "fp32"),
             Partial(x.reshape(6, 1), "bf16"), x[::2], np.ascontiguousarray(x[::2])]
    found = [digest(v) for v in kinds]
    assert len(set(found[:-1])) == len(found) - 1  # all told apart
    assert found[-2] == found[-1]  # a view hashes as its values, not its memory
    assert digest(np.float32(2.0)) == digest(np.asarray(np.float32(2.0)))  # a scalar as its 0-d array
    assert digest(1.5) is None and digest(None) is None


def test_only_what_differs_is_sent_and_the_result_comes_back_whole():
    emulated = {"loss": [np.float32(2.0), 1.25], "grads": {"a": np.ones((2, 3), np.float32),
                                                           "b": np.arange(4, dtype=np.float64)},
                "note": "step 1", "sum": Partial(np.zeros((3, 1), np.float32), "bf16")}
    mine = {"loss": [np.float32(2.0), 1.25], "grads": {"a": torch.ones(2, 3), "b": torch.arange(4.0, dtype=torch.float64)},
            "note": "step 1", "sum": Partial(torch.zeros(3, 1), "bf16")}
    mine["grads"]["b"][3] = 3.5  # one output differs
    sent, outputs, whole = summarize(mine, digests(emulated), on_host)
    assert (outputs, whole) == (4, 1)  # (the loss, a numpy scalar, counts; the float and the string do not)
    assert isinstance(sent["grads"]["a"], Same) and isinstance(sent["sum"], Same)
    assert isinstance(sent["grads"]["b"], np.ndarray)
    back = restore(sent, emulated)
    assert_same_bytes(back["grads"], on_host(mine)["grads"])
    assert back["note"] == "step 1" and back["loss"][1] == 1.25
    copied = []
    alone, outputs, whole = summarize(mine, None, lambda v: copied.append(v) or on_host(v))  # nothing to compare with
    assert (outputs, whole) == (4, 0) and isinstance(alone["grads"]["b"], Unsent) and isinstance(alone["sum"], Unsent)
    assert all(not isinstance(v, (torch.Tensor, Partial)) for v in copied)  # (no tensor copied to the host)


@pytest.mark.torch
def test_a_broken_rank_sends_what_differs_and_the_comparison_sees_it():
    """Tensor-parallel ranks that compute each other's heads (tests/broken.py): rank 0 against the digests
    of the correct program's emulated run sends its outputs whole, rank 1 against the broken program's
    sends none; the rebuilt result is the broken run's, byte for byte (the emulator's run of it)."""
    from broken import swapped_tp

    model = ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=8, seq=4, vocab=8, tied_head=False)
    parallelism, mesh = Parallelism(data=TrainingConfig(model=model, global_batch=2, micro_batches=1, steps=1)), DeviceMesh(tp=2)
    cluster = preset("dgx-a100", gpus_per_node=2)
    right = simulate(composed, parallelism, mesh=mesh, cluster=cluster).results
    wrong = simulate(swapped_tp, parallelism, mesh=mesh, cluster=cluster).results
    runs = launch(swapped_tp, parallelism, mesh=mesh, backend="gloo", digests=True,
                  expected=[digests(right[0]), digests(wrong[1])])
    assert runs[0].sent >= runs[0].outputs - 1 > 0  # (its first loss the same: the heads' order does not change it)
    assert runs[1].sent == 0 < runs[1].outputs
    back = [restore(runs[0].result, right[0]), restore(runs[1].result, wrong[1])]
    coords = [mesh.coords(r) for r in range(2)]
    assert_same_bytes(assemble(back, coords, parallelism), assemble(wrong, coords, parallelism))
