"""Kernels not covered by the model test, against torch (float64), and the model on drawn configurations."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")
import torch.nn.functional as F  # noqa: E402

from simcluster.model.gpt import ModelConfig  # noqa: E402
from simcluster.numerics.modes import make_ops  # noqa: E402

pytestmark = pytest.mark.torch
fast, exact = make_ops("fast"), make_ops("exact")


def test_rms_norm_forward_and_backward():
    rng = np.random.default_rng(0)
    x, g, dy = rng.standard_normal((3, 5, 8)), rng.standard_normal(8), rng.standard_normal((3, 5, 8))
    y, rstd = fast.rms_norm(x, g, 1e-6)
    dx, dg = fast.rms_norm_backward(dy, x, g, rstd)
    dg = dg.finalize(np.float64)  # a partial sum over the rows, as the contract has it
    tx, tg = torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)
    ty = F.rms_norm(tx, (8,), tg, 1e-6)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dg, tg.grad.numpy(), rtol=1e-10, atol=1e-12)
    # and exact mode in float32 to float32 rounding
    y32, r32 = exact.rms_norm(x.astype(np.float32), g.astype(np.float32), 1e-6)
    np.testing.assert_allclose(y32, ty.detach().numpy(), rtol=2e-6, atol=2e-6)


def test_softmax_log_softmax_mean_and_sgd():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 7)) * 3).astype(np.float32)
    t = torch.tensor(x, dtype=torch.float64)
    np.testing.assert_allclose(exact.softmax(x), torch.softmax(t, -1).numpy(), rtol=3e-7, atol=1e-9)
    np.testing.assert_allclose(exact.log_softmax(x), torch.log_softmax(t, -1).numpy(), rtol=3e-7, atol=3e-7)
    np.testing.assert_allclose(exact.mean(x, 0), t.mean(0).numpy(), rtol=3e-7, atol=1e-7)
    w = rng.standard_normal(5).astype(np.float32)
    assert exact.sgd(w, w, lr=0.5).tobytes() == (w - np.float32(0.5) * w).tobytes()


@settings(max_examples=10)
@given(layers=st.integers(1, 2), heads=st.integers(1, 3), per_head=st.integers(1, 4), ffn=st.integers(1, 12),
       seq=st.integers(1, 6), vocab=st.integers(2, 12), causal=st.booleans(), tied=st.booleans(),
       dropout=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 1000))
def test_model_matches_torch_on_drawn_configurations(layers, heads, per_head, ffn, seq, vocab, causal, tied,
                                                     dropout, seed):
    from test_model_vs_torch import ours, torch_loss_and_grads, worst_relative_error

    # hidden >= 4: a layer norm over one or two elements outputs +-1 whatever its input, so gradients
    # through it are eps-sized and compared against float64 noise
    hidden = heads * per_head if heads * per_head >= 4 else heads * 4
    cfg = ModelConfig(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn, seq=seq, vocab=vocab,
                    causal=causal, tied_head=tied, dropout=dropout, seed=seed)
    params, ids, targets, loss, grads = ours(cfg, "fast", np.float64, batch_size=2)
    want_loss, want = torch_loss_and_grads(cfg, params, ids, targets, 0)
    assert abs(loss - want_loss) <= 1e-10 * abs(want_loss)
    assert worst_relative_error(grads, want) < 1e-10
