"""Exact kernels: any split of a reduced dimension, in any order, gives the unsplit kernel's bytes."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcluster.numerics import exact, transcendental
from simcluster.numerics.modes import make_ops
from simcluster.numerics.tensor import ReduceOp, reduce

ops = make_ops("exact")


def rand(rng, shape, spread=8):
    """float32 values over a wide range of magnitudes (what makes float sums order-dependent)."""
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread, shape))).astype(np.float32)


@st.composite
def split_of(draw, n):
    """Cut points splitting range(n) into 1..n parts (any count, not only powers of two), and an order."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=min(6, n - 1))))) if n > 1 else []
    parts = len(cuts) + 1
    return cuts, draw(st.permutations(range(parts)))


def combine(partials, order):
    order = order if len(order) == len(partials) else range(len(partials))  # the unsplit kernel: one part
    return reduce([partials[i] for i in order], ReduceOp.SUM)


@given(st.integers(1, 5), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**16), st.data())
def test_matmul_split_over_k(m, k, n, seed, data):
    rng = np.random.default_rng(seed)
    a, b = rand(rng, (m, k)), rand(rng, (k, n))
    cuts, order = data.draw(split_of(k))
    whole = ops.matmul(a, b, partial=True)
    parts = [ops.matmul(x, y, partial=True) for x, y in zip(np.split(a, cuts, 1), np.split(b, cuts, 0))]
    total = combine(parts, order)
    assert total.limbs.tobytes() == whole.limbs.tobytes()
    assert ops.finalize(total).tobytes() == ops.matmul(a, b).tobytes()


@given(st.integers(1, 30), st.integers(1, 5), st.integers(0, 2**16), st.data())
def test_sum_over_tokens_split(t, h, seed, data):
    """The weight-gradient reduction that DP, SP and CP split: sum over tokens of x^T dy."""
    rng = np.random.default_rng(seed)
    x, dy = rand(rng, (t, h)), rand(rng, (t, h + 1))
    cuts, order = data.draw(split_of(t))
    whole = ops.einsum("th,tk->hk", x, dy, partial=True)
    parts = [ops.einsum("th,tk->hk", xs, ds, partial=True) for xs, ds in zip(np.split(x, cuts), np.split(dy, cuts))]
    assert combine(parts, order).limbs.tobytes() == whole.limbs.tobytes()
    sums = [ops.sum(xs, 0, partial=True) for xs in np.split(x, cuts)]
    assert combine(sums, order).limbs.tobytes() == ops.sum(x, 0, partial=True).limbs.tobytes()


@given(st.integers(1, 4), st.integers(2, 40), st.integers(0, 2**16), st.data())
def test_cross_entropy_over_a_sharded_vocabulary(t, vocab, seed, data):
    rng = np.random.default_rng(seed)
    logits = rand(rng, (t, vocab), spread=3)
    targets = rng.integers(0, vocab, t)
    cuts, order = data.draw(split_of(vocab))

    def loss_pieces(shards):
        m = np.max(np.concatenate([ops.max(s, -1) for s in shards], -1), -1, keepdims=True)  # all_reduce max
        sums = [ops.sum(ops.attention_weights(s, m), -1, partial=True) for s in shards]  # local sum exp
        lse = ops.log_sum_exp(m, combine(sums, order))  # all_reduce sum, any order
        return lse

    whole = loss_pieces([logits])
    sharded = loss_pieces(np.split(logits, cuts, 1))
    assert sharded.tobytes() == whole.tobytes()
    picked = np.take_along_axis(logits, targets[:, None], 1)[:, 0]
    ref = np.log(np.sum(np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True)), 1)) + logits.max(1)
    np.testing.assert_allclose(whole - picked, ref - picked, rtol=1e-5, atol=1e-5)  # and it is cross-entropy


