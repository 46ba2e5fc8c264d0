"""Expert parallelism (parallel.ep): experts shared out over runs of ep data-parallel ranks, tokens sent to
them and back (parallel/expert_parallel.py). Byte-identical to one device in exact mode; gradients reduced
over the wrong ranks caught; the all-to-all's bytes, the experts' memory and a skew's straggler in closed
form; folded as unfolded; what it does not run refused in one line."""

import json

import numpy as np
import pytest

from simcluster.config.scenario import load
from simcluster.config.schema import ScenarioError
from simcluster.parallel.reference import reference
from simcluster.run.runner import run_scenario

SMALL = ["model.arch=llama", "model.moe_experts=4", "model.moe_aux_coeff=0.01", "run.numerics=exact", "run.steps=2",
         "model.hidden=16", "model.heads=2", "model.ffn_hidden=24", "model.seq=8", "model.vocab=32",
         "model.global_batch=4"]


def _report(*sets: str, fold: bool = True) -> dict:
    return run_scenario(load(None, SMALL + list(sets)), fold=fold).report


@pytest.mark.parametrize("sets", [
    ("parallel.dp=4", "parallel.ep=2", "cluster.gpus_per_node=4", "parallel.zero=1", "model.moe_capacity_factor=1.0"),
    ("parallel.dp=4", "parallel.ep=4", "cluster.gpus_per_node=4", "parallel.zero=3", "model.micro_batch=1"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.gpus_per_node=4", "parallel.schedule=dualpipe",
     "model.micro_batch=1", "model.global_batch=8", "model.moe_scores=sigmoid", "model.moe_bias_rate=0.01",
     "run.steps=3"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.gpus_per_node=4", "parallel.zero=2",
     "model.moe_capacity_factor=0.5", "model.dtype=bf16"),
    ("parallel.dp=4", "parallel.ep=2", "parallel.pp=2", "cluster.gpus_per_node=8", "parallel.schedule=zb-v",
     "model.micro_batch=1", "model.global_batch=8", "model.layers=4", "parallel.recompute=full",
     "model.moe_scores=sigmoid", "model.moe_normalize=true", "model.moe_route_scale=2.5",
     "model.moe_shared_experts=1", "model.moe_first_dense=1"),
    ("parallel.dp=4", "parallel.ep=4", "cluster.gpus_per_node=4", "model.moe_scores=sigmoid", "model.moe_groups=2",
     "model.moe_group_limit=1", "model.moe_bias_rate=0.01", "run.steps=3"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.cp=2", "parallel.sp=true", "model.heads=4",
     "cluster.gpus_per_node=8", "parallel.zero=3", "model.moe_scores=sigmoid", "model.moe_bias_rate=0.01",
     "model.moe_shared_experts=1", "run.steps=3"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "cluster.gpus_per_node=8",
     "model.micro_batch=1", "parallel.schedule=zb-v", "model.layers=4", "model.moe_first_dense=1",
     "parallel.recompute=full", "model.dtype=bf16"),
    ("parallel.dp=4", "parallel.ep=2", "parallel.cp=2", "cluster.gpus_per_node=8", "parallel.zero=1",
     "parallel.zero_over=dp", "parallel.attention=ring"),
], ids=["dp4-ep2-zero1", "dp4-ep4-zero3", "dp2-ep2-pp2-dualpipe-bias", "dp2-ep2-pp2-zero2-dropping",
        "dp4-ep2-pp2-zbv-recompute-deepseek", "dp4-ep4-node-limited-bias", "dp2-ep2-tp2-cp2-zero3-bias",
        "dp2-ep2-tp2-pp2-zbv-bf16", "dp4-ep2-cp2-ring-zero1-over-dp"])
def test_expert_parallel_layouts_are_byte_identical_to_one_device(sets):
    v = _report(*sets)["verification"]
    assert v["bit_exact"] and not v["mismatches"]
    assert "params.layers.1.moe.experts.w_fc" in v["outputs"] and "routing[1].layers.1.chosen" in v["outputs"]


