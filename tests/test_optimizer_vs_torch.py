"""AdamW with weight decay and clipping by global norm, against torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ over several steps (float32: within rounding)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")

from simcluster.model.optimizer import adam_init, adam_step, clip_by_norm, square_sum  # noqa: E402
from simcluster.numerics.modes import make_ops  # noqa: E402

pytestmark = pytest.mark.torch

SHAPES = {"w": (6, 5), "b": (5,), "g": (7,)}


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("weight_decay,max_norm", [(0.0, None), (0.1, None), (0.01, 1.0), (0.1, 0.05)])
def test_adamw_and_clipping_match_torch(mode, weight_decay, max_norm):
    ops = make_ops(mode)
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    mine = {k: v.copy() for k, v in params.items()}
    state = adam_init(ops, mine)
    theirs = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = torch.optim.AdamW(theirs.values(), lr=1e-2, weight_decay=weight_decay)
    clipped = 0
    for _ in range(5):
        grads = {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in SHAPES.items()}
        if max_norm is not None:
            before = grads
            grads = clip_by_norm(ops, grads, square_sum(ops, list(grads.values())), max_norm)
            clipped += grads is not before
        mine = adam_step(ops, mine, grads, state, lr=1e-2, weight_decay=weight_decay)
        for k, p in theirs.items():
            p.grad = torch.tensor(before[k] if max_norm is not None else grads[k])
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(theirs.values()), max_norm)
        opt.step()
        for k, p in theirs.items():
            assert np.allclose(mine[k], p.detach().numpy(), rtol=0, atol=4e-6), k
            assert np.allclose(state.m[k], opt.state[p]["exp_avg"].numpy(), rtol=1e-5, atol=1e-7), k
            assert np.allclose(state.v[k], opt.state[p]["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9), k
    if max_norm is not None:  # the clip was exercised: the gradients' norm is about 2.3 here
        assert clipped == 5
