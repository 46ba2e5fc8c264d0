"""A mixture-of-experts Llama (model.moe_experts) under data and pipeline parallelism and ZeRO: byte-identical
to one device in exact mode; a routing rule that depends on the split is caught; what it refuses; its FLOPs
and activation memory in closed form."""

from dataclasses import replace

import pytest

import simcluster.model.moe as moe_module
from simcluster.config.scenario import load
from simcluster.config.schema import ScenarioError
from simcluster.model.activations import layer_activations, moe_activations
from simcluster.model.config import ModelConfig
from simcluster.model.flops import forward_per_token
from simcluster.parallel.reference import reference
from simcluster.run.runner import run_scenario

MOE = ["model.arch=llama", "model.moe_experts=4", "model.moe_aux_coeff=0.01", "run.numerics=exact", "run.steps=2",
       "model.hidden=16", "model.heads=2", "model.ffn_hidden=24", "model.seq=8", "model.vocab=32",
       "model.global_batch=4"]


def _verified(*sets: str) -> dict:
    report = run_scenario(load(None, MOE + list(sets))).report
    return report["verification"]


@pytest.mark.parametrize("sets", [
    ("parallel.dp=2", "cluster.gpus_per_node=2", "model.moe_capacity_factor=1.0"),
    ("parallel.dp=2", "parallel.zero=3", "cluster.gpus_per_node=2", "model.micro_batch=2", "model.dtype=fp16",
     "model.moe_top_k=1"),
    ("parallel.dp=2", "parallel.pp=2", "cluster.gpus_per_node=4", "parallel.schedule=zb-h1", "model.micro_batch=1",
     "model.moe_scores=sigmoid", "model.moe_normalize=true", "model.moe_route_scale=2.5", "model.moe_first_dense=1"),
    ("parallel.dp=2", "parallel.pp=2", "cluster.gpus_per_node=4", "parallel.recompute=full", "parallel.zero=1",
     "model.moe_capacity_factor=0.5"),
], ids=["dp2-capacity", "zero3-fp16-top1", "pp2-zbh1-deepseek", "pp2-dp2-recompute-dropping"])
def test_layouts_are_byte_identical_to_one_device(sets):
    v = _verified(*sets)
    assert v["bit_exact"] and not v["mismatches"]
    assert any(".moe.experts.w_up" in name for name in v["outputs"])  # (the experts' weights are compared)


GPT = ("model.arch=gpt", "model.tied_head=false")


@pytest.mark.parametrize("sets", [
    ("parallel.dp=2", "parallel.ep=2", "cluster.gpus_per_node=2", "model.moe_capacity_factor=1.0", "parallel.zero=1"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "cluster.gpus_per_node=8",
     "model.micro_batch=1", "model.dropout=0.1", "model.dtype=bf16"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.cp=2", "parallel.zero=3",
     "model.moe_scores=sigmoid", "model.moe_bias_rate=0.01", "parallel.schedule=dualpipe", "parallel.pp=2",
     "cluster.gpus_per_node=8", "model.micro_batch=1", "model.global_batch=8", "model.moe_shared_experts=1",
     "model.moe_shared_overlap=true"),
], ids=["gpt-dp2-ep2-capacity", "gpt-ep2-tp2-pp2-dropout-bf16", "gpt-ep2-cp2-dualpipe-zero3-bias-shared"])
def test_the_gpt_with_gelu_experts_is_byte_identical_to_one_device(sets):
    """The GPT's MLP replaced by GELU experts without biases (Megatron-Core's), the residual's dropout on
    the experts' output: every layout byte-identical to one device."""
    v = _verified(*GPT, *sets)
    assert v["bit_exact"] and not v["mismatches"]
    assert any(".moe.experts.w_fc" in name for name in v["outputs"])
    assert not any(".moe.experts.w_up" in name or ".mlp.w_fc" in name or "shared.w3" in name
                   for name in v["outputs"] if ".layers.1." in name)
    assert any(".moe.shared.w1" in name for name in v["outputs"]) == ("model.moe_shared_experts=1" in sets)