def test_expert_gradients_reduced_over_every_data_parallel_rank_are_caught(monkeypatch):
    """The broken variant: an experts unit reduced over the whole dp group, as the dense weights are, which
    adds the gradients of other ranks' experts into each rank's."""
    from simcluster.parallel.dp_wrap import DPWrap

    init = DPWrap.__init__

    def over_dp(self, ctx, *args, **kw):
        init(self, ctx, *args, **kw)
        self.groups = {u: ctx.mesh.dp if u.startswith("experts") else g for u, g in self.groups.items()}

    monkeypatch.setattr(DPWrap, "__init__", over_dp)
    reference.cache_clear()
    v = _report("parallel.dp=4", "parallel.ep=2", "cluster.gpus_per_node=4", "parallel.zero=0")["verification"]
    reference.cache_clear()
    assert not v["bit_exact"] and v["mismatches"]


META = ["model.arch=llama", "model.moe_experts=8", "run.numerics=meta", "model.hidden=256", "model.heads=4",
        "model.ffn_hidden=512", "model.seq=64", "model.global_batch=8", "model.layers=2", "parallel.zero=0",
        "model.dtype=fp32", "cluster.gpus_per_node=4", "parallel.dp=4"]


def test_the_all_to_all_moves_each_ranks_rows_for_other_ranks_experts():
    """Evenly routed (meta: stated), a rank's 2 sequences x 64 tokens x top-2 = 256 rows go 32 to each
    of 8 experts, 64 to each rank's 2 (ep 4); 3 peers x 64 rows x h 256 x 4 bytes out and back in the
    forward pass, again in the backward: 786,432 bytes a layer a step; 2 layers, 3 steps. Each move is
    one uneven all_to_all on the ep group."""
    comm = {(c["group"], c["collective"]): c for c in run_scenario(
        load(None, META + ["parallel.ep=4"])).report["communication"]}
    assert comm[("ep", "all_to_all")]["bytes_per_rank"] == 3 * 2 * 4 * 3 * 64 * 256 * 4
    assert comm[("ep", "all_to_all")]["calls_per_rank"] == 2 * 2 * 2 * 3  # there and back, both passes
    assert comm[("ep", "all_gather")]["calls_per_rank"] == 2 * 3  # the plan: a layer a step (the backward reuses it)


def test_the_all_gather_dispatcher_moves_the_groups_tokens_not_their_routed_rows():
    """Megatron-Core's allgather dispatcher, the same run (ep 4, top-2, T = 128 tokens a rank, h 256, fp32):
    a layer a step all-gathers each rank's choices and gates (T x 2 x 4 bytes each), its tokens (T x h x 4)
    and in the backward its output gradients (T x h x 4), 3 peers each; it reduce-scatters the combined
    outputs and the input gradients (3 peers x T x h x 4 each) and the gates' gradients (3 x T x 2 x 4).
    With ep 4 > k 2 that is more than the all-to-all's rows; no all-to-all at all."""
    t, h, peers, times = 128, 256, 3, 2 * 3  # 2 layers, 3 steps
    comm = {(c["group"], c["collective"]): c for c in run_scenario(
        load(None, META + ["parallel.ep=4", "parallel.moe_dispatcher=allgather"])).report["communication"]}
    assert comm[("ep", "all_gather")]["bytes_per_rank"] == peers * (2 * t * 2 * 4 + 2 * t * h * 4) * times
    assert comm[("ep", "reduce_scatter")]["bytes_per_rank"] == peers * (2 * t * h * 4 + t * 2 * 4) * times
    assert comm[("ep", "all_gather")]["calls_per_rank"] == 4 * times
    assert comm[("ep", "reduce_scatter")]["calls_per_rank"] == 3 * times
    assert ("ep", "all_to_all") not in comm


