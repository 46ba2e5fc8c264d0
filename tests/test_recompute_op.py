"""torchtitan's per-op selective checkpointing (`parallel.recompute = "op"`; parallelize_llama.py's
_save_list at commit 6b03ffa, 2024-12-26): a Llama block keeps its input, the outputs of its 1st, 3rd,
5th and 7th matmuls (wq, wv, w1, w2), the attention kernel's, and with sequence parallelism its
reduce-scatters'; the backward makes the rest again, up to the last tensor it needs."""

from __future__ import annotations

import pytest

from simcluster.config.scenario import ScenarioError, load
from simcluster.model.activations import layer_activations
from simcluster.model.gpt import ModelConfig
from simcluster.parallel import llama_shard
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.reference import reference
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_scenario
from simcluster.testing import Layout, assert_bit_exact

LAYOUTS = [  # (dp, pp, cp, tp, options): sp's saved reduce-scatters, tp without sp (its all-reduce made
    # again), a pipeline whose weight gradients run apart (ZB-V), ZeRO-3 over dp
    (1, 1, 2, 2, {"sp": True}), (2, 1, 1, 2, {}), (1, 2, 1, 1, {"schedule": "zb-v"}), (2, 1, 1, 1, {})]


def data(recompute: str, layers: int = 2) -> TrainingConfig:
    model = ModelConfig(layers=layers, hidden=16, heads=4, kv_heads=2, ffn_hidden=8, seq=8, vocab=8, tied_head=False,
                        arch="llama", recompute=recompute, seed=3)
    return TrainingConfig(model=model, global_batch=4, micro_batches=2, steps=2, precision="bf16", zero=3)


@pytest.mark.parametrize("dp, pp, cp, tp, options", LAYOUTS, ids=lambda v: str(v))
def test_per_op_checkpointing_changes_no_bit(dp, pp, cp, tp, options):
    """Each layout with the per-op policy against one device without any recomputation, byte for byte:
    the policy moves work and memory, never a number."""
    layers = 4 if options.get("schedule") == "zb-v" else 2
    layout = Layout(DeviceMesh(dp=dp, pp=pp, cp=cp, tp=tp), Parallelism(data=data("op", layers), **options))
    assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                     reference=reference(data("none", layers)))


def test_a_wrong_saved_tensor_is_caught(monkeypatch):
    """The check can fail: a recomputation given w1's saved output with its columns reversed (the shape
    right, the numbers not) gives other gradients."""
    real = llama_shard.LlamaShard.block

    def swapped(self, p, x, i, step, where, saved=None):
        if saved is not None:
            saved = saved | {"f1": saved["f1"][..., ::-1]}
        return (yield from real(self, p, x, i, step, where, saved))

    monkeypatch.setattr(llama_shard.LlamaShard, "block", swapped)
    wrong = TrainingConfig(model=ModelConfig(layers=2, hidden=16, heads=4, ffn_hidden=8, seq=8, vocab=8, tied_head=False,
                                           arch="llama", recompute="op", seed=3), global_batch=2, micro_batches=1,
                         steps=1, precision="bf16", zero=0)
    none = TrainingConfig(**{**wrong.__dict__, "model": ModelConfig(**{**wrong.model.__dict__, "recompute": "none"})})
    layout = Layout(DeviceMesh(dp=1, pp=1, cp=1, tp=1), Parallelism(data=wrong))
    with pytest.raises(AssertionError):
        assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                         reference=reference(none))


SETS = ["model.arch=llama", "model.layers=1", "model.hidden=256", "model.heads=4", "model.kv_heads=2",
        "model.ffn_hidden=512", "model.seq=128", "model.vocab=512", "model.global_batch=1", "model.dtype=bf16",
        "run.numerics=meta", "run.steps=1", "cluster.preset=dgx-h100", "cluster.gpus_per_node=1", "parallel.dp=1"]


def test_the_recomputation_runs_what_was_not_kept():
    """The backward's recomputation of the block, kernel by kernel: the attention norm, wk and the two
    rotations (wq's output is kept), wo (the attention kernel's output is kept) and its residual add,
    the MLP's norm, w3 (w1's output is kept), and SiLU with its product (one fused kernel); not w2, nor what
    follows it."""
    out = run_scenario(load(None, SETS + ["parallel.recompute=op"]), trace=True)
    again = [e.name.split("/", 1)[1] for e in out.result.trace.events if e.rank == 0 and e.name.startswith("R0/")]
    rope = ["mul", "scale", "concat", "mul", "add"]  # q cos + rot(q) sin, as this model rotates
    assert again == ["rms_norm"] + rope + ["matmul"] + rope + ["matmul_partial", "add", "rms_norm", "matmul", "swiglu"]
    assert out.report["layer"]["kernels"]["recompute"] == len(again)


