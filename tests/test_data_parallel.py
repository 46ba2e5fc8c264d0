"""DDP and ZeRO-1/2/3: bit-exact against one device; broken variants caught; clear errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.reference import reference

from composed_runs import run_composed


def run_dp(cfg, dp, program=composed, mode="exact"):
    return run_composed(cfg, dp=dp, program=program, mode=mode)


@settings(max_examples=8)  # the all-pairs test (test_composed.py) covers the combinations
@given(dp=st.sampled_from([1, 2, 3, 4, 5, 6]), micro=st.sampled_from([1, 2]), stage=st.sampled_from([0, 1, 2, 3]),
       layers=st.integers(1, 2), heads=st.sampled_from([1, 2]), tied=st.booleans(),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]), dropout=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 99))
def test_bit_exact_against_one_device(dp, micro, stage, layers, heads, tied, precision, dropout, seed):
    model = ModelConfig(layers=layers, hidden=4 * heads, heads=heads, ffn_hidden=12, seq=4, vocab=10,
                      tied_head=tied, dropout=dropout, seed=seed)
    cfg = TrainingConfig(model=model, global_batch=dp * micro, micro_batches=micro, steps=3, precision=precision,
                   zero=stage, prefetch=bool(seed % 2))
    got, _ = run_dp(cfg, dp)
    verdict = report.verification("exact", reference(cfg), got)
    assert verdict["bit_exact"], verdict["mismatches"]
    # loss, and every weight, gradient and Adam moment
    assert verdict["outputs_compared"] == 3 + 5 * len(model.parameter_shapes())  # + first-step gradients


def small(**kw):
    return TrainingConfig(model=ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=12, seq=4, vocab=10), global_batch=4,
                    steps=2, **kw)


def test_a_skipped_gradient_bucket_is_caught():
    """DDP that forgets to all-reduce one bucket: replicas diverge and differ from one device."""
    cfg = small()
    want = reference(cfg)
    good, _ = run_dp(cfg, 2)
    assert report.verification("exact", want, good)["bit_exact"]

    def dropped(ctx, cfg):
        real_all_reduce = ctx.comm.all_reduce
        seen = []

        def all_reduce(x, **kw):
            seen.append(1)
            if len(seen) == 2:  # the second bucket: each rank keeps its own partial sum
                kw = dict(kw, group=ctx.mesh.mesh.group(ctx.rank, "tp"))  # a group of one
            return real_all_reduce(x, **kw)

        ctx.comm.all_reduce = all_reduce
        return (yield from composed(ctx, cfg))

    bad, _ = run_dp(cfg, 2, dropped)
    verdict = report.verification("exact", want, bad)
    assert not verdict["bit_exact"]
    assert any(k.endswith("@rank1") for k in bad)  # the two replicas no longer hold the same weights


@pytest.mark.parametrize("kwargs,message", [
    (dict(global_batch=5), "global batch 5 must be divisible by dp=2 x micro-batches=1; dp degrees that divide it: 1, 5"),
    (dict(zero=4), "zero stage 4 does not exist; valid stages: 0 (DDP), 1, 2, 3"),
    (dict(precision="fp8"), "precision 'fp8' is not valid; valid: fp32, bf16, fp16"),
    (dict(micro_batches=0), "micro_batches must be a positive integer, got 0"),
])
def test_bad_configurations_give_clear_errors(kwargs, message):
    with pytest.raises((ValueError, Exception)) as e:
        cfg = TrainingConfig(model=ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=12, seq=4, vocab=10),
                       **{"global_batch": 4, **kwargs})
        run_dp(cfg, 2)
    assert message in str(e.value)
