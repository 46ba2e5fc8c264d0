"""The kernels an eager PyTorch Llama layer launches (`model.fused_kernels = false`, model/eager.py),
written out here from torchtitan's code of 2024-12-26 (models/norms.py RMSNorm, models/llama/model.py
apply_rotary_emb, repeat_kv, Attention, FeedForward, TransformerBlock), op by op, and checked against
the kernels the emulator's trace shows for one layer's forward."""

from __future__ import annotations

import pytest

from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario
from simcluster.topology.presets import preset

H, HEADS, KV, F, S = 256, 4, 2, 512, 128
SETS = ["model.arch=llama", "model.layers=1", f"model.hidden={H}", f"model.heads={HEADS}", f"model.kv_heads={KV}",
        f"model.ffn_hidden={F}", f"model.seq={S}", "model.vocab=512", "model.global_batch=1", "run.numerics=meta",
        "run.steps=1", "cluster.preset=dgx-h100", "cluster.gpus_per_node=1", "cluster.nodes=1", "parallel.dp=1"]

# x.float(); .pow(2); .mean(-1, keepdim=True); + eps; torch.rsqrt; x * rstd; .type_as(x); * self.weight
NORM = ["rms_norm.float", "rms_norm.pow", "rms_norm.mean", "rms_norm.add_eps", "rms_norm.rsqrt", "rms_norm.mul_rstd",
        "rms_norm.type_as", "rms_norm.mul_weight"]
# view_as_complex(x.float()...) * freqs_cis, view_as_real(...).type_as(x)
ROPE = ["rope.cast_up", "rope.complex_mul", "rope.cast_down"]
# h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)), in TransformerBlock.forward's order
# (wq's output is rotated before wk's is: this model rotates each as it comes; the kernels are the same)
LAYER = (NORM + ["matmul"] + ROPE + ["matmul"] + ROPE + ["repeat_kv", "matmul", "repeat_kv", "flash_attention",
         "matmul_partial", "add"] + NORM + ["matmul", "matmul", "silu", "mul", "matmul_partial", "add"])


def forward_kernels(extra: list[str]):
    out = run_scenario(load(None, SETS + extra), trace=True)
    return [e for e in out.result.trace.events if e.rank == 0 and e.name.startswith("F0:block0/")]


def names(events) -> list[str]:
    return [e.name.split("/", 1)[1] for e in events]


def test_an_eager_llama_layers_forward_launches_torchtitans_kernels():
    events = forward_kernels(["model.dtype=bf16", "model.fused_kernels=false"])
    assert names(events) == LAYER


def test_the_fused_layer_is_a_different_list_so_the_check_can_fail():
    """The default (torch.compile's and Megatron-Core's fused RMSNorm) is not the eager list."""
    fused = names(forward_kernels(["model.dtype=bf16"]))
    assert fused != LAYER and fused.count("rms_norm") == 2 and "rms_norm.pow" not in fused


def test_an_fp32_eager_layer_has_no_casts():
    """torch's .float() and .type_as return an fp32 tensor itself: no kernel."""
    want = [k for k in LAYER if k not in ("rms_norm.float", "rms_norm.type_as", "rope.cast_up", "rope.cast_down")]
    assert names(forward_kernels(["model.dtype=fp32", "model.fused_kernels=false"])) == want