@pytest.mark.parametrize("sets", [
    ("parallel.dp=4", "parallel.ep=4", "cluster.gpus_per_node=4", "parallel.zero=1", "model.moe_capacity_factor=0.5",
     "model.dtype=bf16"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.gpus_per_node=4", "parallel.schedule=dualpipe",
     "model.micro_batch=1", "model.global_batch=8", "model.moe_scores=sigmoid", "model.moe_bias_rate=0.01",
     "model.moe_shared_experts=1", "model.moe_shared_overlap=true"),
    ("parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.cp=2", "parallel.sp=true", "model.heads=4",
     "cluster.gpus_per_node=8", "parallel.zero=3", "model.moe_capacity_factor=1.0", "parallel.recompute=full"),
], ids=["dp4-ep4-dropping-bf16", "dp2-ep2-pp2-dualpipe-shared-overlap", "dp2-ep2-tp2-cp2-zero3-recompute"])
def test_the_all_gather_dispatcher_is_byte_identical_to_one_device(sets):
    v = _report("parallel.moe_dispatcher=allgather", *sets)["verification"]
    assert v["bit_exact"] and not v["mismatches"]
    assert "grads.layers.1.moe.router" in v["outputs"] or "params.layers.1.moe.router" in v["outputs"]


def test_an_all_gather_combine_rounded_before_its_sum_is_caught(monkeypatch):
    """The broken variant: each rank rounds its experts' share of a token's output before the
    reduce-scatter adds the shares, so a token with two of its three experts on one rank and one on the
    other is rounded twice (the reduction of two floats rounds once: two ranks' single slots would not
    show it)."""
    from simcluster.parallel.expert_parallel import AllGather

    def rounded_first(self, outs, r, gates, state):
        ops = self.ctx.ops
        state["outs"] = outs
        weighted = ops.concat([ops.mul(o, g) for o, g in zip(outs, state["gates"])], 0)
        placed = ops.finalize(ops.embedding_backward(self._join(state["tokens"]), weighted, self.ep * state["t"]))
        return (yield self.ctx.comm.reduce_scatter(placed, group=self.group, dim=0))

    monkeypatch.setattr(AllGather, "combine", rounded_first)
    reference.cache_clear()
    v = _report("parallel.moe_dispatcher=allgather", "parallel.dp=2", "parallel.ep=2", "cluster.gpus_per_node=2",
                "parallel.zero=0", "model.moe_top_k=3")["verification"]
    reference.cache_clear()
    assert not v["bit_exact"] and v["mismatches"]


def test_each_rank_holds_its_share_of_the_experts():
    """fp32 DDP: 4 bytes a parameter held; the experts' 2 layers x 3 x 8 x 256 x 512 parameters held a
    quarter each with ep 4, the rest whole."""
    def held(ep):
        return run_scenario(load(None, META + [f"parallel.ep={ep}"])).report["memory_peak_bytes"]["0"]["parameters"]
    experts = 2 * 3 * 8 * 256 * 512
    assert held(1) - held(4) == 4 * experts * 3 // 4


def test_a_skewed_routing_makes_the_busiest_experts_rank_the_straggler():
    """Zipf-skewed (stated) routing: expert 0, on the first rank of each ep group, takes the most rows, so
    that rank computes longest, and the report's imbalance is the stated one; folded as unfolded."""
    sets = META + ["parallel.ep=4", "model.moe_skew=1"]
    folded = run_scenario(load(None, sets)).report
    unfolded = run_scenario(load(None, sets), fold=False).report
    assert folded["busy_ns"] == unfolded["busy_ns"] and folded["step_time_ns"] == unfolded["step_time_ns"]
    compute = {r: streams["compute"] for r, streams in folded["busy_ns"].items()}
    assert compute["0"] == max(compute.values()) and compute["0"] > compute["3"]
    assert folded["experts"]["layers"][0]["imbalance"] > 2


