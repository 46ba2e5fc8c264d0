"""Activation memory per layer, from the engine's accounting in meta mode: Korthikanti et al. 2022,
Table 2 (16-bit activations, 1-byte dropout masks, the attention core unfused as in the paper; its
models drop out), one test per row; then the fused (flash) kernel, which keeps softmax statistics instead
of s x s tensors; a model without dropout, which keeps no masks; and each MLP kind's width."""

import pytest

from simcluster.engine import simulate
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

s, b, h, a = 512, 2, 1024, 16


def held_per_layer(program, cfg, mesh):
    trace = simulate(program, cfg, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=mesh.world_size),
                     mode="meta").trace
    holds = [e.bytes for e in trace.memory if e.rank == 0 and e.category == "activations" and e.bytes > 0
             and "block0" in e.name]
    return holds[0]


def model(recompute="none", kernel="unfused"):
    return ModelConfig(layers=2, hidden=h, heads=a, ffn_hidden=4 * h, seq=s, vocab=64, recompute=recompute,
                     dtype="bf16", tied_head=False, attention_kernel=kernel, dropout=0.1)


def tp_layer(t, sp=False, recompute="none", kernel="unfused"):
    data = TrainingConfig(model=model(recompute, kernel), global_batch=b, steps=1, precision="bf16")
    return held_per_layer(composed, Parallelism(data=data, sp=sp), DeviceMesh(tp=t))


def test_no_parallelism():
    data = TrainingConfig(model=model(), global_batch=b, steps=1, precision="bf16")
    assert held_per_layer(composed, Parallelism(data=data), DeviceMesh()) == s * b * h * (34 + 5 * a * s / h)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_parallel(t):
    assert tp_layer(t) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_and_sequence_parallel(t):
    assert tp_layer(t, sp=True) == s * b * h * (34 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("t", [2, 8])
def test_tensor_parallel_with_selective_recomputation(t):
    assert tp_layer(t, recompute="selective") == s * b * h * (10 + 24 / t)


@pytest.mark.parametrize("t", [2, 8])
def test_tensor_and_sequence_parallel_with_selective_recomputation(t):
    assert tp_layer(t, sp=True, recompute="selective") == s * b * h * 34 / t


@pytest.mark.parametrize("t", [1, 4])
def test_full_recomputation(t):
    assert tp_layer(t, recompute="full") == s * b * h * 2


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_context_parallel_shards_everything_like_tp_plus_sp(attention):
    P = 4
    data = TrainingConfig(model=model(), global_batch=b, steps=1, precision="bf16")
    got = held_per_layer(composed, Parallelism(data=data, attention=attention), DeviceMesh(cp=P))
    assert got == s * b * h * (34 / P + 5 * a * s / (h * P))


@pytest.mark.parametrize("t,sp", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_flash_attention_keeps_statistics_not_scores(t, sp, recompute):
    """What selective recomputation keeps, plus one fp32 per query row and head: with or without it."""
    statistics = 4 * a * s * b / t
    outside = t if sp else 1
    assert tp_layer(t, sp=sp, recompute=recompute, kernel="flash") == s * b * h * (10 / outside + 24 / t) + statistics


def llama_layer(f, fused=True, gqa="repeat_kv", kv=16):
    m = ModelConfig(arch="llama", layers=2, hidden=h, heads=a, kv_heads=kv, ffn_hidden=f, seq=s, vocab=64,
                    dtype="bf16", tied_head=False, attention_kernel="flash", fused_kernels=fused, gqa=gqa)
    data = TrainingConfig(model=m, global_batch=b, steps=1, precision="bf16")
    return held_per_layer(composed, Parallelism(data=data), DeviceMesh())


@pytest.mark.parametrize("fused, kept", [(True, 3), (False, 4)])
def test_a_swiglu_mlp_keeps_its_width_three_or_four_times(fused, kept):
    """A Llama block's MLP terms are its width f's: Megatron-Core's fused SwiGLU keeps its input (w1's and
    w3's outputs) and w2 its output, 3 s b f 16-bit values; eager PyTorch keeps SiLU's output too (4, as
    `test_eager_autograd_keeps_what_the_formula_counts` measures). Twice the width: that many more."""
    assert llama_layer(2048, fused) - llama_layer(1024, fused) == kept * s * b * 1024 * 2


def test_native_gqa_keeps_the_kv_heads_keys_and_values():
    """With the kv heads taken as they are, the attention kernel keeps 4 heads' keys and values, not the
    16 repeats: 2 x 12 heads x s b d 16-bit values fewer."""
    assert llama_layer(1024, gqa="repeat_kv", kv=4) - llama_layer(1024, gqa="native", kv=4) == 2 * 12 * s * b * 64 * 2


def test_eager_autograd_keeps_what_the_formula_counts():
    """torch's own autograd, eager, on an MLP of each kind: the distinct tensors it saves for the backward,
    past the MLP's input, are GELU's input and output (2f) and SwiGLU's w1 and w3 outputs, SiLU's output
    and the product (4f), as activations.py charges them."""
    torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")
    import torch.nn.functional as F

    def saved(fn, x):
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x).sum()
        kept.pop(x.untyped_storage().data_ptr(), None)  # (the MLP's input: the formula's "mlp input")
        return kept

    tokens, width, f = 8, 16, 40
    x = torch.randn(tokens, width, dtype=torch.bfloat16)
    w1, w2, w3 = (torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
                  for shape in ((width, f), (f, width), (width, f)))
    gelu = saved(lambda x: F.gelu(x @ w1) @ w2, x)
    swiglu = saved(lambda x: (F.silu(x @ w1) * (x @ w3)) @ w2, x)
    weights = {w.untyped_storage().data_ptr() for w in (w1, w2, w3)}
    assert sorted(n for p, n in gelu.items() if p not in weights) == [tokens * f * 2] * 2
    assert sorted(n for p, n in swiglu.items() if p not in weights) == [tokens * f * 2] * 4


@pytest.mark.parametrize("kernel, masks", [("flash", 2 * s * b * h), ("unfused", 2 * s * b * h + 3 * a * s * s * b)])
def test_a_model_without_dropout_keeps_no_masks(kernel, masks):
    """Without dropout a layer keeps no dropout mask (the residual branches' two, 1 byte each) and, unfused,
    neither the softmax's mask nor its dropped-out copy: torch's dropout at p = 0 returns its input and
    saves nothing (measured below)."""
    from dataclasses import replace
    data = TrainingConfig(model=model(kernel=kernel), global_batch=b, steps=1, precision="bf16")
    dry = replace(data, model=replace(data.model, dropout=0.0))
    held = [held_per_layer(composed, Parallelism(data=d), DeviceMesh()) for d in (data, dry)]
    assert held[0] - held[1] == masks


def test_torch_saves_no_mask_without_dropout():
    torch = pytest.importorskip("torch", reason="torch is the gpu_backend extra; the test set-up installs it")
    for p, saves in ((0.0, 0), (0.1, 1)):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            torch.nn.functional.dropout(torch.randn(4, 8, requires_grad=True), p=p, training=True)
        assert len(kept) == saves
