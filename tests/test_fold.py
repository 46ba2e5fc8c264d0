"""Folding identical ranks (engine/fold.py) changes the cost of a simulation, never its result."""

import json

import pytest

from simcluster.cli import main
from simcluster.config.scenario import load
from simcluster.engine import simulate
from simcluster.engine.fold import Fold, fold_for
from simcluster.model.config import ModelConfig
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_all
from simcluster.topology.presets import preset

# Every family in the library, made to fold: more data-parallel replicas than one block of whole nodes.
FOLDING = [
    ("zero_memory", ["cluster.gpus_per_node=4", "cluster.nodes=2"]),  # DDP, ZeRO-1/2/3 over dp 8
    ("fsdp_prefetch", []),  # ZeRO-3 with and without prefetch, dp 16 on two nodes
    ("pipeline_schedules", ["parallel.dp=2", "cluster.nodes=2", "model.global_batch=16"]),  # GPipe .. DualPipe
    ("megatron_3d", []),  # TP x PP x DP with SP, 1F1B and interleaved
    ("llama3_4d", []),  # TP x CP x PP x DP, GQA, all-gather CP, ZeRO-3 over dp x cp
    ("llama3_4d", ["cluster.gpus_per_node=2", "cluster.nodes=8"]),  # the same, one tp group a node
    ("ring_long_sequence", ["parallel.dp=2", "cluster.nodes=2", "model.global_batch=2"]),  # ring CP
    ("sequence_volume", ["cluster.gpus_per_node=4", "cluster.nodes=2"]),  # TP+SP, Ulysses (cp in a node), ring
    ("sequence_volume", ["cluster.gpus_per_node=2", "cluster.nodes=4"]),  # Ulysses' cp over two nodes
    ("llama3_4d", ["parallel.attention=ulysses", "model.kv_heads=4"]),  # GQA, a cp rank's own kv heads
    ("llama3_4d", ["parallel.pp=1", "parallel.cp=4", "run.clip_grad=0"]),  # all-gather CP's peers in a node
    # plan's best at scale in miniature: tp 2 x cp 8 over two nodes a replica, ZB-V, ZeRO-1 over dp x cp
    ("llama3_4d", ["parallel.cp=8", "cluster.nodes=8", "parallel.schedule=zb-v", "parallel.zero=1",
                   "model.global_batch=8", "model.seq=64"]),
    ("tp_sp_memory", ["cluster.gpus_per_node=4", "cluster.nodes=2"]),  # TP, SP, selective recompute
    ("tp_cliff", []),  # TP inside a node (folds), TP across nodes (does not)
    # the tensor-parallel overlap: a ring of messages between tp peers, folded onto the representative's own
    ("megatron_3d", ["parallel.tp_comm_overlap=true"]),
    ("llama3_4d", ["parallel.tp_comm_overlap=true"]),
]


@pytest.mark.parametrize("name,overrides", FOLDING, ids=[f"{n}{'-' if o else ''}{'-'.join(o)}" for n, o in FOLDING])
def test_folded_runs_give_the_unfolded_trace_and_report_byte_for_byte(name, overrides):
    """With tp < GPUs per node, the clipping norm's all-reduce over the world crosses tp groups: its
    ring visits a node's ranks by tp index (cluster.ring_order), which a tp rotation maps onto itself."""
    sc = load(name, ["run.numerics=meta"] + overrides)
    folded, unfolded = run_all(sc, fold=True), run_all(sc, fold=False)
    pairs = [(folded, unfolded)] if not sc.variants else list(zip((o for _, o in folded.variants),
                                                                   (o for _, o in unfolded.variants)))
    assert any(f.result.fold is not None for f, _ in pairs), "the scenario must exercise the fold"
    for f, u in pairs:
        assert u.result.fold is None
        assert json.dumps(f.report, sort_keys=True) == json.dumps(u.report, sort_keys=True)
        full = f.result.full_trace()
        assert full.lanes == u.result.trace.lanes
        assert full.to_jsonl() == u.result.trace.to_jsonl()
        assert full.memory == u.result.trace.memory
        if f.result.fold is not None:  # and it did simulate fewer ranks
            assert len(f.result.trace) * f.result.fold.copies == len(u.result.trace)
            assert f.result.fold.copies > 1


