"""The report's literature measures: FLOPs as Megatron-LM and PaLM count them, and whether a run fits."""

import json
import math

import pytest

from simcluster.cli import main
from simcluster.model.config import ModelConfig
from simcluster.model.flops import step_flops
from simcluster.model.precision import model_state_bytes


@pytest.mark.parametrize("l,h,a,s,V", [(24, 2304, 24, 2048, 51200), (128, 25600, 160, 2048, 51200), (2, 64, 4, 32, 128)])
def test_flops_are_megatrons_closed_forms(l, h, a, s, V):
    """Narayanan et al. 2021, eq. 3 (full recomputation: 96), and Korthikanti et al. 2022 (model FLOPs: 72),
    for a GPT with a 4h MLP, B sequences of s tokens, its attention unfused (Megatron-LM's in 2021: the
    whole s x s square computed, masked)."""
    B = 8
    model = ModelConfig(layers=l, hidden=h, heads=a, ffn_hidden=4 * h, seq=s, vocab=V, tied_head=False,
                        attention_kernel="unfused")
    useful, _, _ = step_flops(model, B * s)
    assert useful == pytest.approx(72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)
    full = ModelConfig(**{**model.__dict__, "recompute": "full"})
    assert step_flops(full, B * s)[1] == pytest.approx(96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)),
                                                       rel=1e-12)
    selective = ModelConfig(**{**model.__dict__, "recompute": "selective"})  # again: QK^T and PV, 4Bs^2h a layer
    assert step_flops(selective, B * s)[1] - useful == pytest.approx(4 * B * s * s * h * l, rel=1e-12)


@pytest.mark.parametrize("s", [128, 2048, 8192, 131072])
def test_a_causal_flash_kernel_runs_the_blocks_up_to_the_diagonal(s):
    """FlashAttention's 128 x 128 tiles: of n = s/128 query blocks, block i runs key blocks 0..i, so the
    kernels run n(n + 1)/2 of the n^2 blocks: the hardware FLOPs' attention term is the full square's
    times (n + 1)/2n, never the whole square (at 128 tokens, one block: all of it); the causal model
    FLOPs count s(s + 1)/2 of the s^2 products; a bidirectional model runs and needs the whole square."""
    B, l, h, V = 4, 2, 256, 1000
    model = ModelConfig(layers=l, hidden=h, heads=4, ffn_hidden=4 * h, seq=s, vocab=V, tied_head=False)
    full_square, hardware, causal = step_flops(model, B * s)
    core = 3 * 4 * B * s * s * h * l  # forward and backward, QK^T and PV, every layer: the whole square
    n = s // 128
    assert full_square - hardware == pytest.approx(core * (1 - (n + 1) / (2 * n)), rel=1e-12)
    assert full_square - causal == pytest.approx(core * (1 - (s + 1) / (2 * s)), rel=1e-12)
    both = ModelConfig(**{**model.__dict__, "causal": False})
    assert len(set(step_flops(both, B * s))) == 1


def test_a_run_that_does_not_fit_fails_like_a_real_one(capsys):
    """DDP keeps 16 bytes a parameter (Rajbhandari et al. 2020): a device smaller than that cannot hold
    it, whatever the activations; a device of exactly the simulated peak can."""
    args = ["run", "zero_memory", "--json", "--set", "run.numerics=meta", "--set", "parallel.zero=0"]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)  # (--set parallel.zero=0 picks the one run of the comparison)
    psi, peak = rep["parameters"], rep["memory"]["peak_bytes"]
    states = psi * sum(model_state_bytes(1, "bf16").values())
    assert states == 16 * psi and peak > states  # and activations on top
    for capacity, fits in ((states - 1, False), (peak - 1, False), (peak, True)):
        status = main(args + ["--set", f"cluster.memory_gbyte={(capacity + 0.5) / 2**30!r}"])
        out = capsys.readouterr()
        memory = json.loads(out.out)["memory"]
        assert memory["capacity_bytes"] == capacity and memory["fits"] is fits
        assert status == (0 if fits else 3)
        assert ("out of memory" in out.err) is not fits


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_is_one_kernel_of_the_attention_flops(causal):
    """FlashAttention: QK^T and PV forward (2 x 2 b s^2 h FLOPs), five products backward (QK^T again);
    when causal, the 128 x 128 blocks up to the diagonal, n(n + 1)/2 of n^2 (n = 16 at 2,048 tokens:
    17/32); compute-bound at this size, so its time is FLOPs over the achievable rate. The unfused core
    issues its steps instead, and no fused kernel."""
    from simcluster.engine import simulate
    from simcluster.parallel.composed import composed
    from simcluster.parallel.data_parallel import TrainingConfig
    from simcluster.parallel.parallelism import Parallelism
    from simcluster.program.mesh import DeviceMesh
    from simcluster.topology.presets import preset

    b, s, h = 2, 2048, 256
    spec = preset("dgx-a100", gpus_per_node=1)
    rate = spec.peak_tflops * 1e3 * spec.attention_efficiency  # FLOPs per ns
    names = {}
    for kernel in ("flash", "unfused"):
        model = ModelConfig(layers=1, hidden=h, heads=4, ffn_hidden=4 * h, seq=s, vocab=64, tied_head=False,
                          dtype="bf16", causal=causal, attention_kernel=kernel)
        run = simulate(composed, Parallelism(data=TrainingConfig(model=model, global_batch=b, steps=1, precision="bf16")),
                       mesh=DeviceMesh(), cluster=spec, mode="meta")
        names[kernel] = {e.name.split("/")[-1]: e.duration for e in run.trace if e.name.startswith(("F0:block0",
                                                                                                     "B0:block0"))}
    part = 17 / 32 if causal else 1.0
    fwd, bwd = names["flash"]["flash_attention"], names["flash"]["flash_attention_backward"]
    assert fwd == math.ceil(4 * b * s * s * h * part / rate) + spec.kernel_overhead_ns
    # (the backward at 499/609 of the forward's rate: cuDNN's on an H100, FlashAttention-3's figures)
    assert bwd == math.ceil(10 * b * s * s * h * part / (rate * 499 / 609)) + spec.kernel_overhead_ns
    assert "attention_scores" not in names["flash"]
    assert "attention_scores" in names["unfused"] and "flash_attention" not in names["unfused"]


