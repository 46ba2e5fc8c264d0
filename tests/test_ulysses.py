"""DeepSpeed-Ulysses: bit-exact, its all-to-all volume against Megatron SP's, a broken variant, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.reference import reference

from composed_runs import run_composed


def run_cp(data, cp, dp=1, mode="exact"):
    return run_composed(data, dp=dp, cp=cp, mode=mode, attention="ulysses")


@settings(max_examples=12)
@given(cp=st.sampled_from([1, 2, 3, 4, 6]), dp=st.sampled_from([1, 2]), per_rank_heads=st.integers(1, 2),
       tokens_per_rank=st.integers(1, 2), layers=st.integers(1, 2), tied=st.booleans(), causal=st.booleans(),
       dropout=st.sampled_from([0.0, 0.1]), precision=st.sampled_from(["fp32", "bf16"]),
       recompute=st.sampled_from(["none", "selective", "full"]), seed=st.integers(0, 50))
def test_bit_exact_against_one_device(cp, dp, per_rank_heads, tokens_per_rank, layers, tied, causal, dropout,
                                      precision, recompute, seed):
    heads = cp * per_rank_heads
    model = ModelConfig(layers=layers, hidden=2 * heads, heads=heads, ffn_hidden=5, seq=cp * tokens_per_rank, vocab=9,
                      tied_head=tied, causal=causal, dropout=dropout, recompute=recompute, seed=seed)
    data = TrainingConfig(model=model, global_batch=dp, steps=3, precision=precision)
    got, _ = run_cp(data, cp, dp)
    verdict = report.verification("exact", reference(data), got)
    assert verdict["bit_exact"], verdict["mismatches"]
    assert verdict["outputs_compared"] == 3 + 5 * len(model.parameter_shapes())  # + first-step gradients


@pytest.mark.parametrize("P", [2, 4, 8])
def test_ulysses_moves_1_over_p_of_megatron_sp_per_layer(P):
    """Jacobs et al.: per layer and direction, Ulysses all-to-alls 4Nh/P per rank (q, k, v and the
    output, N = s*b tokens), where Megatron SP all-gathers and reduce-scatters about 4Nh: side by side."""
    s, b, h, layers = 256, 2, 256, 2
    model = ModelConfig(layers=layers, hidden=h, heads=8, ffn_hidden=4 * h, seq=s, vocab=64, tied_head=False)
    data = TrainingConfig(model=model, global_batch=b, steps=1, precision="bf16")
    _, run = run_cp(data, P, mode="meta")
    forward = [e for e in run.trace if e.rank == 0 and e.kind == "all_to_all" and e.name.startswith("F")]
    N = s * b
    assert len(forward) == 4 * layers
    sent = sum(e.bytes for e in forward) / layers  # per layer, forward
    assert sent == 4 * N * h * 2 / P * (P - 1) / P  # 4Nh/P elements, of which (P-1)/P leave the rank

    _, tp_run = run_composed(data, tp=P, mode="meta", sp=True)
    sp_forward = [e for e in tp_run.trace if e.rank == 0 and e.name.startswith("F") and e.group.startswith("tp")
                  and e.kind in ("all_gather", "reduce_scatter") and e.bytes == N * h * 2 * (P - 1) // P]
    sp_sent = sum(e.bytes for e in sp_forward) / layers
    assert sp_sent >= 4 * N * h * 2 * (P - 1) / P  # Megatron SP: 4Nh, whatever P
    assert sp_sent / sent >= P  # Ulysses sends a 1/P of it


def test_mixing_up_the_heads_is_caught():
    """An all-to-all that concatenates along the wrong dim gives wrong attention."""
    import simcluster.parallel.ulysses as ulysses_module

    original = ulysses_module.forward

    def wrong(model, q, k, v, layer, step, where):
        # exchange k's heads among ranks as if they were q's: each rank attends with another rank's keys
        out, core = yield from original(model, q, k[:, ::-1].copy(), v, layer, step, where)
        return out, core

    model = ModelConfig(layers=1, hidden=8, heads=4, ffn_hidden=4, seq=4, vocab=7, tied_head=False)
    data = TrainingConfig(model=model, global_batch=1, steps=1)
    try:
        ulysses_module.forward = wrong
        got, _ = run_cp(data, 2)
    finally:
        ulysses_module.forward = original
    assert not report.verification("exact", reference(data), got)["bit_exact"]


@pytest.mark.parametrize("heads,seq,message", [
    (4, 6, "ulysses degree 3 must divide heads=4; valid degrees: 1, 2, 4"),
    (3, 4, "context-parallel degree 3 must divide seq=4; valid degrees: 1, 2, 4"),
])
def test_degrees_that_do_not_divide_the_work(heads, seq, message):
    model = ModelConfig(layers=1, hidden=4 * heads, heads=heads, ffn_hidden=4, seq=seq, vocab=7, tied_head=False)
    with pytest.raises(Exception, match=message):
        run_cp(TrainingConfig(model=model, global_batch=1, steps=1), 3, mode="meta")
