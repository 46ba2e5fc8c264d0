"""The reference model against torch autograd (the one place an outside implementation judges ours).

Same weights, same tokens, same dropout masks; torch runs in float64 with autograd. Our fast mode in
float64 must agree to 1e-10 relative; our exact mode in float32 must agree to float32 rounding.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")
import torch.nn.functional as F  # noqa: E402

from simcluster.model.gpt import GPT, ModelConfig, batch, init_params  # noqa: E402
from simcluster.numerics.modes import make_ops  # noqa: E402

pytestmark = pytest.mark.torch

CONFIGS = [
    ModelConfig(layers=2, hidden=16, heads=4, ffn_hidden=32, seq=8, vocab=24, causal=True, tied_head=True, seed=1),
    ModelConfig(layers=1, hidden=12, heads=3, ffn_hidden=20, seq=6, vocab=10, causal=False, tied_head=False, seed=2),
    ModelConfig(layers=2, hidden=8, heads=2, ffn_hidden=24, seq=5, vocab=16, causal=True, tied_head=False,
              dropout=0.2, seed=3),
    ModelConfig(layers=1, hidden=16, heads=2, ffn_hidden=16, seq=7, vocab=20, causal=False, tied_head=True,
              dropout=0.1, seed=4),
]


def torch_loss_and_grads(cfg, params, ids, targets, step):
    """The same model, written the usual way in torch, with our dropout masks."""
    ops = make_ops("fast")
    P = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in params.items()}
    seed = cfg.seed + 7919 * step
    c = 1.0 / (1.0 - cfg.dropout)

    def drop(x, name):
        if cfg.dropout == 0:
            return x
        keep = torch.tensor(ops.dropout_keep(seed, name, tuple(x.shape), cfg.dropout))
        return torch.where(keep, x, torch.zeros(())) * c

    b, s = ids.shape
    a, d = cfg.heads, cfg.head_dim
    x = P["wte"][torch.tensor(ids)] + P["wpe"][torch.arange(s)]
    x = drop(x, "embed")
    for i in range(cfg.layers):
        p = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
        h = F.layer_norm(x, (cfg.hidden,), p("ln1.g"), p("ln1.b"), cfg.eps)
        q, k, v = (h @ p("attn.w_qkv") + p("attn.b_qkv")).split(cfg.hidden, dim=-1)
        q, k, v = (t.reshape(b, s, a, d).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / np.sqrt(d)
        if cfg.causal:
            scores = scores.masked_fill(~torch.tril(torch.ones(s, s, dtype=torch.bool)), float("-inf"))
        probs = drop(torch.softmax(scores, dim=-1), f"attn.{i}")
        ctx = (probs @ v).transpose(1, 2).reshape(b, s, cfg.hidden)
        x = x + drop(ctx @ p("attn.w_proj") + p("attn.b_proj"), f"resid_attn.{i}")
        h = F.layer_norm(x, (cfg.hidden,), p("ln2.g"), p("ln2.b"), cfg.eps)
        z = F.gelu(h @ p("mlp.w_fc") + p("mlp.b_fc"), approximate="tanh") @ p("mlp.w_out") + p("mlp.b_out")
        x = x + drop(z, f"resid_mlp.{i}")
    x = F.layer_norm(x, (cfg.hidden,), P["lnf.g"], P["lnf.b"], cfg.eps)
    logits = x @ (P["wte"].T if cfg.tied_head else P["head"])
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), torch.tensor(targets).reshape(-1))
    loss.backward()
    return float(loss.detach()), {k: t.grad.numpy() for k, t in P.items()}


def ours(cfg, mode, dtype, step=0, batch_size=3):
    ops = make_ops(mode)
    params = {k: v.astype(dtype) for k, v in init_params(ops, cfg).items()}
    ids, targets = batch(cfg, cfg.seed, step, batch_size)
    model = GPT(ops, cfg)
    loss_sum, cache = model.forward(params, ids, targets, step)
    grads = model.finish(model.backward(params, cache, step))
    return params, ids, targets, float(model.loss(loss_sum, cache["where"])), grads


def worst_relative_error(grads, want):
    """Largest error of any gradient, relative to that gradient's largest entry.

    Float64 rounding noise is about 1e-16 of the largest gradient anywhere; a gradient tensor far
    smaller than that (layer norm over two elements, say) would turn that noise into a large relative
    error, so each tensor's scale is at least 1e-5 of the largest gradient entry anywhere.
    """
    assert set(grads) == set(want)
    floor = 1e-5 * max(float(np.max(np.abs(w))) for w in want.values())
    return max(float(np.max(np.abs(grads[k] - want[k]))) / max(float(np.max(np.abs(want[k]))), floor, 1e-300)
               for k in want)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c.layers}h{c.hidden}{'c' if c.causal else 'f'}"
                                                      f"{'t' if c.tied_head else 'u'}p{c.dropout}")
def test_fast_float64_matches_torch_autograd(cfg):
    params, ids, targets, loss, grads = ours(cfg, "fast", np.float64)
    want_loss, want = torch_loss_and_grads(cfg, params, ids, targets, 0)
    assert abs(loss - want_loss) / abs(want_loss) < 1e-10
    assert worst_relative_error(grads, want) < 1e-10


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c.layers}h{c.hidden}{'c' if c.causal else 'f'}"
                                                      f"{'t' if c.tied_head else 'u'}p{c.dropout}")
def test_exact_float32_matches_torch_to_float32_rounding(cfg):
    params, ids, targets, loss, grads = ours(cfg, "exact", np.float32)
    want_loss, want = torch_loss_and_grads(cfg, params, ids, targets, 0)
    # measured: the loss within 0.6 ulp of float32 (2**-24), gradients within 2e-6 of their largest entry
    assert abs(loss - want_loss) / abs(want_loss) < 4 * 2.0**-24
    assert worst_relative_error(grads, want) < 2e-5


def test_a_wrong_backward_is_caught():
    """The comparison can fail: drop the layer-norm gain from one gradient."""
    cfg = CONFIGS[0]
    params, ids, targets, _, grads = ours(cfg, "fast", np.float64)
    _, want = torch_loss_and_grads(cfg, params, ids, targets, 0)
    grads["layers.0.ln1.g"] = grads["layers.0.ln1.g"] * 1.001
    assert worst_relative_error(grads, want) > 1e-4


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c.layers}h{c.hidden}{'c' if c.causal else 'f'}"
                                                      f"{'t' if c.tied_head else 'u'}p{c.dropout}")
def test_fast_bf16_loss_is_within_a_bf16_rounding_of_torch_float64(cfg):
    """Fast mode as a GPU computes (bf16 storage, fp32 accumulation, fp32 statistics in norms, softmax
    and the loss): the loss of bf16 weights within 2**-8 (bf16's unit roundoff: the activations, the
    attention scores and the logits are bf16, as the GEMMs write them) of float64 torch on the same
    weights. Measured: 1.6e-4 to 2.2e-3 over these models; accumulating in bf16, as numpy does on bf16
    arrays, put it 5-7 % off."""
    from simcluster.numerics.limbs import BF16

    params, ids, targets, loss, _ = ours(cfg, "fast", BF16)
    want_loss, _ = torch_loss_and_grads(cfg, params, ids, targets, 0)
    assert abs(loss - want_loss) / abs(want_loss) < 2.0**-8


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("size", [(4, 128, 8, 512, 64, 512, 0.0), (2, 64, 4, 256, 32, 256, 0.1)],
                         ids=["L4h128", "L2h64p0.1"])
def test_fast_bf16_loss_is_within_2e_4_of_float64(size, seed):
    """Issue 40's bound on models past the toy sizes above (whose few elements make the error a draw:
    1e-4 to 2.6e-3 over seeds of the h = 8 one): measured 1.5e-5 to 6.1e-5. With the dropout scale
    rounded to bf16 before it multiplied (1/(1 - 0.1) as 1.109375), seed 2's h = 64 model was 3.2e-4."""
    from simcluster.numerics.limbs import BF16

    layers, h, a, f, s, v, p = size
    cfg = ModelConfig(layers=layers, hidden=h, heads=a, ffn_hidden=f, seq=s, vocab=v, causal=True, tied_head=False,
                      dropout=p, seed=seed)
    params, ids, targets, loss, _ = ours(cfg, "fast", BF16, batch_size=4)
    want_loss, _ = torch_loss_and_grads(cfg, params, ids, targets, 0)
    assert abs(loss - want_loss) / abs(want_loss) <= 2e-4