def _llama(tp, kv_heads):
    model = ModelConfig(arch="llama", layers=2, hidden=64, heads=8, kv_heads=kv_heads, ffn_hidden=160, seq=32,
                      vocab=128, tied_head=False)
    return Parallelism(data=TrainingConfig(model=model, global_batch=4, micro_batches=2, steps=1, zero=1), sp=True)


def test_the_comparison_catches_a_fold_over_ranks_that_differ():
    """With kv heads replicated over tp ranks, one rank of each copy adds the kv input gradient: its
    tp peers are not alike (Parallelism.alike leaves tp out), and folding them anyway gives another trace."""
    parallelism, mesh = _llama(tp=4, kv_heads=2), DeviceMesh(dp=2, tp=4)
    spec = preset("dgx-a100", nodes=2, gpus_per_node=4)
    assert parallelism.alike(4) == ("dp",)
    unfolded = simulate(composed, parallelism, mesh=mesh, cluster=spec, mode="meta")
    honest = simulate(composed, parallelism, mesh=mesh, cluster=spec, mode="meta", fold=parallelism.alike(4))
    forced = simulate(composed, parallelism, mesh=mesh, cluster=spec, mode="meta", fold=("dp", "tp"))
    assert honest.fold is not None and forced.fold is not None and forced.fold.tp
    assert honest.full_trace().to_jsonl() == unfolded.trace.to_jsonl()
    assert forced.full_trace().to_jsonl() != unfolded.trace.to_jsonl()


def test_a_collective_that_is_not_symmetric_runs_unfolded(monkeypatch):
    """A broadcast from rank 0 over dp is a chain that starts at one replica: not the same in every
    block, nor does each block's ports carry what the first's do. The run notices, runs unfolded, and
    says why."""
    def prog(ctx):
        x = MetaTensor((1024,), "fp32")
        yield ctx.comm.all_reduce(x, group=ctx.mesh.dp)
        yield ctx.comm.broadcast(x, src=0, group=ctx.mesh.dp)

    mesh, spec = DeviceMesh(dp=4), preset("dgx-a100", nodes=2, gpus_per_node=2)
    run = simulate(prog, mesh=mesh, cluster=spec, mode="meta", fold=("dp",))
    plain = simulate(prog, mesh=mesh, cluster=spec, mode="meta")
    assert run.fold is None and "broadcast" in run.unfolded_because
    assert run.trace.to_jsonl() == plain.trace.to_jsonl()
    # the ports check is what refuses it: without, the fold goes ahead and times another run
    monkeypatch.setattr(Fold, "_ports_alike", lambda *args: None)
    forced = simulate(prog, mesh=mesh, cluster=spec, mode="meta", fold=("dp",))
    assert forced.fold is not None and forced.full_trace().to_jsonl() != plain.trace.to_jsonl()


def test_where_a_layout_folds():
    a100 = preset("dgx-a100")
    # replicas of 2 ranks on nodes of 8: blocks of 4 replicas (one node); on nodes of 1: one replica
    assert fold_for(DeviceMesh(dp=12, tp=2), a100.with_overrides(nodes=3), ("dp",)).block == 4
    assert fold_for(DeviceMesh(dp=6, tp=2), a100.with_overrides(nodes=12, gpus_per_node=1), ("dp",)).block == 1
    assert fold_for(DeviceMesh(dp=6, tp=2), a100.with_overrides(nodes=12, gpus_per_node=1), ()) is None
    # one node of 12: the only block of whole nodes is the world; tp peers are told not alike
    assert fold_for(DeviceMesh(dp=6, tp=2), a100.with_overrides(nodes=1, gpus_per_node=12), ("dp",)) is None
    # tp peers fold inside a node, not across nodes
    assert fold_for(DeviceMesh(tp=16), a100.with_overrides(nodes=2), ("dp", "tp")) is None
    assert fold_for(DeviceMesh(tp=8), a100, ("dp", "tp")).tp
    with pytest.raises(ValueError, match="meta mode"):
        simulate(composed, _llama(2, 2), mesh=DeviceMesh(dp=2, tp=2), cluster=a100.with_overrides(gpus_per_node=4),
                 mode="exact", fold=("dp",))


