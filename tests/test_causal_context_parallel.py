"""A causal flash kernel on a context-parallel rank's queries runs the tiles its positions reach: each zigzag chunk
the keys before it, not the rank's share of the square with the keys after it too. (Charged as if its queries
were the sequence's last, the all-gather attention ran nearly its whole rectangle: 0.97 of it at 16 ranks.)"""

import numpy as np
import pytest

from simcluster.config.scenario import load
from simcluster.model.flash import TILE, causal_share, causal_share_at
from simcluster.parallel.positions import Positions, layout
from simcluster.run.runner import run_scenario


def _tiles_with_an_allowed_pair(rows: Positions, cols: Positions) -> float:
    """The oracle, from the mask itself: the keys sorted by position, a tile of TILE query rows (of one run) by
    TILE keys runs if any query in it may see any key in it (key position <= query position)."""
    keys = np.sort(np.asarray(cols))
    ran = 0
    for start, n in rows.runs:
        q = np.arange(start, start + n)
        for lo in range(0, n, TILE):
            block = q[lo:lo + TILE]
            for k0 in range(0, len(keys), TILE):
                if (keys[k0:k0 + TILE][None, :] <= block[:, None]).any():
                    ran += len(block) * len(keys[k0:k0 + TILE])
    return ran / (len(rows) * len(cols))


@pytest.mark.parametrize("seq,P", [(4096, 2), (8192, 4), (8192, 8)])
def test_a_ranks_share_is_the_tiles_its_positions_reach(seq, P):
    every = Positions.joined(layout(seq, P, o, True) for o in range(P))
    for r in range(P):
        mine = layout(seq, P, r, True)
        assert causal_share_at(mine.runs, every.runs) == pytest.approx(_tiles_with_an_allowed_pair(mine, every))
        for o in range(P):  # ring attention's blocks
            theirs = layout(seq, P, o, True)
            assert causal_share_at(mine.runs, theirs.runs) == pytest.approx(_tiles_with_an_allowed_pair(mine, theirs))
    whole = Positions([(0, seq)])
    assert causal_share(seq, seq) == pytest.approx(_tiles_with_an_allowed_pair(whole, whole))
    last = Positions([(seq - seq // P, seq // P)])  # FlashAttention's alignment: the queries the keys' last
    assert causal_share(seq // P, seq) == pytest.approx(_tiles_with_an_allowed_pair(last, whole))


def _attention_ns(attention, cp):
    """A rank's time in its flash kernels, forward and backward, times the ranks that share the sequence."""
    sets = ["run.numerics=meta", "model.arch=llama", "model.layers=1", "model.hidden=1024", "model.heads=8",
            "model.kv_heads=8", "model.ffn_hidden=256", "model.seq=65536", "model.vocab=128", "model.global_batch=1",
            "cluster.preset=dgx-h100", f"cluster.gpus_per_node={cp}", "parallel.dp=1", "parallel.tp=1",
            f"parallel.cp={cp}", f"parallel.attention={attention}", "run.steps=1"]
    events = run_scenario(load(None, sets), fold=False).result.trace.events
    return cp * sum(e.end - e.start for e in events if e.rank == 0 and "/flash_attention" in e.name)


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_context_parallelism_runs_the_attention_one_device_runs(attention):
    """A 64K-token layer whose work is nearly all attention: split over 8 ranks, all-gathered or around a ring,
    the kernels run the causal tiles the one device runs, in as much time, within the diagonal's tiles (each
    rank's chunks have their own diagonals); charged as the sequence's last queries, the all-gather's took 1.9
    times as long."""
    one, split = _attention_ns(attention, 1), _attention_ns(attention, 8)
    assert split == pytest.approx(one, rel=0.02)