def test_the_eager_kernels_move_the_bytes_their_tensors_hold():
    """bf16 (2 bytes), n = S x H elements for the norm; q's (S x H) and k's (S x KV x H/HEADS) for the
    rotation, with freqs_cis's S x d/2 complex64 (4 S d bytes); repeat_kv reads k and writes it twice.
    A kernel's time is the larger of its FLOPs and its bytes at the H100's rates, plus the launch gap:
    the bytes are read back from a kernel's time where it is memory-bound (all of these are)."""
    spec = preset("dgx-h100")
    rate = spec.hbm_gbyte_per_s * spec.memory_efficiency  # bytes a ns
    events = forward_kernels(["model.dtype=bf16", "model.fused_kernels=false"])
    moved = [round((e.duration - spec.kernel_overhead_ns) * rate) for e in events]
    n, d = S * H, H // HEADS
    nk = S * KV * d
    by_name = {}
    for name, b in zip(names(events), moved):
        by_name.setdefault(name, []).append(b)
    expect = {"rms_norm.float": 6 * n, "rms_norm.pow": 8 * n, "rms_norm.mul_rstd": 8 * n + 4 * S,
              "rms_norm.type_as": 6 * n, "rms_norm.mul_weight": 4 * n + 2 * H}
    for name, b in expect.items():
        assert by_name[name][0] == pytest.approx(b, abs=rate + 1), name  # (a duration is whole ns)
    assert by_name["rope.complex_mul"][0] == pytest.approx(8 * n + 4 * S * d, abs=rate + 1)  # q
    assert by_name["rope.complex_mul"][1] == pytest.approx(8 * nk + 4 * S * d, abs=rate + 1)  # k
    assert by_name["repeat_kv"][0] == pytest.approx(3 * nk * 2, abs=rate + 1)


def test_an_eager_norms_backward_is_autograds_sixteen_kernels():
    out = run_scenario(load(None, SETS + ["model.dtype=bf16", "model.fused_kernels=false"]), trace=True)
    backward = [e.name.split("/", 1)[1] for e in out.result.trace.events
                if e.rank == 0 and e.name.startswith("B0:block0/")]
    norm = [k for k in backward if k.startswith("rms_norm_backward.")]
    assert len(norm) == 2 * 16 and backward.count("rope_backward.complex_mul") == 2
    assert out.report["layer"]["kernels"]["forward"] == len(LAYER)


def backward_kernels(extra: list[str]) -> list:
    out = run_scenario(load(None, SETS + extra), trace=True)
    return [e for e in out.result.trace.events if e.rank == 0 and e.name.startswith("B0:block0/")]


def test_swiglu_is_one_kernel_each_way_when_fused_and_autograds_kernels_when_not():
    """Fused (Megatron-Core's fused_bias_swiglu.py, on by default: --no-bias-swiglu-fusion turns it off;
    torch.compile fuses the pointwise ops alike): silu(f1) * f3 one kernel, and its backward one kernel that
    makes silu(f1) again on chip. Eager: silu and the product forward; backward, autograd's two products and
    silu's backward, silu's output read where the forward kept it (no silu again)."""
    fused = names(forward_kernels(["model.dtype=bf16"]))
    assert fused[-6:] == ["rms_norm", "matmul", "matmul", "swiglu", "matmul_partial", "add"]
    assert "silu" not in fused
    back = names(backward_kernels(["model.dtype=bf16"]))
    assert back.count("swiglu_backward") == 1 and not {"silu", "silu_backward"} & set(back)
    eager = names(backward_kernels(["model.dtype=bf16", "model.fused_kernels=false"]))
    assert eager[:5] == ["einsum_partial", "matmul", "mul", "mul", "silu_backward"] and "silu" not in eager


def test_the_fused_swiglu_moves_its_inputs_and_outputs_once():
    """Forward: reads f1 and f3, writes the product (3 x S x F bf16 elements); backward: reads the product's
    gradient, f1 and f3, writes df1 and df3 (5 x). Read back from the kernels' times, as above."""
    spec = preset("dgx-h100")
    rate = spec.hbm_gbyte_per_s * spec.memory_efficiency  # bytes a ns
    moved = {e.name.split("/", 1)[1]: round((e.duration - spec.kernel_overhead_ns) * rate)
             for e in forward_kernels(["model.dtype=bf16"]) + backward_kernels(["model.dtype=bf16"])}
    assert moved["swiglu"] == pytest.approx(3 * S * F * 2, abs=rate + 1)
    assert moved["swiglu_backward"] == pytest.approx(5 * S * F * 2, abs=rate + 1)
