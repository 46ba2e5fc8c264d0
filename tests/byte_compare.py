"""Byte equality of two single-device views (name -> tensor), naming the first output that differs."""

import numpy as np


def assert_same_bytes(got, want, *, only_wanted=False):
    """Every output of `want` equals `got`'s byte for byte; unless `only_wanted`, the names agree too."""
    if not only_wanted:
        assert got.keys() == want.keys()
    for k in want:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k
