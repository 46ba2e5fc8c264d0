"""Ring attention and all-gather-KV context parallelism: bit-exact, the fast merge, overlap, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.engine import simulate
from simcluster.model.gpt import ModelConfig, Slice
from simcluster.numerics import kernels
from simcluster.parallel import cp_blocks, ring_attention
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.reference import reference
from simcluster.parallel.transformer_shard import TransformerShard
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

from broken import unnormalised_merge
from composed_runs import run_composed


@settings(max_examples=12)
@given(attention=st.sampled_from(["ring", "allgather"]), cp=st.sampled_from([1, 2, 3, 4]),
       dp=st.sampled_from([1, 2]), chunk=st.integers(1, 2), heads=st.integers(1, 2), layers=st.integers(1, 2),
       causal=st.booleans(), dropout=st.sampled_from([0.0, 0.1]), precision=st.sampled_from(["fp32", "bf16"]),
       recompute=st.sampled_from(["none", "selective", "full"]), seed=st.integers(0, 50))
def test_bit_exact_against_one_device(attention, cp, dp, chunk, heads, layers, causal, dropout, precision, recompute,
                                      seed):
    model = ModelConfig(layers=layers, hidden=2 * heads, heads=heads, ffn_hidden=5, seq=2 * cp * chunk, vocab=9,
                      causal=causal, dropout=dropout, recompute=recompute, seed=seed)
    data = TrainingConfig(model=model, global_batch=dp, steps=3, precision=precision)
    got, _ = run_composed(data, dp=dp, cp=cp, attention=attention)
    verdict = report.verification("exact", reference(data), got)
    assert verdict["bit_exact"], verdict["mismatches"]


def attention_only(ctx, cfg, seed):
    """Ring attention's forward alone on random q, k, v: this rank's output rows."""
    model = TransformerShard(ctx, cfg)
    m = cfg.data.model
    rng = np.random.default_rng(seed)
    full = [rng.standard_normal((1, m.heads, m.seq, m.head_dim)).astype(np.float32) for _ in range(3)]
    q, k, v = (x[:, :, model.positions] for x in full)
    out, _ = yield from ring_attention.forward(model, q, k, v, 0, 0, Slice(0, 1))
    return model.positions, out, full


def ring_outputs(mode, P, seq, seed=0, causal=True):
    model = ModelConfig(layers=1, hidden=8, heads=2, ffn_hidden=4, seq=seq, vocab=5, causal=causal)
    cfg = Parallelism(data=TrainingConfig(model=model, global_batch=1, steps=1), attention="ring")
    run = simulate(attention_only, cfg, seed, mesh=DeviceMesh(cp=P), cluster=preset("dgx-a100", gpus_per_node=P),
                   mode=mode)
    out = np.zeros((1, 2, seq, 4))
    for positions, rows, full in run.results:
        out[:, :, positions] = rows
    return out, np.abs(full[2]).max()


@pytest.mark.parametrize("P,seq", [(2, 8), (4, 16), (4, 64), (3, 24)])
def test_fast_online_merge_agrees_with_exact_two_pass(P, seq):
    """Each output is a convex combination of values: float32 rounding in the merge is bounded by a few
    ulps per key and per block rescale, so the bound grows with the keys (seq) and blocks (P)."""
    exact, vmax = ring_outputs("exact", P, seq)
    fast, _ = ring_outputs("fast", P, seq)
    tolerance = 4 * (seq + P) * 2.0**-24 * vmax
    assert np.max(np.abs(fast - exact)) <= tolerance


def test_a_wrong_merge_is_caught(monkeypatch):
    """A merge of blocks that forgets to divide by their summed weights breaks the tolerance."""
    exact, vmax = ring_outputs("exact", 4, 16)
    monkeypatch.setattr(kernels, "attention_merge", unnormalised_merge)
    fast, _ = ring_outputs("fast", 4, 16)
    assert np.max(np.abs(fast - exact)) > 4 * (16 + 4) * 2.0**-24 * vmax


def ring_gaps(seq, nodes):
    """Compute-stream idle time of rank 0 during the ring passes, with the block transfer and compute
    times read from the trace."""
    P = 4
    model = ModelConfig(layers=1, hidden=1024, heads=8, ffn_hidden=1024, seq=seq, vocab=64, causal=False)
    data = TrainingConfig(model=model, global_batch=1, steps=1, precision="bf16")
    cluster = preset("dgx-a100", nodes=nodes, gpus_per_node=P // nodes)
    trace = run_composed(data, cp=P, cluster=cluster, mode="meta", attention="ring")[1].trace
    compute = trace.lane(0, "compute")
    # each block's fused kernel (the model's default attention kernel, flash) while the keys and values go round
    scores = [e for e in compute if e.name.endswith("/flash_attention") and e.kind == "forward"]
    assert len(scores) == P
    transfers = [e for lane in trace.lanes if lane[0] == 0 and lane[1].startswith("recv")
                 for e in trace.lane(*lane)][:P - 1]
    # idle time on the compute stream while the blocks go round (pass 1)
    window = [e for e in compute if scores[0].start <= e.start and e.end <= scores[-1].end]
    idle = (scores[-1].end - scores[0].start) - sum(e.duration for e in window)
    return idle, scores[0].duration, transfers[0].duration


def test_ring_communication_hides_behind_compute_only_for_big_enough_blocks():
    """Liu et al., Table 2: overlap needs the block's compute to outlast its transfer (block size above
    FLOPS / bandwidth). Long sequences on NVLink: hidden; short ones across InfiniBand: exposed."""
    gaps, compute, transfer = ring_gaps(seq=8192, nodes=1)
    assert compute > transfer and gaps == 0
    gaps, compute, transfer = ring_gaps(seq=256, nodes=2)
    assert compute < transfer and gaps > 0


@pytest.mark.parametrize("attention", ["ring", "allgather"])
def test_a_wrong_causal_mask_is_caught(monkeypatch, attention):
    """Masking every key block as if it held the query's own positions."""
    model = ModelConfig(layers=1, hidden=4, heads=2, ffn_hidden=4, seq=8, vocab=5, causal=True)
    data = TrainingConfig(model=model, global_batch=1, steps=1)
    wrong = lambda model, owner: model.positions  # noqa: E731
    monkeypatch.setattr(cp_blocks, "positions_of", wrong)  # (what the all-gather's columns are made of)
    monkeypatch.setattr(ring_attention, "positions_of", wrong)
    got, _ = run_composed(data, cp=2, attention=attention)
    assert not report.verification("exact", reference(data), got)["bit_exact"]