@given(st.integers(1, 3), st.integers(1, 6), st.integers(2, 24), st.booleans(), st.integers(0, 2**16), st.data())
def test_attention_over_sharded_keys(sq, d, sk, causal, seed, data):
    """Two passes over key blocks (max, then sums of weights and weighted values) = attention on all keys."""
    rng = np.random.default_rng(seed)
    sk = max(sk, sq)  # every query sees at least one key
    q, k, v = rand(rng, (1, 2, sq, d), 2), rand(rng, (1, 2, sk, d), 2), rand(rng, (1, 2, sk, d), 2)
    allowed = np.tril(np.ones((sq, sk), bool), k=sk - sq) if causal else None
    cuts, order = data.draw(split_of(sk))

    def core(blocks):
        scores = [ops.attention_scores(q, kb, 0.5, ab) for kb, _, ab in blocks]
        m = np.max(np.concatenate([ops.max(s, -1) for s in scores], -1), -1, keepdims=True)
        es = [ops.attention_weights(s, m) for s in scores]
        ls = [ops.sum(e, -1, partial=True) for e in es]
        os = [ops.einsum("bask,bakd->basd", e, vb, partial=True) for e, (_, vb, _) in zip(es, blocks)]
        return ops.attention_output(combine(os, order), combine(ls, order))

    ab = [None] * (len(cuts) + 1) if allowed is None else np.split(allowed, cuts, 1)
    blocks = list(zip(np.split(k, cuts, 2), np.split(v, cuts, 2), ab))
    assert core(blocks).tobytes() == core([(k, v, allowed)]).tobytes()


@given(st.integers(1, 300), st.integers(0, 299), st.integers(1, 4), st.integers(0, 2**16))
def test_transcendentals_do_not_depend_on_shape_or_stride(n, at, stride, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n * stride) * 4).astype(np.float32)
    at = at % n
    for f in (ops.exp, ops.log, ops._num.tanh):
        arg = np.abs(x) + np.float32(1e-3) if f is ops.log else x
        alone = f(arg[at * stride: at * stride + 1])
        strided = f(arg[::stride])[at]
        assert alone[0].tobytes() == strided.tobytes()


def test_out_of_window_and_non_finite_inputs_are_reported():
    assert ops.sum(np.array([3e9, 1.0, -3e9], np.float32), 0) == 1.0  # large, inside the window: exact
    with pytest.raises(OverflowError, match=r"outside the exact window \[2\*\*-160, 2\*\*40\)"):
        ops.sum(np.array([1e13], np.float32), 0)
    with pytest.raises(OverflowError, match="outside the exact window"):
        ops.matmul(np.array([[4e6]], np.float32), np.array([[4e6]], np.float32))
    with pytest.raises(FloatingPointError, match=r"non-finite input inf at index \(1, 0\)"):
        ops.matmul(np.array([[1.0], [np.inf]], np.float32), np.ones((1, 1), np.float32))
    with pytest.raises(FloatingPointError, match="non-finite input nan"):
        ops.sum(np.array([1.0, np.nan], np.float32), 0)


def test_exact_mode_is_at_least_as_accurate_as_fast_mode():
    fast = make_ops("fast")
    rng = np.random.default_rng(7)
    worse = 0
    for _ in range(50):
        a, b = rand(rng, (8, 300), 12), rand(rng, (300, 8), 12)
        truth = a.astype(np.float64) @ b.astype(np.float64)  # products and short sums exact enough here
        err_exact = np.abs(ops.matmul(a, b).astype(np.float64) - truth)
        err_fast = np.abs(fast.matmul(a, b).astype(np.float64) - truth)
        worse += int(np.sum(err_exact > err_fast))
        # exact mode is correctly rounded: within half an ulp of float32
        ulp = np.spacing(np.abs(truth).astype(np.float32)).astype(np.float64)
        assert np.all(err_exact <= 0.5 * ulp + 1e-30)
    assert worse == 0