def test_a_capacity_counted_over_a_ranks_tokens_is_caught(monkeypatch):
    """The broken variant: each expert's capacity over all the tokens a rank routes at once instead of each
    sequence's, so what is dropped depends on how the batch is split over ranks."""
    plain = moe_module.route

    def per_rank(choice, batch, seq, moe, keep=None):
        wide = plain(choice, 1, batch * seq, moe_module.MoE(moe.experts, moe.top_k, moe.ffn_hidden, moe.aux_coeff,
                                                            moe.capacity_factor / batch))
        return moe_module.Routing(wide.choice, wide.pos, wide.token_of_row, wide.slot_of_row, wide.bounds,
                                  plain(choice, batch, seq, moe).chosen)

    monkeypatch.setattr(moe_module, "route", per_rank)
    reference.cache_clear()
    try:
        v = _verified("parallel.dp=2", "cluster.gpus_per_node=2", "model.moe_capacity_factor=0.5")
    finally:
        reference.cache_clear()
    assert not v["bit_exact"] and v["mismatches"]


CAPACITY_SPREAD = [  # a sequence's tokens over tp (sequence parallel) and cp (zigzag) ranks, experts dropping some
    ("parallel.dp=1", "parallel.tp=2", "parallel.sp=true", "cluster.gpus_per_node=2", "model.moe_capacity_factor=0.5"),
    ("parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "parallel.dp=2", "parallel.ep=2", "cluster.gpus_per_node=8",
     "model.moe_capacity_factor=1.0", "model.moe_top_k=1", "model.heads=4"),
]


@pytest.mark.parametrize("sets", CAPACITY_SPREAD, ids=["tp2-sp", "cp2-tp2-ep2"])
def test_an_experts_capacity_over_tp_and_cp_ranks_is_one_devices(sets):
    """Capacity takes a sequence's tokens in position order: the ranks holding its parts gather their choices
    and drop what one device drops (some of the choices are dropped: the test would pass without capacity)."""
    report = run_scenario(load(None, MOE + list(sets))).report
    assert report["verification"]["bit_exact"] and not report["verification"]["mismatches"]
    assert any(layer["dropped"] for layer in report["experts"]["layers"])


def test_a_capacity_over_a_ranks_part_of_the_sequences_is_caught(monkeypatch):
    """The broken variant: each tp rank applies the capacity to its own tokens as if they were whole sequences."""
    from simcluster.parallel import moe_shard

    def own_part(self, choice, moe):
        yield from ()
        return None  # (route applies it to the rank's tokens as they are)

    monkeypatch.setattr(moe_shard.Experts, "capacity_kept", own_part)
    v = run_scenario(load(None, MOE + list(CAPACITY_SPREAD[0]))).report["verification"]
    assert not v["bit_exact"] and v["mismatches"]


