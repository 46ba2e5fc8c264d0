"""`parallel.grads_fp32`: mixed precision's gradients summed and kept in fp32, as Megatron-LM (bf16) and
torchtitan's FSDP2 (reduce_dtype float32) keep them: what the run computes, what it moves, what it holds."""

from __future__ import annotations

import numpy as np
import pytest

from simcluster.config.scenario import load
from simcluster.model.gpt import ModelConfig, units
from simcluster.parallel import dp_wrap
from simcluster.parallel.data_parallel import TrainingConfig, padded, unit_size
from simcluster.parallel.reference import reference
from simcluster.run.runner import run_scenario
from simcluster.topology.presets import preset

from composed_runs import run_composed

SMALL = ["run.numerics=exact", "run.steps=2", "model.dtype=bf16", "model.layers=2", "model.hidden=64", "model.heads=4",
         "model.ffn_hidden=256", "model.seq=16", "model.vocab=64", "model.global_batch=8"]
LAYOUTS = [["cluster.gpus_per_node=2", "parallel.dp=2", "parallel.zero=0"],
           ["cluster.gpus_per_node=2", "parallel.dp=2", "parallel.zero=1", "model.micro_batch=2"],
           ["cluster.gpus_per_node=4", "parallel.dp=4", "parallel.zero=3"],
           ["cluster.gpus_per_node=8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1"],
           ["cluster.gpus_per_node=4", "model.arch=llama", "parallel.dp=2", "parallel.tp=2", "parallel.zero=2"]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: " ".join(k.split(".")[1] for k in lay[1:]))
def test_fp32_gradients_are_bit_exact_in_every_layout(layout):
    report = run_scenario(load(None, SMALL + layout + ["parallel.grads_fp32=true"]), trace=False).report
    assert report["verification"]["passed"], report["verification"]


def bits(cfg):
    """The reference's last gradients, as float32 bit patterns."""
    out = reference(cfg)
    return {k: np.asarray(v, dtype=np.float32).view(np.uint32) for k, v in out.items() if k.startswith("grads.")}


def test_the_gradients_are_rounded_to_fp32_not_to_bf16():
    """A bf16 gradient has its low 16 bits zero; the fp32 one keeps them, and rounds to the bf16 one."""
    model = ModelConfig(layers=1, hidden=64, heads=4, ffn_hidden=256, seq=16, vocab=64, tied_head=False)
    cfg = TrainingConfig(model=model, global_batch=4, steps=1, precision="bf16")
    sixteen, full = bits(cfg), bits(TrainingConfig(model=model, global_batch=4, steps=1, precision="bf16",
                                                   grads_fp32=True))
    assert sixteen.keys() == full.keys()
    assert all(not (v & 0xFFFF).any() for v in sixteen.values())
    assert sum(int((v & 0xFFFF).astype(bool).sum()) for v in full.values()) > 0.9 * sum(v.size for v in full.values())
    for k, v in full.items():  # round to nearest even, to bf16: the 16-bit run's gradient
        rounded = ((v.astype(np.uint64) + 0x7FFF + ((v >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        assert np.array_equal(rounded, sixteen[k]), k


def test_a_data_parallel_side_that_kept_16_bit_gradients_is_caught(monkeypatch):
    """The broken variant: the shards round their gradients to bf16 while the single device keeps fp32."""
    monkeypatch.setattr(dp_wrap, "grad_dtype", lambda precision, grads_fp32=False: precision)
    report = run_scenario(load(None, SMALL + LAYOUTS[1] + ["parallel.grads_fp32=true"]), trace=False).report
    assert not report["verification"]["passed"]


MODEL = ModelConfig(layers=3, hidden=64, heads=4, ffn_hidden=256, seq=32, vocab=128, tied_head=False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_reduction_moves_4_bytes_a_gradient_and_the_rank_holds_4(stage):
    """Against the 16-bit run (test_zero_measures.py: 2 Psi of 2 bytes, 3 Psi for ZeRO-3): the gradients'
    reduce-scatter (or DDP's all-reduce) moves twice the bytes, the weights' gathers the same; the model
    states hold 2 more bytes a gradient held (Megatron's 18 bytes a parameter for DDP), and no fp32 copy
    of the gradients is made for the step."""
    n = 4
    runs = {}
    for fp32 in (False, True):
        cfg = TrainingConfig(model=MODEL, global_batch=n, steps=1, precision="bf16", zero=stage, grads_fp32=fp32)
        runs[fp32] = run_composed(cfg, dp=n, cluster=preset("dgx-a100", gpus_per_node=n), mode="meta")[1].trace
    elements = MODEL.parameters if stage == 0 else sum(padded(unit_size(MODEL, u), n) for u in units(MODEL))
    owned = sum(padded(unit_size(MODEL, u), n) // n for u in units(MODEL))
    for fp32, trace in runs.items():
        sent = {}
        for e in trace:
            if e.rank == 0 and e.group.startswith("dp") and e.name != "loss":
                sent[e.kind] = sent.get(e.kind, 0) + e.bytes
        grads = sent.get("reduce_scatter", 0) + sent.get("all_reduce", 0)
        want = (2 if stage == 0 else 1) * (4 if fp32 else 2) * elements * (n - 1) / n
        assert grads == pytest.approx(want, abs=8 * len(units(MODEL)))
        if stage:  # the weights' all-gathers: 16-bit either way
            assert sent["all_gather"] == pytest.approx((2 if stage == 3 else 1) * 2 * elements * (n - 1) / n,
                                                       abs=8 * len(units(MODEL)))
        peaks = trace.memory_peaks()[0]
        held = MODEL.parameters if stage < 2 else owned
        assert peaks["gradients"] == (4 if fp32 else 2) * held
    copy = 4 * (MODEL.parameters if stage == 0 else owned)  # the 16-bit run's fp32 gradients for the step
    assert runs[False].memory_peaks()[0]["temporaries"] >= copy
    assert runs[True].memory_peaks()[0]["temporaries"] < copy


def test_the_planners_estimate_moves_what_the_run_does():
    """DDP over two DGX A100 nodes, reducing after the backward: the estimate's all-reduce moves 2 (n-1)/n
    x 4 bytes a parameter instead of 2, at the bus bandwidth of a node's eight 200 Gb/s NICs (8 x 24 GB/s,
    as nccl-tests measure it)."""
    from simcluster.analysis.estimate import Layout, estimate

    sets = ["run.numerics=meta", "model.dtype=bf16", "model.layers=4", "model.hidden=1024", "model.heads=8",
            "model.ffn_hidden=4096", "model.seq=512", "model.vocab=1024", "model.global_batch=16",
            "cluster.nodes=2", "parallel.dp=16", "parallel.overlap_grad_reduce=false"]
    lay = Layout(tp=1, pp=1, cp=1, dp=16, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    sixteen, full = (estimate(load(None, sets + [f"parallel.grads_fp32={v}"]), lay) for v in ("false", "true"))
    psi = run_scenario(lay.scenario(load(None, sets)), trace=False).report["parameters"]
    # (within 3 %: the estimate's Psi leaves out the position embedding and the last norm)
    assert full.seconds - sixteen.seconds == pytest.approx(2 * 15 / 16 * (4 - 2) * psi / (8 * 24e9), rel=0.03)
