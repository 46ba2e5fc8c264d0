"""Every parallelism at once: the composed program against one device, byte for byte.

The options are drawn as an all-pairs covering array (tests/pairwise.py): every pair of option values
that a valid layout can hold (mesh degrees 1-3 on each axis with at most 16 ranks, schedule, sp, the
pipeline messages' scatter/gather, attention, ZeRO stage and what it shards over, micro-batches,
recomputation, dropout, precision, tied head, causal mask, weight decay, clipping, architecture and
grouped-query attention, ZeRO-Offload's tier, ZeRO-Infinity's parameter offload, the delayed
update, the tensor-parallel overlap, which pipeline ends count as layers in the split and how grouped-query
attention takes its key/value heads) is run at least once, whatever the draw; hypothesis draws the seed and the
layer count within each row.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.reference import reference
from simcluster.program.mesh import DeviceMesh
from simcluster.testing import Layout, assert_bit_exact, layouts

from pairwise import covering_rows
from composed_runs import run_composed

OPTIONS = {
    "dp": [1, 2, 3], "pp": [1, 2, 3], "cp": [1, 2, 3], "tp": [1, 2, 3],
    "schedule": ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"], "sp": [False, True],
    "scatter_gather": [False, True],
    "attention": ["ulysses", "ring", "allgather", "rsa"], "zero": [0, 1, 2, 3], "zero_over": ["dp_cp", "dp"],
    "micro_batches": [1, 2], "recompute": ["none", "selective", "full"], "dropout": [0.0, 0.1],
    "precision": ["fp32", "bf16", "fp16"], "tied_head": [False, True], "causal": [False, True],
    "weight_decay": [0.0, 0.1], "clip_grad": [None, 0.05], "arch": ["gpt", "llama"], "kv_group": [1, 2],
    "offload": ["none", "cpu", "nvme"], "offload_params": [False, True], "delayed_update": [False, True],
    "tp_comm_overlap": [False, True], "ends": ["none", "embedding", "loss", "both"], "gqa": ["repeat_kv", "native"],
    "loss_kernel": ["unfused", "fused"],
}


def valid(row):
    """At most 16 ranks; llama's head is untied and its query heads share key/value heads (kv_group of them per kv head), the gpt's do not;
    DualPipe needs an even number of stages; offloading the optimizer needs a ZeRO stage, the parameters
    ZeRO-3, and neither is modelled with DualPipe; the tensor-parallel overlap needs sequence parallelism;
    the pipeline's ends count in a split only where there is one; grouped-query attention's heads taken as
    they are only where there is grouping."""
    if row["tp_comm_overlap"] and not row["sp"]:
        return False
    if row["ends"] != "none" and row["pp"] == 1:
        return False
    if row["gqa"] == "native" and (row["arch"] != "llama" or row["kv_group"] == 1):
        return False
    if (row["offload"] != "none" and row["zero"] == 0) or (row["offload_params"] and row["zero"] != 3):
        return False
    if (row["offload"] != "none" or row["offload_params"]) and row["schedule"] == "dualpipe":
        return False
    return (row["dp"] * row["pp"] * row["cp"] * row["tp"] <= 16
            and not (row["schedule"] == "dualpipe" and row["pp"] % 2)
            and not (row["arch"] == "llama" and row["tied_head"]) and not (row["arch"] == "gpt" and row["kv_group"] > 1))


ROWS, PAIRS = covering_rows(OPTIONS, valid, seed=3)  # (seed 3: 36 rows, the fewest of seeds 0-7)
# and two 4D layouts, every axis split (Llama 3's shape: tp x cp x pp x dp with FSDP)
ROWS += [dict(dp=2, pp=2, cp=2, tp=2, schedule="interleaved", sp=True, attention="ring", zero=3, zero_over="dp_cp",
              scatter_gather=True, micro_batches=1, recompute="selective", dropout=0.1, precision="bf16",
              tied_head=False, causal=True, weight_decay=0.1, clip_grad=0.05, arch="llama", kv_group=2, offload="cpu",
              offload_params=True, delayed_update=True, tp_comm_overlap=True, ends="both", gqa="native",
              loss_kernel="fused"),
         dict(dp=2, pp=2, cp=2, tp=2, schedule="zb-h1", sp=False, scatter_gather=True, attention="ulysses", zero=1,
              zero_over="dp",
              micro_batches=2, recompute="full", dropout=0.0, precision="fp16", tied_head=False, causal=False,
              weight_decay=0.0, clip_grad=None, arch="gpt", kv_group=1, offload="nvme", offload_params=False,
              delayed_update=False, tp_comm_overlap=False, ends="none", gqa="repeat_kv", loss_kernel="unfused")]


def layout(row):
    return "-".join(f"{k}{row[k]}" for k in ("dp", "pp", "cp", "tp")) + f"-{row['schedule']}-z{row['zero']}-{row['arch']}"


def test_the_rows_cover_every_feasible_pair():
    covered = {((a, r[a]), (b, r[b])) for r in ROWS for a in r for b in r if list(OPTIONS).index(a) < list(OPTIONS).index(b)}
    assert covered >= PAIRS and all(valid(r) for r in ROWS)
    assert max(r["dp"] * r["pp"] * r["cp"] * r["tp"] for r in ROWS) >= 12
    assert any(all(r[a] > 1 for a in ("dp", "pp", "cp", "tp")) for r in ROWS)  # 4D, every axis split


@pytest.mark.parametrize("row", ROWS, ids=layout)
@settings(max_examples=1)
@given(seed=st.integers(0, 1000), extra_layers=st.integers(0, 1))
def test_bit_exact_against_one_device(row, seed, extra_layers):
    dp, pp, cp, tp = row["dp"], row["pp"], row["cp"], row["tp"]
    virtual = 2 if row["schedule"] == "interleaved" else 1
    chunks = 2 if row["schedule"] in ("interleaved", "zb-v") else 1  # chunks per stage, each needs a layer
    m = pp * row["micro_batches"] * (2 if row["schedule"] == "dualpipe" else 1)  # interleaved: k pp; dualpipe: 2k pp
    heads = tp * cp * row["kv_group"]  # ulysses splits a tp rank's heads over cp; tp splits the kv heads
    model = ModelConfig(layers=pp * chunks + extra_layers, hidden=2 * heads, heads=heads, ffn_hidden=2 * tp,
                      seq=2 * cp * tp, vocab=3 * tp, tied_head=row["tied_head"], causal=row["causal"],
                      dropout=row["dropout"], recompute=row["recompute"], seed=seed, arch=row["arch"],
                      kv_heads=heads // row["kv_group"], gqa=row["gqa"], loss_kernel=row["loss_kernel"])
    data = TrainingConfig(model=model, global_batch=dp * m, micro_batches=m, steps=2, precision=row["precision"],
                    zero=row["zero"], weight_decay=row["weight_decay"], clip_grad=row["clip_grad"],
                    offload_optimizer=row["offload"], delayed_update=row["delayed_update"],
                    offload_params=(row["offload"] if row["offload"] != "none" else "cpu") if row["offload_params"] else "none")
    layout = Layout(DeviceMesh(dp=dp, pp=pp, cp=cp, tp=tp), Parallelism(
        data=data, sp=row["sp"], attention=row["attention"], schedule=row["schedule"], virtual=virtual,
        zero_over=row["zero_over"], scatter_gather=row["scatter_gather"], tp_comm_overlap=row["tp_comm_overlap"],
        embedding_in_split=row["ends"] in ("embedding", "both"), loss_in_split=row["ends"] in ("loss", "both")))
    want = reference(data)
    assert len(want) == 2 + 5 * len(model.parameter_shapes())  # losses; weights, gradients (last, first), moments
    assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble, reference=want)


SMALL = ModelConfig(layers=4, hidden=8, heads=4, ffn_hidden=4, seq=8, vocab=8, tied_head=False, dropout=0.1)


@settings(max_examples=max(12, settings.default.max_examples // 2))
@given(layouts(SMALL, max_world=8))
def test_any_drawn_layout_is_bit_exact(layout):
    """The public strategy (simcluster.testing.layouts) draws the layouts; the one-device run is the
    same program on a mesh of one. (Half the profile's examples, 1.5 s each here: every pair of options
    is drawn by the covering array above; the thorough profile draws 125.)"""
    assert_bit_exact(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                     reference_config=layout.one_device)


def small_4d(zero):
    model = ModelConfig(layers=2, hidden=8, heads=4, ffn_hidden=4, seq=8, vocab=6, tied_head=False, dropout=0.1)
    return TrainingConfig(model=model, global_batch=4, micro_batches=2, steps=2, precision="bf16", zero=zero)


def test_the_layout_of_the_broken_variants_passes_unbroken():
    data = small_4d(2)
    got, _ = run_composed(data, dp=2, pp=2, cp=2, sp=True, attention="ring")
    assert report.verification("exact", reference(data), got)["bit_exact"]


@pytest.mark.parametrize("zero,zero_over", [(0, "dp_cp"), (2, "dp")])
def test_gradients_summed_over_dp_alone_are_caught(monkeypatch, zero, zero_over):
    """cp ranks saw other tokens with the same weights: forgetting their sum changes the result
    (DDP all-reducing over dp alone; ZeRO over dp skipping its all-reduce over cp)."""
    from simcluster.parallel.dp_wrap import DPWrap

    init = DPWrap.__init__

    def over_dp(self, ctx, *args, **kw):
        init(self, ctx, *args, **kw)
        if zero == 0:
            self.groups = dict.fromkeys(self.groups, ctx.mesh.dp)
        else:
            assert self.cp_first is not None
            self.cp_first = None

    monkeypatch.setattr(DPWrap, "__init__", over_dp)
    data = small_4d(zero)
    got, _ = run_composed(data, dp=2, pp=2, cp=2, sp=True, attention="ring", zero_over=zero_over)
    assert not report.verification("exact", reference(data), got)["bit_exact"]


def test_a_zero_rank_updating_its_neighbours_chunk_is_caught(monkeypatch):
    """ZeRO-1: every rank starts from the next rank's chunk of the master weights."""
    from simcluster.parallel.dp_wrap import DPWrap

    init = DPWrap.__init__

    def shifted(self, ctx, data, names, shapes, weights, **kw):
        init(self, ctx, data, names, shapes, weights, **kw)
        ops, n = ctx.ops, self.n
        self.master = {u: ops.chunk(ops.pad(ops.flat([weights[k] for k in names[u]]), n), n, (self.k + 1) % n)
                       for u in self.units}

    monkeypatch.setattr(DPWrap, "__init__", shifted)
    data = small_4d(1)
    got, _ = run_composed(data, dp=2, pp=2, cp=2, attention="ulysses")
    assert not report.verification("exact", reference(data), got)["bit_exact"]


