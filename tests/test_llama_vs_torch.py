"""The Llama-style model (RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied head, no
biases) against the same model written the usual way in torch, float64 autograd: one forward and
backward, then several AdamW steps with weight decay and clipping by global norm.

Ours is the composed program on one rank (exact mode, float32): the single-device reference that every
layout of the Llama model is compared with byte for byte.
"""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")
import torch.nn.functional as F  # noqa: E402

from simcluster.model.gpt import ModelConfig, batch, init_params  # noqa: E402
from simcluster.numerics.modes import make_ops  # noqa: E402
from simcluster.parallel.data_parallel import TrainingConfig  # noqa: E402
from simcluster.parallel.llama_shard import rope_table  # noqa: E402
from simcluster.parallel.reference import reference  # noqa: E402

pytestmark = pytest.mark.torch

CONFIGS = [
    ModelConfig(arch="llama", layers=2, hidden=16, heads=4, kv_heads=2, ffn_hidden=24, seq=8, vocab=24, tied_head=False,
              seed=1),
    ModelConfig(arch="llama", layers=1, hidden=12, heads=3, kv_heads=1, ffn_hidden=20, seq=6, vocab=10, causal=False,
              tied_head=False, dropout=0.1, seed=2),
    ModelConfig(arch="llama", layers=2, hidden=8, heads=2, kv_heads=2, ffn_hidden=12, seq=5, vocab=16, tied_head=False,
              dropout=0.2, seed=3, rope_theta=500000.0),
]
IDS = [f"L{c.layers}h{c.hidden}a{c.heads}kv{c.kv_heads}p{c.dropout}" for c in CONFIGS]


def torch_loss(cfg, P, ids, targets, step):
    """The model in torch, with our dropout masks; P: name -> float64 tensor."""
    ops = make_ops("fast")
    seed, c = cfg.seed + 7919 * step, 1.0 / (1.0 - cfg.dropout)

    def drop(x, name):
        if cfg.dropout == 0:
            return x
        keep = torch.tensor(ops.dropout_keep(seed, name, tuple(x.shape), cfg.dropout))
        return torch.where(keep, x, torch.zeros(())) * c

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps) * g

    def rotate(x):  # (b, n, s, d): x cos + rotate_half(x) sin
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    b, s = ids.shape
    a, kv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    cos, sin = (torch.tensor(t) for t in rope_table(s, d, cfg.rope_theta))
    x = drop(P["wte"][torch.tensor(ids)], "embed")
    for i in range(cfg.layers):
        p = lambda n: P[f"layers.{i}.{n}"]  # noqa: E731
        h = rms(x, p("attn_norm.g"))
        q = rotate((h @ p("attn.wq")).reshape(b, s, a, d).transpose(1, 2))
        k = rotate((h @ p("attn.wk")).reshape(b, s, kv, d).transpose(1, 2)).repeat_interleave(a // kv, dim=1)
        v = (h @ p("attn.wv")).reshape(b, s, kv, d).transpose(1, 2).repeat_interleave(a // kv, dim=1)
        scores = q @ k.transpose(-1, -2) / np.sqrt(d)
        if cfg.causal:
            scores = scores.masked_fill(~torch.tril(torch.ones(s, s, dtype=torch.bool)), float("-inf"))
        ctx = (drop(torch.softmax(scores, dim=-1), f"attn.{i}") @ v).transpose(1, 2).reshape(b, s, cfg.hidden)
        x = x + drop(ctx @ p("attn.wo"), f"resid_attn.{i}")
        h = rms(x, p("mlp_norm.g"))
        x = x + drop((F.silu(h @ p("mlp.w1")) * (h @ p("mlp.w3"))) @ p("mlp.w2"), f"resid_mlp.{i}")
    logits = rms(x, P["lnf.g"]) @ P["head"]
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), torch.tensor(targets).reshape(-1))


def worst_relative_error(got, want):
    """Largest error of any tensor, relative to that tensor's largest entry (at least 1e-5 of the
    largest entry anywhere, so that a tiny tensor's rounding noise does not dominate)."""
    floor = 1e-5 * max(float(np.max(np.abs(w))) for w in want.values())
    return max(float(np.max(np.abs(got[k] - want[k]))) / max(float(np.max(np.abs(want[k]))), floor) for k in want)