EP_FOLDS = [  # (overrides, ranks simulated of the world): each dp replica whole nodes, so rotating ep moves nodes
    (("parallel.pp=2", "cluster.gpus_per_node=2", "cluster.nodes=4", "parallel.ep=2", "parallel.zero=1",
      "model.micro_batch=1"), 2),  # the dp ring steps from one ep group into the next
    (("cluster.gpus_per_node=1", "cluster.nodes=8", "parallel.dp=8", "parallel.ep=4", "parallel.zero=3",
      "model.moe_shared_experts=1"), 1),  # ZeRO-3 over dp for the dense, over edp for the experts
    (("parallel.pp=2", "cluster.gpus_per_node=2", "cluster.nodes=8", "parallel.dp=8", "parallel.ep=8",
      "model.micro_batch=1", "parallel.schedule=zb-h1", "model.moe_top_k=1"), 2),  # ep = dp: edp groups of one
]


@pytest.mark.parametrize("sets,simulated", EP_FOLDS)
def test_evenly_routed_ep_peers_fold_and_give_the_unfolded_report_and_trace(sets, simulated):
    """Evenly routed (stated, no skew), the ep peers run the same shapes: one stands for its group
    (engine/fold.py), byte for byte the unfolded run."""
    sc = load(None, META + ["parallel.dp=4"] + list(sets))
    folded, unfolded = run_scenario(sc, fold=True), run_scenario(sc, fold=False)
    fold = folded.result.fold
    assert fold is not None and fold.ep and len(fold.ranks) == simulated, folded.result.unfolded_because
    assert json.dumps(folded.report, sort_keys=True) == json.dumps(unfolded.report, sort_keys=True)
    full = folded.result.full_trace()
    assert full.to_jsonl() == unfolded.result.trace.to_jsonl() and full.memory == unfolded.result.trace.memory


@pytest.mark.parametrize("sets,simulated", [((), 1), (("model.moe_skew=0.5",), 4),
                                             (("model.seq=63", "model.moe_top_k=1"), 4)])
def test_only_an_even_routing_folds_its_ep_peers(sets, simulated):
    """dp 8 on 8 nodes, ep 4: the dp fold keeps a block of 4 replicas (a whole ep group); evenly routed,
    the ep fold keeps one. Skewed, or even but in whole rows that do not share out evenly (2 x 63 rows
    over 8 experts: 16 or 15 each), the ep peers are not alike, and the run says so and folds less:
    byte for byte the unfolded run still."""
    sc = load(None, META + ["parallel.dp=8", "parallel.ep=4", "cluster.gpus_per_node=1", "cluster.nodes=8"]
              + list(sets))
    folded = run_scenario(sc)
    fold = folded.result.fold
    assert fold is not None and fold.ep == (simulated == 1) and len(fold.ranks) == simulated
    if sets:
        unfolded = run_scenario(sc, fold=False)
        assert json.dumps(folded.report, sort_keys=True) == json.dumps(unfolded.report, sort_keys=True)


@pytest.mark.parametrize("sets,words", [
    (("parallel.dp=4", "parallel.ep=3", "cluster.gpus_per_node=4"), "ep=3 must divide dp=4"),
    (("parallel.dp=2", "parallel.tp=2", "parallel.sp=false", "cluster.gpus_per_node=4"), "sequence parallelism"),
    (("parallel.dp=4", "parallel.ep=4", "cluster.gpus_per_node=4", "model.moe_experts=6"), "moe_experts=6"),
    (("parallel.dp=2", "parallel.ep=2", "cluster.gpus_per_node=2", "model.moe_experts=0"), "mixture of experts"),
])
def test_what_expert_parallelism_does_not_run_is_refused_in_one_line(sets, words):
    with pytest.raises(ScenarioError) as err:
        _report(*sets)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_plan_searches_expert_parallelism():
    """Every ep dividing dp and the experts is searched (and --fix narrows it); a layout's estimated memory
    drops by what its experts cost held an ep-th each: 16 bytes a parameter of model states in bf16 with DDP,
    and 4 of the optimizer step's fp32 gradients, which here outweigh the recomputed activations."""
    from simcluster.analysis.estimate import estimate
    from simcluster.analysis.planner import layouts, parse_fixed

    sc = load("moe", at_scale=True)
    eps = {lay.ep for lay in layouts(sc) if lay.dp == 64}
    assert eps == {1, 2, 4, 8}
    assert {lay.ep for lay in layouts(sc, parse_fixed(["ep=2"]))} == {2}
    base = dict(tp=1, pp=1, cp=1, dp=64, zero=0, micro_batch=1, recompute="full", schedule="1f1b", virtual=1)
    from simcluster.analysis.estimate import Layout

    one, eight = (estimate(sc, Layout(**base, ep=ep)) for ep in (1, 8))
    m = sc.model
    experts = m.layers * 3 * m.moe_experts * m.hidden * m.ffn_hidden
    assert one.memory_bytes - eight.memory_bytes == pytest.approx((16 + 4) * experts * 7 / 8, rel=1e-9)
    assert "EP8" in eight.layout.label() and "CP" not in eight.layout.label()