def test_a_norm_counting_replicas_twice_is_caught(monkeypatch):
    """Clipping by global norm: every rank counting every element it holds (tp replicas and dp replicas
    included) gives a larger norm, a smaller clip coefficient and other weights."""
    from simcluster.parallel.dp_wrap import DPWrap

    monkeypatch.setattr(DPWrap, "_owned", lambda self, elsewhere: None)
    data = TrainingConfig(model=small_4d(0).model, global_batch=4, micro_batches=2, steps=2, clip_grad=0.05)
    got, _ = run_composed(data, dp=2, tp=2, cp=2, sp=True)
    assert not report.verification("exact", reference(data), got)["bit_exact"]


def test_a_ddp_replica_squares_no_gradient_it_does_not_count():
    """Clipping under DDP: the first rank counts every gradient element, its replica none of them; the
    replica squares a one-element zero (one norm kernel) instead of zeroing and squaring every unit's gradient
    (one where and one norm a unit), and the result is still the one device's, byte for byte."""
    from simcluster.run.runner import run_scenario
    from simcluster.config.scenario import load

    out = run_scenario(load(None, ["parallel.dp=2", "parallel.zero=0", "cluster.gpus_per_node=2", "run.steps=1",
                                   "model.layers=1", "run.numerics=exact", "run.clip_grad=1.0"]), fold=False)
    assert out.report["verification"]["bit_exact"]
    optimizer = [(e.rank, e.name.rpartition("/")[2]) for e in out.result.trace.events if e.name.startswith("O0/")]
    units = 3  # embed, block0, head
    assert optimizer.count((0, "grad_norm")) == units and (0, "where") not in optimizer
    assert optimizer.count((1, "grad_norm")) == 1 and optimizer.count((1, "where")) == 1


