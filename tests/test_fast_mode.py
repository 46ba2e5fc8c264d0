"""Fast mode computes as a GPU does, every program runs in it for every dtype, and its tolerance
(numerics/tolerance.py) passes every correct layout and fails the broken ones."""

import numpy as np
import pytest

from broken import swapped_tp, unnormalised_merge
from composed_runs import run_composed
from simcluster import report
from simcluster.model.gpt import ModelConfig
from simcluster.numerics import tolerance
from simcluster.numerics import kernels
from simcluster.numerics.limbs import BF16
from simcluster.numerics.modes import make_ops
from simcluster.numerics.tensor import Partial
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.reference import reference
from simcluster.program.mesh import DeviceMesh
from simcluster.testing import Layout, assert_close_fast

LAYOUTS = {  # one of each family, and a 4D hybrid
    "zero3": dict(dp=4, zero=3),
    "tp_sp": dict(dp=2, tp=2, sp=True),
    "pp_1f1b": dict(pp=2, dp=2, schedule="1f1b"),
    "cp_ring": dict(cp=2, dp=2, attention="ring"),
    "cp_ulysses": dict(cp=2, dp=2, attention="ulysses"),
    "4d": dict(pp=2, cp=2, tp=2, sp=True, attention="ring", zero=1),
}


def data(dtype, zero=0, steps=2):
    model = ModelConfig(layers=2, hidden=16, heads=4, ffn_hidden=32, seq=8, vocab=16, tied_head=False, dropout=0.1)
    return TrainingConfig(model=model, global_batch=8, micro_batches=2, steps=steps, precision=dtype, zero=zero)


def bounds_of(cfg):
    m = cfg.model
    return tolerance.training_bounds(cfg.precision, m.layers,
                                     max(m.hidden, m.ffn_hidden, m.seq, m.vocab, cfg.global_batch * m.seq))


def fast_verdict(cfg, **layout):
    got, _ = run_composed(cfg, mode="fast", **layout)
    return report.verification("fast", reference(cfg, "fast"), got, bounds_of(cfg))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_family_runs_in_fast_mode_within_the_derived_bound(name, dtype):
    options = dict(LAYOUTS[name])
    cfg = data(dtype, options.pop("zero", 0))
    mesh = DeviceMesh(**{a: options.pop(a) for a in ("dp", "pp", "cp", "tp") if a in options})
    layout = Layout(mesh, Parallelism(data=cfg, **options))
    compared = [k for k in reference(cfg, "fast") if layout.fast_bounds(k) is not None]
    assert len(compared) == 2 + len(cfg.model.parameter_shapes())  # losses, first gradients
    assert_close_fast(composed, layout.parallelism, mesh=mesh, assemble=layout.assemble, reference=reference(cfg, "fast"),
                      bounds=layout.fast_bounds)  # (simcluster.testing)


def test_sums_accumulate_in_float32_and_round_once():
    """bf16 storage, fp32 accumulation: 4096 ones plus 1/256 each sum to 4112 (exactly a bf16); summed in
    bf16, the 1/256 would vanish against 256 and the sum stall."""
    ops = make_ops("fast")
    x = np.full((4096,), 1 + 2.0**-8, np.float32).astype(BF16)
    assert float(ops.sum(x, None)) == 4096 * float(x[0])
    p = ops.matmul(x.reshape(1, -1), np.ones((4096, 1), BF16), partial=True)
    assert isinstance(p, Partial) and p.dtype == "bf16" and not p.exact  # the accumulator, tagged bf16
    assert float(ops.finalize(p)[0, 0]) == 4096 * float(x[0])


def test_a_16bit_partial_has_its_exact_mode_signature():
    """A pipeline stage receives what its peer sends: the same (partial, dtype, shape) in both modes."""
    from simcluster.numerics.tensor import signature

    a = np.ones((2, 3), BF16)
    for mode in ("exact", "fast"):
        ops = make_ops(mode)
        assert signature(ops.matmul(a, np.ones((3, 4), BF16), partial=True)) == (True, "bf16", (2, 4))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_missing_all_reduce_fails_the_bound(monkeypatch, dtype):
    """DDP that forgets to sum gradients over dp: each rank keeps its own batch's."""
    from simcluster.parallel.dp_wrap import DPWrap

    init = DPWrap.__init__

    def alone(self, ctx, *args, **kw):
        init(self, ctx, *args, **kw)
        self.groups = dict.fromkeys(self.groups, ctx.mesh.tp)  # a group of one here: the all-reduce sums nothing

    monkeypatch.setattr(DPWrap, "__init__", alone)
    verdict = fast_verdict(data(dtype), dp=2)
    assert not verdict["passed"]
    assert verdict["tolerance"]["failing"] > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_swapped_shard_fails_the_bound(dtype):
    verdict = fast_verdict(data(dtype), tp=2, program=swapped_tp)
    assert not verdict["passed"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_wrong_merge_fails_the_bound(monkeypatch, dtype):
    """Ring attention whose merge of blocks forgets to divide by their summed weights."""
    monkeypatch.setattr(kernels, "attention_merge", unnormalised_merge)
    verdict = fast_verdict(data(dtype), cp=2, attention="ring")
    assert not verdict["passed"]