def test_plan_searches_the_dispatcher_where_there_is_expert_parallelism():
    """Both token dispatchers for every ep > 1, one (the default) for ep 1; --fix narrows them. The estimate
    charges the all-gather dispatcher ep - 1 peers' tokens each way where the all-to-all charges
    k (ep - 1) / ep of them: with top-2 and ep 8, 7 / (2 x 7/8) = 4 times the exchange."""
    from simcluster.analysis.estimate import Layout, estimate
    from simcluster.analysis.planner import layouts, parse_fixed

    sc = load("moe", at_scale=True)
    searched = {(lay.ep, lay.dispatcher) for lay in layouts(sc) if lay.dp == 64}
    assert searched == {(1, "alltoall")} | {(ep, d) for ep in (2, 4, 8) for d in ("alltoall", "allgather")}
    assert {lay.dispatcher for lay in layouts(sc, parse_fixed(["dispatcher=allgather"]))} == {"allgather"}
    base = dict(tp=1, pp=1, cp=1, dp=64, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    a2a, ag = (estimate(sc, Layout(**base, ep=8, dispatcher=d)) for d in ("alltoall", "allgather"))
    assert ag.memory_bytes == a2a.memory_bytes and "EP8 allgather" in ag.layout.label()
    m, spec = sc.model, sc.cluster_spec()
    micro_batches = m.global_batch // 64 // 1
    # the all-to-all's: forward and backward, out and back, k (ep - 1) / ep of a rank's tokens, 16-bit, over
    # NVLink (the 8 ranks of an ep group are a node's), each layer and micro-batch
    a2a_exchange = 2 * 2 * m.seq * 2 * 7 / 8 * m.hidden * 2 / (spec.nvlink_bytes_per_ns * 1e9) * m.layers * micro_batches
    assert ag.seconds - a2a.seconds == pytest.approx(3 * a2a_exchange, rel=1e-9)


def test_an_expert_parallel_checkpoint_resumes_on_other_layouts(tmp_path):
    """Saved after step 1 with each rank holding its ep-th of the experts, resumed with ep 4, with ep 1 and
    on one device: the resumed runs are the uninterrupted single-device run, byte for byte."""
    folder = str(tmp_path / "ck")
    run_scenario(load(None, SMALL + ["parallel.dp=4", "parallel.ep=2", "cluster.gpus_per_node=4", "parallel.zero=1",
                                     f"run.save_checkpoint={folder!r}", "run.steps=1"]))
    for sets in (("parallel.dp=4", "parallel.ep=4", "cluster.gpus_per_node=4", "parallel.zero=3"),
                 ("parallel.dp=2", "cluster.gpus_per_node=2"), ("parallel.dp=1", "cluster.gpus_per_node=1")):
        v = _report(*sets, f"run.resume={folder!r}")["verification"]
        assert v["bit_exact"] and not v["mismatches"], sets


BIASED = ["model.moe_scores=sigmoid", "model.moe_normalize=true", "model.moe_bias_rate=0.01"]


def test_a_checkpoint_keeps_the_selection_biases_and_resumes_them_on_another_layout(tmp_path):
    """Saved after 2 of 3 steps with the biases moved twice, resumed on one device, with ep 4 and under
    DualPipe: each resumed run is the uninterrupted single-device run, biases and all; the manifest
    carries them under its checksum, and one not a list of numbers is refused naming the field."""
    from simcluster.checkpoint import CheckpointError, read_manifest, resolve

    folder = str(tmp_path / "ck")
    _report(*BIASED, "parallel.dp=4", "parallel.ep=2", "cluster.gpus_per_node=4", "run.steps=3",
            f"run.save_checkpoint={folder!r}", "run.save_at_step=2")
    saved = read_manifest(resolve(folder))["router_bias"]
    assert sorted(saved) == ["router_bias.layers.0", "router_bias.layers.1"] and all(len(v) == 4 for v in saved.values())
    for sets in (("parallel.dp=1", "cluster.gpus_per_node=1"), ("parallel.dp=4", "parallel.ep=4", "cluster.gpus_per_node=4"),
                 ("parallel.dp=1", "parallel.pp=2", "cluster.gpus_per_node=2", "model.micro_batch=1",
                  "parallel.schedule=dualpipe")):
        v = _report(*BIASED, *sets, "run.steps=3", f"run.resume={folder!r}")["verification"]
        assert v["bit_exact"] and not v["mismatches"] and "router_bias.layers.1" in v["outputs"], sets
    path = tmp_path / "ck" / resolve(folder).split("/")[-1] / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["router_bias"]["router_bias.layers.0"] = "0.5"
    from simcluster.checkpoint import checksum
    manifest["checksum"] = checksum(manifest)
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    with pytest.raises(CheckpointError, match="router_bias.router_bias.layers.0 is not a list of finite numbers"):
        read_manifest(resolve(folder))


def _outputs(*sets: str) -> tuple[dict, dict]:
    from simcluster.run.job import job_of

    sc = load(None, SMALL + BIASED + list(sets))
    run = run_scenario(sc)
    return run.report, job_of(sc).outputs(run.result.results)


def test_deepseeks_bias_moves_towards_an_even_load_byte_identical_to_one_device():
    """After step 0 each expert's bias is 0.01 x sign(mean load - its load), the loads summed over every
    data-parallel rank (fp32: exactly those numbers); later steps choose with it, under ep 2 x pp 2 as on one
    device. Step 1 (its weights are the unbiased run's: the bias has no gradient) routes more tokens to the
    experts whose bias rose and fewer to those whose bias fell than without it."""
    import numpy as np

    report, out = _outputs("parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.gpus_per_node=4",
                           "run.steps=1")
    assert report["verification"]["bit_exact"]
    for i in (0, 1):
        loads = out[f"routing[0].layers.{i}.chosen"]
        want = (0.01 * np.sign(loads.mean() - loads)).astype(np.float32)
        assert out[f"router_bias.layers.{i}"].tobytes() == want.tobytes()
    v = _outputs("parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "cluster.gpus_per_node=4")[0]["verification"]
    assert v["bit_exact"] and "router_bias.layers.1" in v["outputs"]
    steps = ("run.steps=2", "model.layers=1", "parallel.dp=1", "cluster.gpus_per_node=1")
    _, biased = _outputs(*steps, "model.moe_bias_rate=0.1")
    plain = _outputs(*steps, "model.moe_bias_rate=0")[1]["routing[1].layers.0.chosen"]
    moved = np.sign(biased["routing[0].layers.0.chosen"].mean() - biased["routing[0].layers.0.chosen"])
    change = biased["routing[1].layers.0.chosen"] - plain
    assert (change[moved > 0] >= 0).all() and (change[moved < 0] <= 0).all() and change.any()


def test_a_bias_moved_by_a_ranks_own_loads_is_caught(monkeypatch):
    """The broken variant: each rank moves the bias by the loads of its own tokens (no sum over dp)."""
    from simcluster.parallel.llama_shard import LlamaShard

    balance = LlamaShard.balance

    def alone(self, step, group, twin=None):
        return (yield from balance(self, step, self.ctx.mesh.tp, twin))  # (a group of one: its own loads)

    monkeypatch.setattr(LlamaShard, "balance", alone)
    reference.cache_clear()
    v = _outputs("parallel.dp=2", "cluster.gpus_per_node=2")[0]["verification"]
    reference.cache_clear()
    assert not v["bit_exact"]


def test_the_shared_experts_overlap_the_all_to_all_with_the_same_numbers():
    """model.moe_shared_overlap (Megatron-Core's moe_shared_expert_overlap): the shared experts computed while
    the rows travel to their experts, and their backward while the output gradients do. Over nodes the
    all-to-all is long enough to hide under them: a shorter step; and the run stays byte-identical to one
    device (the same kernels in another order)."""
    base = META + ["parallel.ep=4", "model.moe_shared_experts=1", "cluster.gpus_per_node=2", "cluster.nodes=2"]
    plain = run_scenario(load(None, base)).report
    overlapped = run_scenario(load(None, base + ["model.moe_shared_overlap=true"])).report
    saved = plain["steady_step_ns"] - overlapped["steady_step_ns"]
    hidden = [r["communication_overlap"]["per_rank"]["0"]["hidden_ns"] for r in (plain, overlapped)]
    assert 0 < saved <= hidden[1] - hidden[0]  # (no more saved than the communication newly hidden)
    v = _report("parallel.dp=4", "parallel.ep=2", "cluster.gpus_per_node=4", "model.moe_shared_experts=1",
                "model.moe_shared_overlap=true", "parallel.zero=1")["verification"]
    assert v["bit_exact"] and any("shared.w1" in name for name in v["outputs"])


FLAT = """device = "every GEMM at 1 TFLOP/s (1,000 FLOPs a ns), nothing else taking time"
peak_tflops = 1e6
peak_tflops_fp32 = 1e6
memory_gbyte_per_s = 1e9
kernel_overhead_ns = 0
gemm = [{dtype = "fp32", batch = 1, m = 64, n = 64, k = 64, tflops = 1.0},
        {dtype = "fp32", batch = 1, m = 64, n = 64, k = 64, tflops = 1.0, partial = true}]
"""


def test_a_skewed_routings_straggler_is_slower_by_its_extra_rows_gemm_time(tmp_path):
    """Zipf routing over 8 experts, ep 4 (rank q holds experts 2q and 2q+1), on a machine where only GEMMs take
    time: each sequence's 64 x 2 choices share out as 128 (e+1)^-1 / sum, in whole tokens by largest
    remainders, [47, 23, 16, 12, 9, 8, 7, 6]; every rank of the ep group sends its sequence's rows, so rank 0
    computes 4 x 70 rows a micro-batch and layer, rank 3 4 x 13. A SwiGLU expert's row costs 18 h F FLOPs
    (three products forward, each twice backward): rank 0's compute exceeds rank 3's by exactly that, over
    2 layers x 2 micro-batches x 3 steps, to a ns a kernel."""
    profile = tmp_path / "flat.toml"
    profile.write_text(FLAT)
    report = run_scenario(load(None, META + ["parallel.ep=4", "model.moe_skew=1", "run.steps=3",
                                             f"cluster.profile={profile}"]), fold=False).report
    w = 1.0 / np.arange(1, 9)
    exact = 64 * 2 * w / w.sum()
    counts = np.floor(exact).astype(int)
    counts[np.argsort(-(exact - counts), kind="stable")[:128 - counts.sum()]] += 1
    assert counts.tolist() == [47, 23, 16, 12, 9, 8, 7, 6]
    rows = [4 * (counts[2 * q] + counts[2 * q + 1]) for q in range(4)]
    expected_ns = (rows[0] - rows[3]) * 18 * 256 * 512 / 1000 * 2 * 2 * 3
    compute = {int(r): v["compute"] for r, v in report["busy_ns"].items()}
    assert max(compute, key=compute.get) == 0
    assert abs((compute[0] - compute[3]) - expected_ns) <= 100  # (each kernel's time rounded up to a ns)
