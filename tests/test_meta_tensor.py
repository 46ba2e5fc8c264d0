"""MetaTensor: shape and dtype only, immutable, equal by value, picklable (it crosses processes)."""

import pickle

import numpy as np
import pytest

from simcluster.numerics.tensor import MetaTensor, signature


def test_a_meta_tensor_is_a_value():
    a = MetaTensor([2, np.int64(3)], "bf16")
    assert a.shape == (2, 3) and all(type(d) is int for d in a.shape) and a.ndim == 2
    assert a == MetaTensor((2, 3), "bf16") and hash(a) == hash(MetaTensor((2, 3), "bf16"))
    assert a != MetaTensor((2, 3), "fp32") and a != MetaTensor((2, 3), "bf16", partial=True) and a != (2, 3)
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == "MetaTensor(shape=(2, 3), dtype='bf16', partial=False)"
    assert signature(a) == (False, "bf16", (2, 3)) and signature(a) is signature(a)


def test_a_meta_tensor_cannot_be_changed_or_made_wrong():
    a = MetaTensor((4,))
    with pytest.raises(AttributeError, match="immutable"):
        a.shape = (5,)
    with pytest.raises(ValueError, match="negative dimension"):
        MetaTensor((2, -1))
    with pytest.raises(ValueError, match="unknown dtype"):
        MetaTensor((2,), "float8")


@pytest.mark.parametrize("extra", [[], ["model.arch=llama", "model.tied_head=false"],
                                   ["parallel.dp=4", "parallel.cp=2", "parallel.attention=ring"],
                                   ["parallel.dp=4", "parallel.tp=2", "parallel.sp=true"]])
def test_meta_mode_allocates_nothing_by_tokens(extra):
    """Issue 36: meta mode is about shapes. A 16M-token sequence (positions as runs, token ids and the
    rotary table as shapes) peaks under 8 MB of Python allocations; it peaked at 227 MB at 1M tokens when
    positions and token ids were arrays (and asked for 16 GiB at 2^31)."""
    import tracemalloc

    from simcluster.run.runner import run_scenario
    from simcluster.config.scenario import build

    sc = build({}, ["run.numerics=meta", "model.seq=16777216", "run.steps=1", *extra])
    tracemalloc.start()
    try:
        run_scenario(sc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8e6, peak


def test_a_sequence_too_long_to_count_is_refused_before_anything_is_built(capsys):
    from simcluster.cli import main

    assert main(["run", "--set", "run.numerics=meta", "--set", "model.seq=2147483647"]) == 2
    err = capsys.readouterr().err
    assert "model.seq = 2,147,483,647: attention's scores" in err and len(err.strip().splitlines()) == 1


def test_index_arithmetic_has_shapes_and_float_arithmetic_goes_through_ops():
    targets = MetaTensor((2, 8), "int64")
    local = targets - 16
    mine = (local >= 0) & (local < 16)
    assert local == MetaTensor((2, 8), "int64") and mine == MetaTensor((2, 8), "bool")
    assert (local * mine)[..., None] == MetaTensor((2, 8, 1), "int64")
    with pytest.raises(TypeError, match="goes through ops"):
        MetaTensor((2, 8), "bf16") + MetaTensor((2, 8), "bf16")  # a program's data: ops.add, with its cost