def test_cli_no_fold_prints_the_same_report(capsys):
    args = ["run", "megatron_3d", "--set", "run.numerics=meta", "--set", "parallel.schedule=1f1b",
            "--set", "parallel.virtual_stages=1", "--json"]
    assert main(args) == 0
    folded = capsys.readouterr().out
    assert main(args + ["--no-fold"]) == 0
    assert capsys.readouterr().out == folded


def test_views_of_a_folded_run_draw_any_rank(capsys, tmp_path):
    """The timeline draws the representatives, or any rank asked for (rebuilt); export writes every rank."""
    meta = ["--set", "run.numerics=meta", "--set", "parallel.schedule=1f1b", "--set", "parallel.virtual_stages=1"]
    assert main(["timeline", "megatron_3d", *meta, "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert "folded" in out and "r6 compute" in out and "r7 " not in out and "r8 " not in out
    assert main(["timeline", "megatron_3d", *meta, "--ranks", "9", "--width", "40"]) == 0
    assert "r9 compute" in capsys.readouterr().out
    path = tmp_path / "trace.json"
    assert main(["export", "megatron_3d", *meta, "-o", str(path)]) == 0
    names = {e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(16)}


def test_tp_peers_fold_when_a_node_holds_several_tp_groups():
    """megatron_3d: tp 2 on nodes of 8, with the clipping norm's all-reduce over the world."""
    sc = load("megatron_3d", ["run.numerics=meta", "parallel.schedule=1f1b", "parallel.virtual_stages=1"])
    assert not sc.variants  # (the --set picks one of its two runs)
    result = run_all(sc).result
    assert result.fold is not None and result.fold.tp and result.unfolded_because == ""
    assert len(result.fold.ranks) == 4  # one replica of tp 2 x pp 4, one rank of each tp pair


def test_context_parallel_peers_fold_under_ulysses_and_all_gather_attention_only():
    """Ulysses gives every cp rank the same shapes: with one cp group a node, one rank stands for its
    node's four (and the other node's); so does all-gather attention (every rank attends its two zigzag
    chunks to all the keys); ring attention gives each rank other blocks of the mask, and
    its cp peers run. A ring through a node's tp and cp ranks in node order is not its own image under
    the cp rotation (llama3_4d's world all-reduce; ZeRO over dp x cp across nodes), but every port
    carries what its representative's does: cp folds with tp too."""
    sc = load("sequence_volume", ["run.numerics=meta", "cluster.gpus_per_node=4", "cluster.nodes=2"])
    runs = dict(run_all(sc, fold=True).variants)
    ulysses, ring = (runs[f"tp=1, cp=4, sp=false, attention={a}"].result for a in ("ulysses", "ring"))
    assert ulysses.fold.cp_local == 4 and ulysses.fold.copies == 8 and "context-parallel" in ulysses.fold.describe()
    assert ring.fold.cp_local == 0 and ring.fold.copies == 2
    gathered = run_all(load("llama3_4d", ["run.numerics=meta", "parallel.pp=1", "parallel.cp=4", "run.clip_grad=0"]))
    assert gathered.result.fold.cp_local == 4 and gathered.result.fold.copies == 16  # one rank of 16 runs
    mixed = run_all(load("llama3_4d", ["run.numerics=meta", "parallel.attention=ulysses", "model.kv_heads=4"]))
    assert mixed.result.fold.tp and mixed.result.fold.cp_local == 2 and mixed.result.unfolded_because == ""
    assert mixed.result.fold.copies == 8