def initial(cfg):
    return {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True)
            for k, v in init_params(make_ops("exact"), cfg).items()}


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_forward_and_backward_match_torch_autograd(cfg):
    B = 3
    ours = reference(TrainingConfig(model=cfg, global_batch=B, steps=1))
    P = initial(cfg)
    ids, targets = batch(cfg, cfg.seed, 0, B)
    loss = torch_loss(cfg, P, ids, targets, 0)
    loss.backward()
    assert abs(float(ours["loss[0]"]) - float(loss.detach())) / float(loss.detach()) < 4 * 2.0**-24
    grads = {k: np.asarray(ours[f"grads.{k}"], np.float64) for k in P}
    assert worst_relative_error(grads, {k: t.grad.numpy() for k, t in P.items()}) < 2e-5


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_adamw_steps_with_clipping_match_torch(cfg):
    B, steps, lr = 2, 3, 1e-3
    ours = reference(TrainingConfig(model=cfg, global_batch=B, steps=steps, lr=lr, weight_decay=0.1, clip_grad=0.5))
    P = initial(cfg)
    opt = torch.optim.AdamW(P.values(), lr=lr, weight_decay=0.1)
    for step in range(steps):
        ids, targets = batch(cfg, cfg.seed, step, B)
        opt.zero_grad()
        loss = torch_loss(cfg, P, ids, targets, step)
        loss.backward()
        assert abs(float(ours[f"loss[{step}]"]) - float(loss.detach())) / float(loss.detach()) < 1e-6
        torch.nn.utils.clip_grad_norm_(P.values(), 0.5)
        opt.step()
    got = {k: np.asarray(ours[f"params.{k}"], np.float64) for k in P}
    moved = {k: np.abs(got[k] - t.detach().numpy()).max() for k, t in P.items()}
    assert max(moved.values()) < 1e-5  # Adam's steps are lr = 1e-3 each: agreement to 1 % of one step


def test_a_wrong_rotation_is_caught(monkeypatch):
    """The comparison can fail: rotary angles of the wrong sign."""
    import simcluster.parallel.llama_shard as llama

    cfg = CONFIGS[0]
    real = llama.rope_table
    monkeypatch.setattr(llama, "rope_table", lambda *a: (real(*a)[0], -real(*a)[1]))
    reference.cache_clear()
    ours = reference(TrainingConfig(model=cfg, global_batch=3, steps=1))
    reference.cache_clear()
    P = initial(cfg)
    ids, targets = batch(cfg, cfg.seed, 0, 3)
    torch_loss(cfg, P, ids, targets, 0).backward()
    grads = {k: np.asarray(ours[f"grads.{k}"], np.float64) for k in P}
    assert worst_relative_error(grads, {k: t.grad.numpy() for k, t in P.items()}) > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_fast_bf16_loss_is_within_2e_4_of_float64(seed):
    """Issue 40's bound for the Llama (its 16-bit loss was 3.0e-3 off): fast mode on bf16 weights (the
    master's rounding, which torch is given as float64), RMSNorm statistics, softmax and the loss in
    fp32, against float64 torch on a Llama past the toy sizes above, over 1,024 tokens. Measured: 1.6e-6 to
    7.6e-5 (over 256 tokens the loss is a noisier mean: up to 2.6e-4)."""
    cfg = ModelConfig(arch="llama", layers=4, hidden=128, heads=8, kv_heads=2, ffn_hidden=384, seq=128, vocab=512,
                      tied_head=False, dropout=0.1, seed=seed)
    B = 8
    ours = reference(TrainingConfig(model=cfg, global_batch=B, steps=1, precision="bf16"), mode="fast")
    P = {k: torch.tensor(np.asarray(np.asarray(v, np.float32).astype(ml_dtypes.bfloat16), np.float64))
         for k, v in init_params(make_ops("exact"), cfg).items()}
    ids, targets = batch(cfg, cfg.seed, 0, B)
    want = float(torch_loss(cfg, P, ids, targets, 0))
    assert abs(float(ours["loss[0]"]) - want) / want <= 2e-4