def test_zigzag_needs_twice_the_degree_to_divide_the_sequence():
    model = ModelConfig(layers=1, hidden=4, heads=2, ffn_hidden=4, seq=6, vocab=5, causal=True)
    with pytest.raises(Exception, match="seq=6 must be divisible by 2 x cp = 4; valid degrees: 1, 3"):
        run_composed(TrainingConfig(model=model, global_batch=1, steps=1), cp=2, mode="meta", attention="ring")


def test_ring_blocks_run_as_flash_kernels_and_cost_what_ulysses_core_costs():
    """With the model's attention kernel (flash, the default) each ring block is one fused kernel, as
    in ring-flash-attention. A rank's P forward blocks (s/P queries x s/P keys, about half the products
    causal) do about the FLOPs of Ulysses' one core (a/P heads x s queries x s keys): 2 b a s^2 d / P
    each way, a causal kernel running the 128 x 128 tiles up to the diagonal, whole; the ring's causal
    blocks are smaller, so their diagonal tiles are a larger share (a few % more). At a long sequence
    both are compute-bound, so the ring's blocks take Ulysses' core time plus P - 1 more launch gaps
    and those tiles; no s x s tensor reaches memory in either. The ring's step is longer only by its merges and accumulators (elementwise passes over
    s/P x d per block): under 20 % here, where materialised blocks made it 2.7x. RSA keeps its score
    rows: unfused, whatever the model's kernel (ColossalAI's)."""
    P, gap = 4, preset("dgx-a100").kernel_overhead_ns
    model = ModelConfig(layers=1, hidden=1024, heads=8, ffn_hidden=1024, seq=8192, vocab=64)
    data = TrainingConfig(model=model, global_batch=1, steps=1, precision="bf16")
    runs = {a: run_composed(data, cp=P, mode="meta", attention=a)[1] for a in ("ring", "ulysses", "rsa")}

    def kernels(attention, name):
        return [e for e in runs[attention].trace.lane(0, "compute") if e.name.endswith("/" + name)]

    blocks, core = kernels("ring", "flash_attention"), kernels("ulysses", "flash_attention")
    assert len(blocks) == P and len(core) == 1
    assert 1 <= sum(e.duration for e in blocks) / (core[0].duration + (P - 1) * gap) < 1.06
    assert len(kernels("ring", "flash_attention_backward")) == P
    assert not kernels("ring", "attention_scores") and kernels("rsa", "attention_scores")
    ring, ulysses = (runs[a].trace.end for a in ("ring", "ulysses"))
    assert 1 <= ring / ulysses < 1.2
