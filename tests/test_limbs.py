"""Exact partial sums: any split, any order, same bytes; clear errors outside the window; rounded once,
correctly, down to the window's lowest digit."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcluster.numerics import limbs
from simcluster.numerics.arrays import NumpyArrays
from simcluster.numerics.tensor import Partial, reduce, ReduceOp

floats32 = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@given(st.lists(floats32, min_size=1, max_size=40), st.data())
def test_any_split_and_order_gives_identical_limbs(values, data):
    x = np.array(values, dtype=np.float32).astype(np.float64)
    whole = limbs.sum_terms(x, axis=0)
    perm = np.array(data.draw(st.permutations(range(len(x)))))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(x)), max_size=5)))
    parts = [Partial(limbs.sum_terms(p, axis=0)) for p in np.split(x[perm], cuts)]
    order = data.draw(st.permutations(range(len(parts))))
    total = reduce([parts[i] for i in order], ReduceOp.SUM)
    assert total.limbs.tobytes() == whole.tobytes()


@given(st.lists(st.integers(-2**30, 2**30), min_size=1, max_size=30))
def test_integer_valued_terms_sum_exactly(ints):
    # integers below 2**53 are exact in float64; their exact sum is known independently
    got = limbs.to_float(limbs.sum_terms(np.array(ints, dtype=np.float64), axis=0), np.float64)
    assert got == float(sum(ints))


def test_sum_that_float64_gets_wrong_is_exact_in_limbs():
    terms = np.array([1.0, 2.0**-60, -1.0], dtype=np.float64)
    assert float(np.sum(terms)) == 0.0  # float64 loses the small term
    assert limbs.to_float(limbs.sum_terms(terms, axis=0), np.float64) == 2.0**-60


def test_out_of_window_term_raises_overflow():
    with pytest.raises(OverflowError, match="outside the exact window"):
        limbs.from_float64(np.array([2.0**41]))


def test_non_finite_term_is_reported():
    with pytest.raises(FloatingPointError, match="non-finite term nan at index \\(1,\\)"):
        limbs.from_float64(np.array([1.0, np.nan]))


def test_negative_values_round_trip():
    x = np.array([-3.5, -2.0**-90, 7.25, -1e9], dtype=np.float64)
    assert limbs.to_float(limbs.normalize(limbs.from_float64(x)), np.float64).tolist() == x.tolist()


FORMATS = {"fp32": (24, -149, np.float32), "bf16": (8, -133, ml_dtypes.bfloat16), "fp16": (11, -24, np.float16)}


def _nearest(x: Fraction, name: str) -> float:
    """x rounded to nearest, ties to even, in the format's significand and down to its least subnormal
    (no overflow: the values drawn stay far below each format's largest)."""
    p, least, _ = FORMATS[name]
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**e <= a < 2**(e + 2)
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    while Fraction(2) ** e > a:
        e -= 1
    unit = Fraction(2) ** max(e - p + 1, least)
    q, rem = divmod(a, unit)
    q += rem > unit / 2 or (rem == unit / 2 and q % 2 == 1)
    return float(q * unit) * (1 if x > 0 else -1)


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(st.lists(st.integers(0, 2**32 - 1), min_size=limbs.LIMBS - 1, max_size=limbs.LIMBS - 1),
       st.integers(-2, 1), st.integers(0, limbs.LIMBS - 1))
def test_rounding_is_correct_down_to_the_lowest_digit(name, digits, top, keep):
    """Normalized limbs with only their lowest `keep` + 1 digits (a value as small as 2**-160, below
    float32's least subnormal) round as the exact rational does: to nearest, ties to even. Values in the
    lowest digit alone were rounded 32 times too large (the leading pair taken as (that digit, 0))."""
    row = digits[:keep + 1] + [0] * (limbs.LIMBS - 2 - keep) + ([top] if keep == limbs.LIMBS - 1 else [0])
    assert len(row) == limbs.LIMBS
    value = sum(Fraction(d) * Fraction(2) ** (limbs.WINDOW_LO + limbs.LIMB_BITS * i) for i, d in enumerate(row))
    got = limbs.to_float(np.array([row], np.int64), FORMATS[name][2])[0]
    assert float(got) == _nearest(value, name)


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=16), min_size=1, max_size=20), st.integers(-130, 10),
       st.integers(-3, 3))
def test_ties_and_what_lies_a_digit_beside_them_round_as_the_rational_does(name, values, scale, nudge):
    """Halfway between two neighbours of the format (a sum of two values often is), or 2**-160 either side
    of halfway: float64 cannot tell these apart, so the rounding must come from the digits. Each rounds to
    nearest, ties to even, as the exact rational does (a float64 value taken at its word at a tie fails)."""
    _, _, dt = FORMATS[name]
    with np.errstate(over="ignore", invalid="ignore"):  # (fp16's overflows to inf are dropped below)
        x = (np.array(values, np.float64) * 2.0**scale).astype(dt)
        bits = x.view(np.uint32 if dt is np.float32 else np.uint16)
        above = (bits + 1).astype(bits.dtype).view(dt)  # the next magnitude (same sign)
        ties = (x.astype(np.float64) + above.astype(np.float64)) / 2  # exact: two more bits than the format's
    ok = np.isfinite(ties) & (np.abs(ties) < 2.0**30)
    row = limbs.from_float64(ties[ok])
    row[..., 0] += nudge  # +- a few units of the window's lowest digit
    row = limbs.normalize(row)
    got = limbs.to_float(row, dt)
    for r, g in zip(row, got):
        value = sum(Fraction(int(d)) * Fraction(2) ** (limbs.WINDOW_LO + limbs.LIMB_BITS * i) for i, d in enumerate(r))
        assert float(g) == _nearest(value, name)


class _Unlooking(NumpyArrays):
    cheap_truth = False  # as on a GPU, where a check would wait for it: every round, none skipped


digits = st.integers(-2**40, 2**40) | st.sampled_from([-1, 0, 1, 2**32 - 1, 2**32, -2**32])


@given(st.lists(st.lists(digits, min_size=limbs.LIMBS, max_size=limbs.LIMBS), min_size=1, max_size=8))
def test_normalize_on_the_host_stops_when_done_with_the_digits_of_every_round(rows):
    """Carries go up all digits at once, a round at a time (a run of 2**32 - 1 digits ripples one digit a
    round): on the host until none is left, on a device every round. The same digits, each in range but the
    top, and the same value."""
    x = np.array(rows, dtype=np.int64)
    got = limbs.normalize(x)
    assert got.tobytes() == limbs.normalize(x, _Unlooking()).tobytes()
    assert ((got[:, :-1] >= 0) & (got[:, :-1] < 2**limbs.LIMB_BITS)).all()
    weights = [2**(limbs.LIMB_BITS * i) for i in range(limbs.LIMBS)]
    assert [sum(int(d) * w for d, w in zip(r, weights)) for r in got] == \
           [sum(d * w for d, w in zip(r, weights)) for r in rows]


def test_a_negative_sum_ripples_its_carry_through_every_digit():
    x = np.array([[2**32, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, -1]], dtype=np.int64)  # 2**32 - 1 more = 0
    assert limbs.normalize(x).tolist() == [[0, 0, 0, 0, 0, 0]]


def test_limbs_of_another_width_are_refused():
    with pytest.raises(ValueError, match="the last dimension holds 6 digits"):
        limbs.to_float(np.zeros((2, limbs.LIMBS + 1), np.int64))
