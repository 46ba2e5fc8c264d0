"""ZeRO memory, communication and overlap, read from the engine (meta mode: no numbers, any scale)."""

import pytest

from simcluster.model.gpt import ModelConfig, units
from simcluster.parallel.data_parallel import TrainingConfig, padded, unit_size
from simcluster.topology.presets import preset

from composed_runs import run_composed

# Psi = 7.5e9 exactly, as in Table 1 of the ZeRO paper (Rajbhandari et al. 2020), in one layer
BIG = ModelConfig(layers=1, hidden=17280, heads=135, ffn_hidden=134400, seq=2048, vocab=94041)
# Table 1: per-device memory of model states in GB, Psi = 7.5B, K = 12, for DDP and ZeRO-1/2/3
TABLE_1 = {1: (120, 120, 120, 120), 4: (120, 52.5, 41.3, 30), 16: (120, 35.6, 21.6, 7.5),
           64: (120, 31.4, 16.6, 1.88), 256: (120, 30.4, 15.4, 0.47), 1024: (120, 30.1, 15.1, 0.12)}


def cluster(n):
    return preset("dgx-a100", nodes=max(1, n // 8), gpus_per_node=min(n, 8))


def meta_run(model, n, stage, **kw):
    cfg = TrainingConfig(model=model, global_batch=n, steps=1, precision="bf16", zero=stage, **kw)
    return run_composed(cfg, dp=n, cluster=cluster(n), mode="meta")[1]


def paper_rounding(gb):
    """The table's digits: three significant figures, at most two decimals, halves rounded up."""
    from decimal import ROUND_HALF_UP, Decimal

    d = Decimal(repr(gb))
    step = Decimal("0.01") if gb < 10 else Decimal(10) ** (d.adjusted() - 2)
    return float(d.quantize(step, rounding=ROUND_HALF_UP))


def test_big_model_has_the_papers_parameter_count():
    assert BIG.parameters == 7_500_000_000


@pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.slow) if n >= 1024 else n for n in sorted(TABLE_1)])
def test_zero_paper_table_1(n):
    psi = BIG.parameters
    owned = sum(padded(unit_size(BIG, u), n) // n for u in units(BIG))  # each rank's share, with padding
    exact = {0: 16 * psi, 1: 4 * psi + 12 * owned, 2: 2 * psi + 14 * owned, 3: 16 * owned}
    for stage in range(4):
        peaks = meta_run(BIG, n, stage).trace.memory_peaks()
        for rank in (0, n - 1):
            states = sum(peaks[rank].get(c, 0) for c in ("parameters", "gradients", "optimizer"))
            assert states == exact[stage]  # the closed form, byte for byte
            # the step's fp32 copy of the gradients it updates (Megatron-LM's and DeepSpeed's optimizers), or
            # the cross-entropy's forward over one sequence: fp32 logits, two fp32 buffers on the way to their
            # exponentials and a boolean mask, 4 + 4 + 4 + 1 bytes a logit, where that is more
            assert peaks[rank]["temporaries"] == max(4 * (psi if stage == 0 else owned), 13 * BIG.seq * BIG.vocab)
        assert paper_rounding(states / 1e9) == TABLE_1[n][stage]
        assert abs(owned - psi / n) < len(units(BIG))  # padding: less than one element per unit


SMALL = ModelConfig(layers=3, hidden=64, heads=4, ffn_hidden=256, seq=32, vocab=128, tied_head=False)


@pytest.mark.parametrize("stage,volume", [(0, 2), (1, 2), (2, 2), (3, 3)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_bytes_sent_per_rank_per_step(stage, volume, n):
    """2 Psi (DDP, ZeRO-1, ZeRO-2) and 3 Psi (ZeRO-3) in the gradient dtype, times (n-1)/n of a ring."""
    trace = meta_run(SMALL, n, stage).trace
    elements = SMALL.parameters if stage == 0 else sum(padded(unit_size(SMALL, u), n) for u in units(SMALL))
    for rank in range(n):
        sent = sum(e.bytes for e in trace if e.rank == rank and e.group.startswith("dp") and e.name != "loss")
        assert sent == pytest.approx(volume * 2 * elements * (n - 1) / n, abs=len(units(SMALL)) * volume)


def forward_timeline(trace, model):
    """Per unit of the first forward pass: (all-gather duration, compute duration), and when it ends."""
    order = units(model)
    gathers = [e for e in trace.lane(0, "comm:dp") if e.kind == "all_gather"][:len(order)]
    compute = {u: [e for e in trace.lane(0, "compute") if e.name.startswith(f"F0:{u}/")] for u in order}
    ag = [g.duration for g in gathers]
    c = [sum(e.duration for e in compute[u]) for u in order]
    return ag, c, compute[order[-1]][-1].end - gathers[0].start  # from the first gather (after the init)


@pytest.mark.parametrize("batch_per_rank,comm_bound", [(1, True), (64, False)])
def test_zero3_prefetch_overlap_against_the_closed_form(batch_per_rank, comm_bound):
    """FSDP's forward: T = AG_0 + sum C_u + sum max(0, AG_{u+1} - C_u); without prefetch sum (AG_u + C_u)."""
    model = ModelConfig(layers=4, hidden=1024, heads=8, ffn_hidden=4096, seq=128, vocab=1024, tied_head=False)
    n = 16  # two nodes: the gathers cross InfiniBand

    def run(prefetch):
        cfg = TrainingConfig(model=model, global_batch=n * batch_per_rank, steps=1, precision="bf16", zero=3,
                       prefetch=prefetch)
        return run_composed(cfg, dp=n, cluster=cluster(n), mode="meta")[1].trace

    with_prefetch, without = run(True), run(False)
    ag, c, end = forward_timeline(with_prefetch, model)
    bubbles = [max(0, ag[u + 1] - c[u]) for u in range(len(c) - 1)]
    assert end == ag[0] + sum(c) + sum(bubbles)
    ag2, c2, end2 = forward_timeline(without, model)
    assert (ag2, c2) == (ag, c)  # the same pieces, only arranged differently
    assert end2 == sum(ag) + sum(c)
    assert end2 - end == sum(min(ag[u + 1], c[u]) for u in range(len(c) - 1)) > 0  # what prefetch saves
    # between transformer blocks, bubbles appear exactly when a block computes for less time than the
    # next block's gather takes (the tiny embedding unit always leaves one)
    between_blocks = bubbles[1:model.layers]  # block u -> block u+1
    assert len(between_blocks) == model.layers - 1
    assert all(b > 0 for b in between_blocks) if comm_bound else all(b == 0 for b in between_blocks)
    # and in the trace: unit u+1's gather runs while unit u computes
    gathers = [e for e in with_prefetch.lane(0, "comm:dp") if e.kind == "all_gather"]
    block0 = [e for e in with_prefetch.lane(0, "compute") if e.name.startswith("F0:block0/")]
    assert gathers[2].start < block0[-1].end and block0[0].start < gathers[2].end


def test_ddp_buckets_overlap_the_backward_pass():
    """Each bucket's all-reduce starts as soon as backward has finished that unit, before backward ends."""
    model = ModelConfig(layers=4, hidden=512, heads=8, ffn_hidden=2048, seq=128, vocab=1024, tied_head=False)
    trace = meta_run(model, 8, 0).trace
    backward = [e for e in trace.lane(0, "compute") if e.kind == "backward"]
    buckets = [e for e in trace.lane(0, "comm:dp") if e.kind == "all_reduce" and e.name != "loss"]
    assert len(buckets) == len(units(model))
    # all but the last start before backward ends, or as soon as the bucket before them on the
    # stream is done: none waits for the end of the backward pass
    for prev, b in zip(buckets, buckets[1:-1]):
        assert b.start < backward[-1].end or b.start == prev.end
    assert buckets[0].start < backward[-1].end
    assert buckets[0].name.startswith("B")  # issued from inside the backward pass