def test_sliced_einsum_equals_rational_arithmetic():
    from fractions import Fraction

    rng = np.random.default_rng(3)
    a, b = rand(rng, (3, 17), 15), rand(rng, (17, 2), 15)
    got = exact.matmul(a, b)
    for i in range(3):
        for j in range(2):
            want = sum(Fraction(float(a[i, k])) * Fraction(float(b[k, j])) for k in range(17))
            have = sum(Fraction(int(got[i, j, n])) * Fraction(2) ** (-160 + 32 * n) for n in range(got.shape[-1]))
            assert have == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_slices_add_up_to_the_operand_truncated_to_the_grid_and_sit_where_its_bits_are(dtype):
    """x == sum X * 2**e for the slices of x on a grid from 2**-80 (bits below it dropped, toward zero),
    each |X| < 2**beta and integer; values within one slice's width of bits take one slice (the
    grid's bottom at the lowest bit their dtype can set, not at a fixed multiple of beta from 2**-80)."""
    from fractions import Fraction

    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11)
    for scale in (1e-30, 2.0**-75, 1e-3, 1.0, 3e4):
        x = (rng.standard_normal((3, 5)) * scale).astype(dt)
        x[0, 0] = 0
        beta = 23
        got = exact.slices(x, beta, exact.PRODUCT_LO)
        for _, xs in got:
            assert np.all(xs == np.trunc(xs)) and np.all(np.abs(xs) < 2.0**beta)
        for i in range(3):
            for j in range(5):
                want = Fraction(float(x[i, j]))
                grid = Fraction(2) ** exact.PRODUCT_LO
                want = (abs(want) // grid) * grid * (1 if want >= 0 else -1)
                assert sum(Fraction(float(xs[i, j])) * Fraction(2) ** e for e, xs in got) == want
    one = np.array([1.0, 1.5, -1.75, 2.0 - 2.0**-6], dt)  # one exponent: the dtype's significand wide
    assert len(exact.slices(one, 25, exact.PRODUCT_LO)) == (2 if dtype == "float64" else 1)  # (53 bits > 25)


def test_transcendentals_agree_with_numpy_in_float64():
    x = np.linspace(-30, 30, 10001)
    np.testing.assert_allclose(transcendental.exp(x), np.exp(x), rtol=4e-16)
    np.testing.assert_allclose(transcendental.tanh(x), np.tanh(x), rtol=4e-16, atol=1e-300)
    np.testing.assert_allclose(transcendental.log(np.abs(x) + 1e-9), np.log(np.abs(x) + 1e-9), rtol=8e-16)


@given(st.integers(1, 4), st.integers(1, 30), st.integers(1, 4), st.integers(0, 2**16), st.data())
def test_bf16_storage_matmul_split_and_rounding(m, k, n, seed, data):
    """bf16 operands: the split is still exact, and the one rounding to bf16 is correct."""
    from fractions import Fraction

    from simcluster.numerics.limbs import BF16

    rng = np.random.default_rng(seed)
    a, b = rand(rng, (m, k), 4).astype(BF16), rand(rng, (k, n), 4).astype(BF16)
    cuts, order = data.draw(split_of(k))
    whole = ops.matmul(a, b, partial=True)
    parts = [ops.matmul(x, y, partial=True) for x, y in zip(np.split(a, cuts, 1), np.split(b, cuts, 0))]
    assert combine(parts, order).limbs.tobytes() == whole.limbs.tobytes()
    got = ops.finalize(whole)
    assert got.dtype == BF16
    for i in range(m):
        for j in range(n):
            exact_value = sum(Fraction(float(a[i, t])) * Fraction(float(b[t, j])) for t in range(k))
            bits = got[i, j:j + 1].view(np.uint16)
            neighbours = [(bits + np.uint16(1)).view(BF16)[0], (bits - np.uint16(1)).view(BF16)[0]]
            mine = abs(Fraction(float(got[i, j])) - exact_value)
            # nearest representable: no adjacent bf16 value is closer
            for other in neighbours:
                if np.isfinite(float(other)):
                    assert mine <= abs(Fraction(float(other)) - exact_value)