def test_the_hardware_flops_add_wk_wo_and_w3_forward():
    """HFU's FLOPs: the model's plus, per token and layer, 2 (h kv d + h h + h F) again."""
    r = {rc: run_scenario(load(None, SETS + [f"parallel.recompute={rc}"]), trace=False).report for rc in ("none", "op")}
    h, kv_d, f, tokens = 256, 2 * 64, 512, 128
    assert r["op"]["hardware_flops_per_step"] - r["none"]["hardware_flops_per_step"] == \
        2 * (h * kv_d + h * h + h * f) * tokens
    assert r["op"]["model_flops_per_step"] == r["none"]["model_flops_per_step"]


def test_what_a_layer_keeps():
    """Llama 3 8B's block (h 4096, 32 heads, 8 kv heads, F 14336) at 8,192 tokens, bf16: input, wq, wv,
    attention output, w1 and w2 outputs, and 4 bytes a row and head of log-sum-exp; tp 8 with sp splits
    all but w2's output (every token's partial sum before its reduce-scatter) and adds the two
    reduce-scatters' outputs."""
    s, h, a, kv, f = 8192, 4096, 32, 8, 14336
    kept = layer_activations(s=s, b=1, h=h, a=a, kv=kv, f=f, recompute="op", dtype="bf16", attention_kernel="flash")
    assert sum(kept.values()) == 2 * s * (h + h + 1024 + h + f + h) + 4 * a * s
    split = layer_activations(s=s, b=1, h=h, a=a, kv=kv, f=f, t=8, sp=True, recompute="op", dtype="bf16",
                              attention_kernel="flash")
    assert sum(split.values()) == 2 * s * (h + h + 1024 + h + f) // 8 + 4 * a * s // 8 + 2 * s * h + 2 * 2 * s * h // 8


@pytest.mark.parametrize("sets", [["model.arch=gpt"], ["model.attention_kernel=unfused"],
                                  ["model.moe_experts=4", "model.moe_top_k=2"]], ids=["gpt", "unfused", "moe"])
def test_the_policy_is_refused_where_it_is_not_torchtitans(sets):
    with pytest.raises(ScenarioError, match="torchtitan's per-op checkpointing"):
        run_scenario(load(None, [s for s in SETS if not s.startswith("model.kv_heads")] + sets
                          + ["parallel.recompute=op"]), trace=False)


def test_the_plan_weighs_the_per_op_policy_for_a_llama():
    """`simcluster plan` searches the policy where the model can take it, and estimates it between none
    and full: less memory than none, more than full; more time than none, less than full (at TP 4). At TP
    8 with sequence parallelism it keeps more than none does: w2's output before its reduce-scatter is
    every token's partial sum (s h a rank), where none keeps shards of s h / 8 (Megatron's layout of a
    dropout-free block)."""
    from dataclasses import replace

    from simcluster.analysis.estimate import estimate
    from simcluster.analysis.planner import layouts

    llama = load("llama3_4d", at_scale=True)  # (Llama 3 405B: activations that matter)
    assert "op" in {lay.recompute for lay in layouts(llama)}
    assert "op" not in {lay.recompute for lay in layouts(load(None))}  # (the default scenario's GPT)
    for tp in (4, 8):
        base = next(lay for lay in layouts(llama) if lay.recompute == "none" and lay.tp == tp and lay.zero == 3
                    and estimate(llama, lay))
        est = {rc: estimate(llama, replace(base, recompute=rc)) for rc in ("none", "op", "full")}
        assert (est["none"].memory_bytes > est["op"].memory_bytes) is (tp == 4)
        assert est["op"].memory_bytes > est["full"].memory_bytes
        assert est["none"].seconds < est["op"].seconds < est["full"].seconds


@pytest.mark.parametrize("fix, message", [("recompute=op", "this model takes none, selective, full"),
                                          ("recompute=bogus", "recompute is one of none, selective, full, op")])
def test_the_plan_says_which_policies_a_model_takes(fix, message):
    from simcluster.analysis.planner import layouts, parse_fixed

    with pytest.raises(ScenarioError, match=message):
        next(layouts(load(None), parse_fixed([fix])))


def test_rsa_keeps_its_score_rows_under_the_per_op_policy():
    """The policy keeps the attention kernel's outputs: ColossalAI's RSA's are its rows of the scores, which
    Megatron's selective policy recomputes; ring attention's are an output and its log-sum-exp."""
    sets = ["model.arch=llama", "model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
            "model.ffn_hidden=96", "model.seq=64", "model.vocab=64", "model.global_batch=4", "run.steps=1",
            "cluster.gpus_per_node=4", "run.numerics=meta", "parallel.dp=1", "parallel.tp=2", "parallel.sp=true",
            "parallel.cp=2", "model.dtype=bf16"]

    def peak(attention, recompute):
        return run_scenario(load(None, sets + [f"parallel.attention={attention}", f"parallel.recompute={recompute}"]),
                            trace=False).report["memory"]["peak_bytes"]

    assert peak("rsa", "selective") < peak("rsa", "op") < peak("rsa", "none")
    assert peak("ring", "op") < peak("ring", "selective")
