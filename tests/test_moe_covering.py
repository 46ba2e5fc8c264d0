"""A mixture of experts under every pair of its options and the layouts it runs with: an all-pairs covering
array (tests/pairwise.py), each row byte-identical to one device in exact mode, and layouts drawn by the
public strategy (simcluster.testing.layouts draws ep for a model with experts)."""

import pytest
from hypothesis import given, settings

from pairwise import covering_rows
from simcluster.model.config import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.program.mesh import DeviceMesh
from simcluster.testing import Layout, assert_bit_exact, layouts

OPTIONS = {
    "dp": [1, 2, 4], "ep": [1, 2, 4], "pp": [1, 2], "schedule": ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"],
    "zero": [0, 1, 2, 3], "micro_batches": [1, 2], "recompute": ["none", "selective", "full"],
    "precision": ["fp32", "bf16", "fp16"], "top_k": [1, 2], "capacity": [0.0, 1.0, 0.5], "scores": ["softmax", "sigmoid"],
    "normalize": [False, True], "aux": [0.0, 0.01], "first_dense": [0, 1], "offload": ["none", "cpu"],
    "dispatcher": ["alltoall", "allgather"],
}


def valid(row):
    """ep divides dp (and the 4 experts); DualPipe needs an even number of stages and runs without
    offloading; offloading the optimizer needs a ZeRO stage; a dispatcher other than the default needs ep."""
    return (row["dp"] % row["ep"] == 0 and (row["ep"] > 1 or row["dispatcher"] == "alltoall") and not (row["schedule"] == "dualpipe" and (row["pp"] % 2
                                                                                     or row["offload"] != "none"))
            and not (row["offload"] != "none" and row["zero"] == 0))


ROWS, PAIRS = covering_rows(OPTIONS, valid)


def test_the_rows_cover_every_feasible_pair():
    covered = {((a, r[a]), (b, r[b])) for r in ROWS for a in r for b in r if list(OPTIONS).index(a) < list(OPTIONS).index(b)}
    assert covered >= PAIRS and all(valid(r) for r in ROWS)


def _name(row):
    return (f"dp{row['dp']}-ep{row['ep']}{'-ag' if row['dispatcher'] == 'allgather' else ''}-pp{row['pp']}-"
            f"{row['schedule']}-z{row['zero']}-k{row['top_k']}-c{row['capacity']}")


@pytest.mark.parametrize("row", ROWS, ids=_name)
def test_bit_exact_against_one_device(row):
    pp = row["pp"]
    chunks = 2 if row["schedule"] in ("interleaved", "zb-v") else 1
    m = pp * row["micro_batches"] * (2 if row["schedule"] == "dualpipe" else 1)
    model = ModelConfig(arch="llama", tied_head=False, layers=pp * chunks + row["first_dense"], hidden=8, heads=2,
                        ffn_hidden=8, seq=6, vocab=10, recompute=row["recompute"], moe_experts=4,
                        moe_top_k=row["top_k"], moe_ffn_hidden=6, moe_first_dense=row["first_dense"],
                        moe_aux_coeff=row["aux"], moe_capacity_factor=row["capacity"], moe_scores=row["scores"],
                        moe_normalize=row["normalize"])
    data = TrainingConfig(model=model, global_batch=row["dp"] * m, micro_batches=m, steps=2,
                          precision=row["precision"], zero=row["zero"], offload_optimizer=row["offload"])
    layout = Layout(DeviceMesh(dp=row["dp"], pp=pp, ep=row["ep"]), Parallelism(
        data=data, schedule=row["schedule"], virtual=2 if row["schedule"] == "interleaved" else 1, ep=row["ep"],
        dispatcher=row["dispatcher"]))
    assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                     reference_config=layout.one_device)


MOE = ModelConfig(arch="llama", tied_head=False, layers=4, hidden=8, heads=2, ffn_hidden=8, seq=6, vocab=10,
                  moe_experts=4, moe_ffn_hidden=6, moe_aux_coeff=0.01, moe_capacity_factor=1.0)


@settings(max_examples=6)
@given(layouts(MOE, max_world=8))
def test_any_drawn_layout_with_experts_is_bit_exact(layout):
    assert layout.parallelism.ep == layout.mesh.ep
    assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                     reference_config=layout.one_device)


DROPLESS = ModelConfig(arch="llama", tied_head=False, layers=4, hidden=8, heads=2, ffn_hidden=8, seq=12, vocab=10,
                       moe_experts=4, moe_ffn_hidden=6, moe_aux_coeff=0.01, moe_scores="sigmoid", moe_normalize=True)


@settings(max_examples=4)
@given(layouts(DROPLESS, max_world=8).filter(lambda lay: lay.mesh.ep > 1))
def test_any_drawn_layout_with_experts_beside_tp_and_cp_is_bit_exact(layout):
    """Dropless, expert parallelism runs beside tensor (with sequence) and context parallelism too: each
    tp and cp rank routes its own tokens, the balance loss sums a sequence's choices over them."""
    assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                     reference_config=layout.one_device)


@pytest.mark.parametrize("ep", [2, 4])
def test_the_strategy_draws_expert_parallelism(ep):
    from hypothesis import find

    drawn = find(layouts(MOE, max_world=8), lambda lay: lay.mesh.ep == ep)
    assert drawn.parallelism.ep == ep


@pytest.mark.parametrize("axis", ["tp", "cp"])
def test_the_strategy_draws_an_experts_capacity_beside_tp_and_cp(axis):
    from hypothesis import find

    drawn = find(layouts(MOE, max_world=8), lambda lay: lay.mesh.sizes[axis] > 1)
    assert drawn.parallelism.model.moe_capacity_factor == 1.0


@pytest.mark.parametrize("axis", ["tp", "cp"])
def test_the_strategy_draws_experts_beside_tp_and_cp_with_ep(axis):
    from hypothesis import find

    drawn = find(layouts(DROPLESS, max_world=16), lambda lay: lay.mesh.ep > 1 and lay.mesh.sizes[axis] > 1)
    assert drawn.parallelism.sp or axis == "cp"
