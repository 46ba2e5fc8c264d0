"""Megatron tensor parallelism: bit-exact, the paper's communication, a broken variant, clear errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.reference import reference

from broken import swapped_tp
from composed_runs import run_composed


def run_tp(data, tp, dp=1, program=composed, mode="exact", sp=False):
    return run_composed(data, dp=dp, tp=tp, program=program, mode=mode, sp=sp)


@settings(max_examples=8)  # the all-pairs test (test_composed.py) covers the combinations
@given(tp=st.sampled_from([1, 2, 3, 4, 6]), dp=st.sampled_from([1, 2]), per_rank_heads=st.integers(1, 2),
       layers=st.integers(1, 2), tied=st.booleans(), dropout=st.sampled_from([0.0, 0.1]),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]), causal=st.booleans(), sp=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]), seed=st.integers(0, 50))
def test_bit_exact_against_one_device(tp, dp, per_rank_heads, layers, tied, dropout, precision, causal, sp, recompute,
                                      seed):
    heads = tp * per_rank_heads
    model = ModelConfig(layers=layers, hidden=2 * heads, heads=heads, ffn_hidden=3 * tp, seq=tp if sp else 3,
                      vocab=4 * tp, tied_head=tied, dropout=dropout, causal=causal, recompute=recompute, seed=seed)
    data = TrainingConfig(model=model, global_batch=2 * dp, micro_batches=2, steps=3, precision=precision)
    got, _ = run_tp(data, tp, dp, sp=sp)
    verdict = report.verification("exact", reference(data), got)
    assert verdict["bit_exact"], verdict["mismatches"]
    assert verdict["outputs_compared"] == 3 + 5 * len(model.parameter_shapes())  # + first-step gradients


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_four_all_reduces_of_sbh_per_layer(tp):
    """Shoeybi et al.: per layer, forward and backward together all-reduce 4 tensors of s*b*h."""
    s, b, h, layers = 64, 2, 256, 3
    model = ModelConfig(layers=layers, hidden=h, heads=8, ffn_hidden=4 * h, seq=s, vocab=8 * tp, tied_head=False)
    data = TrainingConfig(model=model, global_batch=b, steps=1, precision="bf16")
    _, run = run_tp(data, tp, mode="meta")
    block_calls = [e for e in run.trace if e.rank == 0 and e.group.startswith("tp") and e.kind == "all_reduce"
                   and e.bytes == round(2 * (tp - 1) / tp * s * b * h * 2)]  # ring all-reduce of bf16
    assert len(block_calls) == 4 * layers + 2  # + the embedding lookup and the head's input gradient


@pytest.mark.parametrize("sp", [False, True])
def test_a_swapped_shard_is_caught(sp):
    """Tensor-parallel ranks that compute each other's heads: the weights come out permuted."""
    model = ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=8, seq=4, vocab=8, tied_head=False)
    data = TrainingConfig(model=model, global_batch=2, steps=2)
    got, _ = run_tp(data, 2, program=swapped_tp, sp=sp)
    verdict = report.verification("exact", reference(data), got)
    assert not verdict["bit_exact"]


@pytest.mark.parametrize("field,value,message", [
    ("heads", 3, "tensor-parallel degree 2 must divide heads=3; valid degrees: 1, 3"),
    ("ffn_hidden", 9, "tensor-parallel degree 2 must divide ffn_hidden=9; valid degrees: 1, 3, 9"),
    ("vocab", 7, "tensor-parallel degree 2 must divide vocab=7; valid degrees: 1, 7"),
])
def test_degrees_that_do_not_divide_the_work(field, value, message):
    kw = dict(layers=1, hidden=12, heads=2, ffn_hidden=8, seq=3, vocab=8, tied_head=False) | {field: value}
    with pytest.raises(Exception, match=message):
        run_tp(TrainingConfig(model=ModelConfig(**kw), global_batch=2, steps=1), 2, mode="meta")


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_moves_the_same_volume_as_all_reduces(tp):
    """Korthikanti et al.: each all-reduce of sbh becomes an all-gather plus a reduce-scatter of sbh,
    the same bytes on a ring."""
    s, b, h, layers = 64, 2, 256, 2
    model = ModelConfig(layers=layers, hidden=h, heads=8, ffn_hidden=4 * h, seq=s, vocab=8 * tp, tied_head=False)
    data = TrainingConfig(model=model, global_batch=b, steps=1, precision="bf16")

    def block_traffic(sp):
        _, run = run_tp(data, tp, mode="meta", sp=sp)
        calls = [e for e in run.trace if e.rank == 0 and e.group.startswith("tp") and e.name[0] in "FB"
                 and e.kind in ("all_reduce", "all_gather", "reduce_scatter")]
        return calls

    plain, seq = block_traffic(False), block_traffic(True)
    sbh = s * b * h * 2  # bf16
    assert {e.kind for e in seq} >= {"all_gather", "reduce_scatter"}
    assert sum(1 for e in seq if e.kind == "all_gather" and e.bytes == sbh * (tp - 1) // tp) >= 4 * layers
    assert sum(1 for e in seq if e.kind == "reduce_scatter" and e.bytes == sbh * (tp - 1) // tp) >= 4 * layers
    big = lambda calls: sum(e.bytes for e in calls if e.bytes >= sbh * (tp - 1) // tp)  # noqa: E731
    assert big(seq) == big(plain)  # the same bytes: each all-reduce is one all-gather plus one reduce-scatter
    assert len([e for e in seq if e.bytes >= sbh * (tp - 1) // tp]) == 2 * len(
        [e for e in plain if e.bytes >= sbh * (tp - 1) // tp])


def test_sequence_parallel_needs_tp_to_divide_the_sequence():
    model = ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=8, seq=3, vocab=8, tied_head=False)
    with pytest.raises(Exception, match="sequence parallelism: tp=2 must divide seq=3; valid degrees: 1, 3"):
        run_tp(TrainingConfig(model=model, global_batch=2, steps=1), 2, mode="meta", sp=True)