def test_fast_bf16_dropout_scales_in_fp32_as_torch_does():
    """A bf16 tensor dropped: our mask, then 1/(1 - p) in fp32 and one rounding, as torch's kernels compute
    a bf16 tensor times a Python float (opmath float), byte for byte."""
    from simcluster.numerics.limbs import BF16

    ops = make_ops("fast")
    x = (np.random.default_rng(0).standard_normal((4, 64)) * 3).astype(BF16)
    keep = ops.dropout_keep(7, "resid", x.shape, 0.1)
    ours_ = np.asarray(ops.scale(ops.zero_where(keep, x), 1.0 / 0.9))
    t = torch.tensor(x.astype(np.float32)).to(torch.bfloat16)
    theirs = torch.where(torch.tensor(keep), t, torch.zeros((), dtype=t.dtype)) * (1.0 / 0.9)  # (+0 where dropped)
    assert ours_.tobytes() == theirs.to(torch.float32).numpy().astype(BF16).tobytes()
    assert ours_.tobytes() != (np.where(keep, x, BF16.type(0)) * BF16.type(1.0 / 0.9)).tobytes()  # (scale rounded first)


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_a_16_bit_models_cross_entropy_is_computed_in_fp32(mode):
    """As Megatron-LM (`output.float()` before its cross-entropy) and torchtitan: the head's bf16 logits,
    as its GEMM writes them, upcast, their softmax, log-sum-exp and loss in fp32. The loss is then the
    float64 cross-entropy of those same logits to fp32's rounding (a bf16 loss was ~1e-3 off), and the
    logits' gradient goes back to the GEMMs in bf16."""
    from simcluster.numerics.limbs import BF16

    cfg = ModelConfig(layers=1, hidden=64, heads=4, ffn_hidden=64, seq=32, vocab=512, tied_head=False, seed=5)
    ops = make_ops(mode)
    params = {k: v.astype(BF16) for k, v in init_params(ops, cfg).items()}
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, cfg.seq, cfg.hidden)) * 3).astype(BF16)
    targets = rng.integers(0, cfg.vocab, (2, cfg.seq))
    model = GPT(ops, cfg)
    loss_sum, hc = model.head_forward(params, x, targets)
    ours = float(np.asarray(ops.finalize(loss_sum), np.float64))
    logits = np.asarray(ops.matmul(hc["xf"], params["head"]), np.float64)  # the bf16 logits the GEMM wrote
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    want = float((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).sum())
    assert abs(ours - want) <= 2e-6 * abs(want)
    assert hc["low"] == "bf16" and ops.xp.name(hc["e"].dtype) == "fp32"
