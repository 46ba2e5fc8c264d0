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