@pytest.mark.parametrize("sets,words", [
    (("parallel.tp=2", "parallel.dp=4", "parallel.sp=false"), "tp=2 needs sequence parallelism"),
    (("model.moe_first_dense=3", "model.global_batch=8"), "moe_first_dense=3"),
])
def test_what_it_does_not_run_is_refused_in_one_line(sets, words):
    with pytest.raises(ScenarioError) as err:
        run_scenario(load(None, MOE + list(sets)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_model_flops_count_the_router_and_top_k_experts():
    m = ModelConfig(arch="llama", tied_head=False, layers=2, hidden=16, heads=2, ffn_hidden=40, seq=8, vocab=32,
                    moe_experts=6, moe_top_k=2, moe_ffn_hidden=12, moe_first_dense=1, moe_shared_experts=1)
    weights, _, _ = forward_per_token(m)
    attention = 4 * 16 * 16  # wq, wk, wv, wo (kv_heads = heads)
    dense_mlp = 3 * 16 * 40
    moe = 16 * 6 + 2 * 3 * 16 * 12 + 3 * 16 * 12  # the router, two experts' three products, the shared one's
    assert weights == 2.0 * (2 * attention + dense_mlp + moe)


def test_an_moe_layers_activations_replace_the_mlps():
    m = ModelConfig(arch="llama", tied_head=False, hidden=16, heads=2, seq=8, dtype="bf16", moe_experts=6,
                    moe_top_k=2, moe_ffn_hidden=12)
    dense = layer_activations(s=8, b=3, h=16, a=2, dtype="bf16", attention_kernel="flash")
    kept = moe_activations(dense, m, b=3)
    tokens = 24
    want = (sum(dense.values()) - 2 * 4 * 2 * tokens * 16  # the MLP's GELU input and output (4h each)
            + 2 * tokens * 6 + 2 * 2 * tokens * 2 * 16 + 2 * 3 * tokens * 2 * 12)
    assert sum(kept.values()) == want
    # unfused (eager PyTorch), each expert's SiLU output is kept too: a fourth F_e a routed token
    eager = moe_activations(dense, replace(m, fused_kernels=False), b=3)
    assert sum(eager.values()) == want + 2 * tokens * 2 * 12


def test_the_experts_swiglu_is_one_kernel_each_way_when_fused():
    """Megatron-Core's grouped experts run the same fused SwiGLU as its dense MLP (fusion.swiglu): one kernel
    forward and one backward an expert; unfused, silu and the product forward."""
    def kernels(*sets: str) -> list[str]:
        out = run_scenario(load(None, MOE + ["run.numerics=meta", "parallel.dp=1", "cluster.gpus_per_node=1",
                                             *sets]), trace=True)
        return [e.name.rsplit("/", 1)[1] for e in out.result.trace.events if e.rank == 0 and "block" in e.name]
    fused, eager = kernels(), kernels("model.fused_kernels=false")
    assert fused.count("swiglu") > 0 and fused.count("swiglu_backward") == fused.count("swiglu")
    assert "silu" not in fused and "silu" in eager and "swiglu" not in eager


def _experts(*sets: str) -> dict:
    return run_scenario(load(None, MOE + list(sets))).report["experts"]


def test_the_report_counts_every_routed_token_once():
    """4 sequences of 8 tokens, top-2: 64 choices a layer, however the layout splits them and whatever the
    recomputation runs again (a block run twice must not count twice); what capacity drops is what the
    experts did not compute."""
    for sets in (("parallel.dp=2", "cluster.gpus_per_node=2", "model.moe_capacity_factor=0.5"),
                 ("parallel.pp=2", "parallel.dp=1", "cluster.gpus_per_node=2", "parallel.recompute=full")):
        e = _experts(*sets)
        assert e["routing"] == "the run's routing" and e["step"] == 1 and len(e["layers"]) == 2
        for row in e["layers"]:
            assert sum(row["tokens_per_expert"]) == 4 * 8 * 2
            assert row["dropped"] == sum(row["tokens_per_expert"]) - sum(row["computed_per_expert"])
            assert row["imbalance"] == max(row["tokens_per_expert"]) / 16
            if "model.moe_capacity_factor=0.5" in sets:  # C = ceil(0.5 * 8 * 2 / 4) = 2 a sequence, 8 a step
                assert max(row["computed_per_expert"]) <= 8 and row["dropped"] > 0


def test_meta_mode_reports_the_stated_shares():
    """Zipf shares of 2 x 12 choices a sequence over 4 experts: 11, 6, 4, 3 (test_moe.py), 4 sequences."""
    e = _experts("run.numerics=meta", "model.seq=12", "model.moe_skew=1", "parallel.dp=4", "cluster.gpus_per_node=4")
    assert e["routing"] == "stated routing, moe_skew 1"
    assert [r["tokens_per_expert"] for r in e["layers"]] == [[44, 24, 16, 12]] * 2
    assert e["layers"][0]["imbalance"] == 44 / 24