def test_at_a_long_sequence_causal_attention_costs_half_and_no_rate_exceeds_the_hardware():
    """One Llama-2-7B-sized layer at 128K tokens on one H100 (meta mode): the causal flash kernels take
    (n + 1)/2n of the bidirectional ones' time (n = 1,024 tiles of 128 a side, compute-bound), and the
    TFLOP/s reported (the FLOPs the kernels ran) never exceed the GPU's achievable matmul rate, while
    the full-square convention's MFU, which counts twice the attention products the model needs, would."""
    from simcluster.config.scenario import load
    from simcluster.run.runner import run_scenario

    sets = ["model.arch=llama", "model.layers=1", "model.hidden=4096", "model.heads=32", "model.ffn_hidden=11008",
            "model.seq=131072", "model.vocab=32000", "model.global_batch=1", "model.dtype=bf16",
            "run.numerics=meta", "run.steps=1", "cluster.preset=dgx-h100", "cluster.gpus_per_node=1",
            "cluster.nodes=1", "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1"]
    reports = {c: run_scenario(load(None, sets + [f"model.causal={c}"]), trace=True) for c in ("true", "false")}

    def kernel(c, name):
        return sum(e.duration for e in reports[c].result.trace if e.name.endswith("/" + name))

    n = 131072 // 128
    for name in ("flash_attention", "flash_attention_backward"):
        assert kernel("true", name) / kernel("false", name) == pytest.approx((n + 1) / (2 * n), rel=1e-3)
    r = reports["true"].report
    spec = r["cluster"]
    achievable = spec["peak_tflops"] * spec["matmul_efficiency"]
    assert r["tflops_per_gpu"] <= achievable and r["hfu"] < r["mfu"]
    assert r["model_flops_causal_per_step"] < r["hardware_flops_per_step"] < r["model_flops_per_step"]


@pytest.mark.parametrize("sets", [["parallel.recompute=full"], ["parallel.schedule=zb-v"],
                                  ["parallel.schedule=dualpipe", "parallel.recompute=full", "model.global_batch=8"]],
                         ids=["full", "zb-v", "dualpipe-full"])
def test_one_layers_passes_are_its_kernels_in_the_trace(sets):
    """The report's `layer`: rank 0's first layer (block0), its first micro-batch's forward, backward and
    recomputation, from the recorded streams before the replay. Each equals the time of the trace's kernel
    events of that pass in the first step (a sum over every step, or every micro-batch, would not); a full
    recomputation is the forward's kernels again; under ZB-V the weight gradients are a pass of their own;
    under DualPipe a backward's kernels come between another pass's (pipeline.together)."""
    from simcluster.config.scenario import load
    from simcluster.run.runner import run_scenario

    out = run_scenario(load("llama3_4d", ["run.numerics=meta"] + sets))
    layer, events = out.report["layer"], [e for e in out.result.trace.events if e.rank == 0 and not e.group]
    forward = next(e.name.split("/")[0] for e in events if e.kind == "forward" and ":block0/" in e.name)  # F0[.0]:block0
    first = [e for e in events if e.name.startswith(forward + "/")]
    step_end = min(e.start for e in events if e.kind == "optimizer")  # (the first step's passes end before it)
    for what, label in (("forward", forward + "/"), ("backward", "B" + forward[1:] + "/")):
        mine = [e for e in events if e.name.startswith(label) and e.end <= step_end]
        assert layer[f"{what}_ns"] == sum(e.end - e.start for e in mine) > 0
        assert layer["kernels"][what] == len(mine)
    assert layer["layer"] == "block0" and len(first) == 2 * layer["kernels"]["forward"]  # (two steps)
    if "parallel.recompute=full" in sets:
        assert layer["recompute_ns"] == layer["forward_ns"] and layer["kernels"]["recompute"] == layer["kernels"]["forward"]
    else:
        assert layer["recompute_ns"] == 0 and any(e.kind == "weight_grad" for e in events)
