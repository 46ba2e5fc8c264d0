"""Inside a 4D mesh each family moves what its own closed form says, and model state follows the ZeRO
table with Psi replaced by the rank's shard (meta mode: read from the engine's trace)."""

import math

import pytest

from simcluster.model.gpt import ModelConfig
from simcluster.parallel.data_parallel import TrainingConfig, padded

from composed_runs import run_composed

dp, pp, cp, tp = 2, 2, 2, 2
m, layers = 2, 4  # micro-batches per step; two blocks per stage
s, b, h, heads, F, V = 256, 1, 256, 8, 1024, 512
MODEL = ModelConfig(layers=layers, hidden=h, heads=heads, ffn_hidden=F, seq=s, vocab=V, tied_head=False)
ITEM = 2  # bf16
ACT = b * (s // cp) * h * ITEM  # a micro-batch's activation on a cp rank, (b, s/cp, h)


def run(zero=0, sp=False, attention="ulysses", scatter_gather=False):
    data = TrainingConfig(model=MODEL, global_batch=dp * m * b, micro_batches=m, steps=1, precision="bf16", zero=zero)
    return run_composed(data, dp=dp, pp=pp, cp=cp, tp=tp, mode="meta", sp=sp, attention=attention,
                    schedule="1f1b", scatter_gather=scatter_gather)[1].trace


def on(trace, rank, axis, kind=None):
    """Rank's communication on its group along `axis` ("tp", "cp", "dp+cp") or p2p, by kind."""
    return [e for e in trace if e.rank == rank and e.group.split("[")[0] == axis and (kind is None or e.kind == kind)]


def unit_shard(unit):
    """Parameters of a unit on one tp rank (the closed form, not the program's shapes)."""
    if unit == "embed":
        return V * h // tp + s * h
    if unit == "head":
        return 2 * h + h * V // tp
    return 4 * h + 3 * h * h // tp + 3 * h // tp + h * h // tp + h + h * F // tp + F // tp + F * h // tp + h


STAGE_UNITS = [["embed", "block0", "block1"], ["block2", "block3", "head"]]


def test_tensor_parallel_all_reduces():
    """Shoeybi et al.: 4 all-reduces of the activation per layer and micro-batch (2 forward, 2 backward),
    plus the vocab-parallel embedding's; a ring all-reduce sends 2(t-1)/t of it."""
    trace = run()
    calls = on(trace, 0, "tp", "all_reduce")  # stage 0: the embedding and blocks 0, 1
    assert len(calls) == m * (4 * 2 + 1)
    assert all(e.bytes == 2 * (tp - 1) * ACT // tp for e in calls)


def test_sequence_parallel_all_gathers_and_reduce_scatters():
    """Korthikanti et al.: each all-reduce becomes an all-gather and a reduce-scatter of the same size;
    the replicated weights' gradients (norms, biases, positions) are summed over tp once per micro-batch."""
    trace = run(sp=True)
    per = (tp - 1) * ACT // tp
    gathers, scatters = on(trace, 0, "tp", "all_gather"), on(trace, 0, "tp", "reduce_scatter")
    assert len(gathers) == len(scatters) == m * (4 * 2 + 1)
    assert all(e.bytes == per for e in gathers + scatters)
    replicated = 2 * (4 * h + 2 * h) + s * h  # per block ln1, ln2 (g, b), b_proj, b_out; wpe
    synced = sum(e.bytes for e in on(trace, 0, "tp", "all_reduce"))
    assert synced == pytest.approx(m * 2 * (tp - 1) / tp * replicated * ITEM, abs=m * 8)


def test_ulysses_all_to_alls():
    """Jacobs et al.: q, k, v and the output forward, their gradients backward: 8 all-to-alls of a tp
    rank's share of the activation per layer and micro-batch, (P-1)/P of each leaving the rank."""
    trace = run()
    calls = on(trace, 0, "cp", "all_to_all")
    assert len(calls) == m * 2 * 8
    assert all(e.bytes == (cp - 1) * (ACT // tp) // cp for e in calls)


def test_pipeline_point_to_point():
    """Stage 0 sends each micro-batch's activation forward once; stage 1 each gradient back once."""
    trace = run()
    sent = [e for e in trace if e.rank == 0 and e.kind == "send"]
    assert len(sent) == m and all(e.bytes == ACT for e in sent)
    last = 1 * cp * tp  # rank (dp 0, pp 1, cp 0, tp 0)
    back = [e for e in trace if e.rank == last and e.kind == "send"]
    assert len(back) == m and all(e.bytes == ACT for e in back)


@pytest.mark.parametrize("sp", [False, True])
def test_pipeline_scatter_gather(sp):
    """Narayanan et al. 2021, section 4.1: each tp rank sends 1/t of a message and the receiving
    stage all-gathers the t parts over tp; with SP the message is already a tp rank's tokens, and
    nothing changes."""
    trace = run(sp=sp, scatter_gather=True)
    last = 1 * cp * tp
    for rank in (0, last):  # stage 0 sends activations and gathers gradients; stage 1 the other way
        sent = [e for e in trace if e.rank == rank and e.kind == "send"]
        assert len(sent) == m and all(e.bytes == ACT // tp for e in sent)
    if sp:
        assert run(sp=True).events == trace.events
        return
    for rank in (0, last):
        gathers = on(trace, rank, "tp", "all_gather")
        assert len(gathers) == m and all(e.bytes == (tp - 1) * ACT // tp for e in gathers)


@pytest.mark.parametrize("zero,volume", [(0, 2), (1, 2), (2, 1 + m), (3, 3 * m)])
def test_data_parallel_traffic_is_over_the_ranks_own_shard(zero, volume):
    """2 Psi (DDP, ZeRO-1/2) or 3 Psi (ZeRO-3) over dp x cp, with Psi this rank's tp shard of its stage;
    with m micro-batches ZeRO-2 reduce-scatters every micro-batch (one all-gather after the step) and
    ZeRO-3 gathers twice and reduce-scatters once per micro-batch: (1 + m) Psi and 3m Psi."""
    n = dp * cp
    trace = run(zero=zero)
    for rank, stage in ((0, 0), (cp * tp, 1)):  # one rank of each stage
        elements = sum(unit_shard(u) if zero == 0 else padded(unit_shard(u), n) for u in STAGE_UNITS[stage])
        calls = [e for e in on(trace, rank, "dp+cp") if e.name != "loss"]
        sent = sum(e.bytes for e in calls)
        assert sent == pytest.approx(volume * ITEM * elements * (n - 1) / n, abs=3 * volume * m)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_memory_is_the_zero_table_of_the_rank_shard(zero):
    """Rajbhandari et al., with Psi the rank's (tp x pp) shard and N = dp x cp: 2+2+12 bytes per
    parameter, the 12 (ZeRO-1), the 2 + 12 (ZeRO-2) or all 16 (ZeRO-3) divided by N."""
    n = dp * cp
    peaks = run(zero=zero).memory_peaks()
    for rank, stage in ((0, 0), (cp * tp + 1, 1)):
        psi = sum(unit_shard(u) for u in STAGE_UNITS[stage])
        owned = sum(padded(unit_shard(u), n) // n for u in STAGE_UNITS[stage])
        want = {0: (2 * psi, 2 * psi, 12 * psi), 1: (2 * psi, 2 * psi, 12 * owned),
                2: (2 * psi, 2 * owned, 12 * owned), 3: (2 * owned, 2 * owned, 12 * owned)}[zero]
        got = tuple(peaks[rank].get(c, 0) for c in ("parameters", "gradients", "optimizer"))
        assert got == want
        assert abs(owned - psi / n) < len(STAGE_UNITS[stage])  # padding: under one element per unit
        assert math.prod((dp, pp, cp, tp)) == 16