@pytest.mark.parametrize("tp,kv_heads,heads,cp,attention", [(2, 1, 2, 1, "ulysses"), (4, 1, 4, 1, "ring"),
                                                           (4, 2, 8, 2, "ring"), (3, 1, 3, 2, "allgather")])
def test_kv_heads_replicated_when_tp_exceeds_them(tp, kv_heads, heads, cp, attention):
    """Megatron-LM: with more tp ranks than kv heads, each kv head lives on tp/kv_heads ranks."""
    model = ModelConfig(arch="llama", layers=2, hidden=2 * heads, heads=heads, kv_heads=kv_heads, ffn_hidden=2 * tp,
                      seq=2 * cp * tp, vocab=3 * tp, tied_head=False, dropout=0.1)
    data = TrainingConfig(model=model, global_batch=4, micro_batches=2, steps=2, precision="bf16", zero=1, clip_grad=0.05)
    got, _ = run_composed(data, dp=2, cp=cp, tp=tp, sp=True, attention=attention)
    verdict = report.verification("exact", reference(data), got)
    assert verdict["bit_exact"], verdict["mismatches"]


def test_a_replicated_kv_head_counted_twice_is_caught(monkeypatch):
    """Every rank holding a kv head adding its input gradient, instead of one of them."""
    from simcluster.parallel.llama_shard import LlamaShard

    model = ModelConfig(arch="llama", layers=1, hidden=8, heads=4, kv_heads=1, ffn_hidden=8, seq=8, vocab=8,
                      tied_head=False)
    data = TrainingConfig(model=model, global_batch=2, steps=1)
    monkeypatch.setattr(LlamaShard, "adds_kv_input_gradient", lambda self: True)
    bad, _ = run_composed(data, tp=4)
    assert not report.verification("exact", reference(data), bad)["bit_exact"]


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, tp=2, sp=True), dict(pp=2, cp=2, attention="ring"),
                                    dict(dp=2, pp=2, cp=2, tp=2, attention="ulysses")])
def test_fast_mode_runs_every_layout(layout):
    """Fast mode (BLAS floats) through the same program: it runs, and the first loss (same weights, same
    tokens) agrees with one device to float32 rounding; the fast-mode tolerance story is issue 13's."""
    model = ModelConfig(layers=2, hidden=16, heads=4, ffn_hidden=8, seq=8, vocab=8, tied_head=False, dropout=0.1)
    data = TrainingConfig(model=model, global_batch=2 * layout.get("dp", 1), micro_batches=2, steps=2, zero=1,
                    clip_grad=1.0)
    got, _ = run_composed(data, mode="fast", **layout)
    want = reference(data, "fast")
    assert abs(float(got["loss[0]"]) - float(want["loss[0]"])) <= 1e-5 * abs(float(want["loss[0]"]))
