"""`simcluster plan`: every layout it prints is one `simcluster run` would run, best first."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from simcluster.analysis.estimate import Layout, estimate
from simcluster.analysis.planner import layouts, search
from simcluster.cli import main
from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario

# a 4-layer GPT on two nodes of 4 GPUs: small enough to simulate many layouts in meta mode
SMALL = ["run.numerics=meta", "run.steps=1", "model.layers=4", "model.hidden=512", "model.heads=8", "model.ffn_hidden=2048",
         "model.seq=512", "model.vocab=1024", "model.global_batch=32", "model.tied_head=false",
         "cluster.nodes=2", "cluster.gpus_per_node=4", "parallel.dp=8", "parallel.zero=0"]


def test_the_search_prints_simulated_layouts_best_first_each_as_run_would_run_it():
    sc = load(None, SMALL)
    found = search(sc, simulate=3)
    assert found.examined >= found.valid >= found.fitting >= len(found.rows) == 3
    times = [r.report["step_time_ns"] for r in found.rows]
    assert times == sorted(times)
    for row in found.rows:
        lay = row.layout
        assert lay.tp * lay.pp * lay.cp * lay.dp == 8 and 4 % lay.tp == 0
        again = run_scenario(lay.scenario(sc)).report  # the same layout, run on its own
        assert again["step_time_ns"] == row.report["step_time_ns"]
        assert again["memory"] == row.report["memory"]
        # the closed form only chooses what to simulate, but it is not far off the simulator's peak
        assert 0.5 < row.estimate.memory_bytes / row.report["memory"]["peak_bytes"] < 2


def test_the_estimate_refuses_what_the_plan_refuses():
    sc = load(None, SMALL)
    checked = [(lay, estimate(sc, lay)) for lay in layouts(sc)]
    assert any(e is None for _, e in checked) and any(e is not None for _, e in checked)
    # 8 heads: tp 4 is fine, and no layout puts more pipeline stages than layers
    assert all(lay.pp <= 4 for lay, _ in checked)
    # interleaved needs each replica's micro-batch count to be a multiple of pp (here 32 / dp / mb)
    for lay, e in checked:
        per = 32 // lay.dp // lay.micro_batch if 32 % lay.dp == 0 else 0
        if lay.schedule == "interleaved" and e is not None:
            assert per % lay.pp == 0


def test_simulations_in_worker_processes_give_the_same_table_and_progress(capsys):
    """--jobs 3 runs the three simulations side by side, each in its own process: the same JSON, and
    the same progress lines in the same order, as one after the other; --jobs 0 is one line."""
    args = ["plan", "--simulate", "3", "--json"] + [x for kv in SMALL for x in ("--set", kv)]
    assert main(args + ["--jobs", "1"]) == 0
    alone = capsys.readouterr()
    assert main(args + ["--jobs", "3"]) == 0
    together = capsys.readouterr()
    assert together.out == alone.out
    assert together.err.splitlines()[:-1] == alone.err.splitlines()[:-1]  # (the last: the estimate's rate)
    assert len(alone.err.splitlines()) == 4 and len(json.loads(alone.out)["rows"]) == 3
    assert main(args + ["--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--jobs" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_plan_and_a_sweep_on_a_local_ray_cluster_give_what_they_give_here(capsys):
    """Issue 40: `plan --ray` starts a local Ray cluster, runs the two simulations as its tasks and
    stops it: the same JSON and progress lines as --jobs 1. `sweep --ray`, in a process already connected
    to a cluster, runs on it and leaves it running: the same points as here. An address where no cluster
    answers is one line, at once (not Ray's minutes of retries)."""
    ray = pytest.importorskip("ray", reason="ray is in the test extra")
    args = ["plan", "--simulate", "2", "--json"] + [x for kv in SMALL for x in ("--set", kv)]
    assert main(args + ["--jobs", "1"]) == 0
    here = capsys.readouterr()
    assert main(args + ["--ray"]) == 0
    there = capsys.readouterr()
    assert there.out == here.out and len(json.loads(there.out)["rows"]) == 2
    assert there.err.splitlines()[:-1] == here.err.splitlines()[:-1]  # (the last: the estimate's rate)
    assert not ray.is_initialized()  # the plan's own cluster, stopped
    sweep = ["sweep", "--key", "parallel.zero", "--values", "0,3,4", "--json", "--set", "run.numerics=meta"]
    assert main(sweep) == 0
    points = capsys.readouterr().out
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        assert main(sweep + ["--ray", "auto"]) == 0
        assert capsys.readouterr().out == points and ray.is_initialized()  # joined, and left running
    finally:
        ray.shutdown()
    assert '"refused": ""' in points and "parallel.zero" in points  # (4: a refused point, as here)
    assert main(args + ["--ray", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--ray 127.0.0.1:1: no Ray cluster answers there" in err and len(err.strip().splitlines()) == 1


def test_plan_command_json_is_deterministic_and_says_when_nothing_fits(capsys):
    args = ["plan", "--simulate", "1", "--json"] + [x for kv in SMALL for x in ("--set", kv)]
    assert main(args) == 0
    first, progress = capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert progress.startswith("simulating 1 of 1: TP")  # (stderr is no terminal: a line a simulation)
    rows = json.loads(first)["rows"]
    assert len(rows) == 1 and rows[0]["memory"]["fits"]
    assert main(args + ["--set", "cluster.memory_gbyte=0.001"]) == 3  # 1 MB GPUs: nothing fits
    err = capsys.readouterr().err
    assert "out of memory" in err and "Traceback" not in err


def test_fixed_fields_narrow_the_search_and_a_bad_fix_is_one_line(capsys):
    sc = load(None, SMALL)
    fixed = {"pp": (1,), "zero": (0, 1), "recompute": ("full",)}
    found = search(sc, simulate=1, fixed=fixed)
    every = [lay for lay in layouts(sc)]
    narrowed = [lay for lay in layouts(sc, fixed)]
    assert found.examined == len(narrowed) < len(every)
    assert narrowed == [lay for lay in every if lay.pp == 1 and lay.zero in (0, 1) and lay.recompute == "full"]
    assert (found.rows[0].layout.pp, found.rows[0].layout.recompute) == (1, "full")
    base = ["plan", "--simulate", "1"] + [x for kv in SMALL for x in ("--set", kv)]
    for bad in ("pp", "pp=two", "colour=red", "sp=2"):
        assert main(base + ["--fix", bad]) == 2
        err = capsys.readouterr().err
        assert "--fix" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(base + ["--fix", "tp=3"]) == 2  # no valid layout: said, not a crash
    assert "no valid layout" in capsys.readouterr().err


def test_the_zero_bubble_schedules_are_searched_and_estimated_below_1f1b():
    """The same pipeline under 1F1B, ZB-H1 and ZB-V: the estimate's bubble shrinks (p-1)/m, /3, /6;
    ZB-V (two chunks a stage) is refused where 2 pp > layers, as the plan refuses it; and the
    simulator agrees on the order (its bubbles are test_pipeline's closed forms). Memory: the
    zero-bubble schedules hold a micro-batch until its W pass (the last stage's LM head cache too),
    and ZB-V's first stage holds the embedding and the head: each estimate within 4 % of the peak
    simulated, ZB-H1's and ZB-V's above 1F1B's."""
    from dataclasses import replace

    sc = load(None, SMALL)
    pipelined = [lay for lay in layouts(sc) if (lay.tp, lay.pp, lay.cp, lay.zero, lay.micro_batch, lay.recompute)
                 == (1, 2, 1, 0, 1, "none")]
    assert [lay.schedule for lay in pipelined] == ["1f1b", "interleaved", "zb-h1", "zb-v"]
    one, _, h1, v = (estimate(sc, lay) for lay in pipelined)
    assert v.seconds < h1.seconds < one.seconds and v.memory_bytes > h1.memory_bytes > one.memory_bytes
    deep = next(lay for lay in layouts(sc) if lay.pp == 4 and lay.schedule == "zb-v")
    assert estimate(sc, deep) is None  # 2 x 4 chunks of a 4-layer model
    assert estimate(sc, replace(deep, schedule="zb-h1")) is not None
    reports = [run_scenario(lay.scenario(sc)).report for lay in (pipelined[0], pipelined[2], pipelined[3])]
    steps = [r["step_time_ns"] for r in reports]
    assert steps[2] < steps[1] < steps[0]
    for e, r in zip((one, h1, v), reports):
        assert abs(e.memory_bytes / r["memory"]["peak_bytes"] - 1) < 0.04
    assert pipelined[2].label() == "TP1 PP2 ZB-H1 CP1 DP4"


def test_the_estimate_charges_the_data_parallel_reduction_a_slower_network_exposes():
    """Two clusters that differ only in their NICs: the estimate of a DDP layout over both nodes differs
    by the all-reduce's bytes through a NIC when the reduction follows the backward pass: NCCL's rings,
    one a GPU-NIC pair, send a quarter of a member's 2 (n-1)/n x 2 bytes x Psi (the 16-bit gradients)
    through its NIC (four members a node; NIC-bound at 100 and 200 Gb/s against NVLink's 240 GB/s); less
    is exposed when it overlaps the backward; within one node the estimate does not depend on the NIC."""
    from simcluster.analysis.estimate import Layout

    def seconds(gbit, sets, lay):
        return estimate(load(None, SMALL + [f"cluster.nic_gbit_per_s={gbit}", *sets]), lay).seconds

    sc, n = load(None, SMALL), 8
    lay = Layout(tp=1, pp=1, cp=1, dp=8, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    psi = run_scenario(lay.scenario(sc), trace=False).report["parameters"]
    bw = 200e9 / 8 * sc.cluster_spec().nic_efficiency  # bytes/s: a NIC at 200 Gb/s, at the preset's efficiency
    ring = 2 * (n - 1) / n * 2 * psi / 4  # what a member's NIC carries
    apart = seconds(100, ["parallel.overlap_grad_reduce=false"], lay) - seconds(200, ["parallel.overlap_grad_reduce=false"], lay)
    # (within 3 %: the estimate's Psi leaves out the position embedding and the last norm, 2 % of this model)
    assert abs(apart - ring * (1 / (bw / 2) - 1 / bw)) / apart < 0.03
    for gbit in (100, 200):  # overlapped with the last micro-batch's backward, less of it is exposed
        assert seconds(gbit, [], lay) < seconds(gbit, ["parallel.overlap_grad_reduce=false"], lay)
    one_node = [Layout(tp=1, pp=1, cp=1, dp=4, zero=z, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
                for z in (0, 2)]
    for lay in one_node:
        sets = ["cluster.nodes=1", "parallel.dp=4", "model.global_batch=16"]
        assert seconds(100, sets, lay) == seconds(200, sets, lay)


def test_the_plan_picks_megatrons_own_tp_and_pp_for_table1_row_6():
    """Megatron-LM's weak-scaling table (benchmarks/megatron_table1.toml), row 6: a 146B GPT on 1,024
    A100s, for which Narayanan et al. (2021) chose TP 8 x PP 4 x DP 32. Searched among the layouts
    Megatron-LM then had (no CP, no ZeRO, full recomputation, the row's micro-batch of 2),
    `plan`'s best simulated layout has the same TP and PP. (The other rows: benchmarks/plan_megatron.py.)"""
    sc = load(str(Path(__file__).parents[1] / "benchmarks" / "megatron_table1.toml"))
    _, row = sc.variants[5]
    assert (row.parallel.tp, row.parallel.pp, row.parallel.dp) == (8, 4, 32)
    found = search(row, simulate=3, fixed={"cp": (1,), "zero": (0,), "recompute": ("full",),
                                           "schedule": ("1f1b", "interleaved"), "micro_batch": (2,)})
    best = found.rows[0].layout
    assert (best.tp, best.pp, best.dp) == (8, 4, 32)


def test_the_estimate_charges_context_parallel_exchanges_as_the_simulator_times_them():
    """Ulysses' all-to-alls and all-gather KV's gathers and reduce-scatters sit on the critical path.
    What the estimate charges a cp = 8 layout for them (its estimate less that of dp = 8 without cp,
    the same work and the same gradient reduction) is the time the simulator's cp stream is busy on
    a rank, within 5 %, latencies included (NCCL's, by the protocol each call's size picks): inside one
    node, and across two, where each rank's NIC carries the share that leaves its node."""
    from simcluster.analysis.estimate import Layout

    base = ["run.numerics=meta", "run.steps=1", "model.layers=2", "model.hidden=1024", "model.heads=8",
            "model.ffn_hidden=1024", "model.seq=32768", "model.vocab=1024", "model.global_batch=8",
            "parallel.dp=8", "parallel.zero=0", "parallel.overlap_grad_reduce=false"]
    lay = Layout(tp=1, pp=1, cp=8, dp=1, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    flat = Layout(tp=1, pp=1, cp=1, dp=8, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    for cluster in (["cluster.nodes=1", "cluster.gpus_per_node=8"], ["cluster.nodes=2", "cluster.gpus_per_node=4"]):
        for attention in ("ulysses", "allgather"):
            sc = load(None, base + cluster + [f"parallel.attention={attention}"])
            charged = estimate(sc, lay).seconds - estimate(sc, flat).seconds
            busy = max(lanes.get("comm:cp", 0) for lanes in
                       run_scenario(lay.scenario(sc), trace=False).report["busy_ns"].values()) / 1e9
            assert abs(charged / busy - 1) < 0.05, (cluster, attention, charged, busy)


def test_the_estimate_charges_unfused_gradient_accumulation_as_the_simulator_times_it():
    """Without grad_accumulation_fusion each micro-batch's gradients after the first are summed by a kernel of
    their own, and copied into the flat buffer that is reduced (once a step below ZeRO-2, each micro-batch
    from it). What the estimate charges for them (its estimate less the fused one's) is what they add to the
    simulator's compute stream on a rank, within 5 % (its kernels' launches and the embedding's gradients
    are what is left), for 16-bit and fp32 gradients and ZeRO 0 to 2."""
    base = ["run.numerics=meta", "run.steps=1", "model.layers=2", "model.hidden=2048", "model.heads=16",
            "model.ffn_hidden=8192", "model.seq=1024", "model.vocab=1024", "model.global_batch=32",
            "cluster.nodes=1", "cluster.gpus_per_node=8", "parallel.dp=8"]
    for zero in (0, 1, 2):
        lay = Layout(tp=1, pp=1, cp=1, dp=8, zero=zero, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
        for fp32 in ("true", "false"):
            sc = {fused: load(None, base + [f"parallel.zero={zero}", f"parallel.grads_fp32={fp32}",
                                            f"parallel.grad_accumulation_fusion={fused}"])
                  for fused in ("true", "false")}
            charged = estimate(sc["false"], lay).seconds - estimate(sc["true"], lay).seconds
            busy = {fused: run_scenario(lay.scenario(s), trace=False).report["busy_ns"]["0"]["compute"] / 1e9
                    for fused, s in sc.items()}
            assert abs(charged / (busy["false"] - busy["true"]) - 1) < 0.05, (zero, fp32, charged, busy)


def test_sequence_parallelism_is_searched_on_unless_fixed():
    """With tp, layouts run sequence-parallel; `--fix sp=0` searches them as Megatron-LM ran before 2022
    (and sp=0,1 both), each labelled and run as it says."""
    sc = load(None, SMALL)
    default = [lay for lay in layouts(sc) if lay.tp > 1]
    assert default and all(lay.sp == 1 for lay in default)
    off = [lay for lay in layouts(sc, {"sp": (0,)}) if lay.tp > 1]
    both = [lay for lay in layouts(sc, {"sp": (0, 1)}) if lay.tp > 1]
    assert len(off) == len(default) and len(both) == 2 * len(default)
    assert all("no-SP" in lay.label() and lay.scenario(sc).parallel.sp is False for lay in off)
    assert all(lay.scenario(sc).parallel.sp is True for lay in default)
    big = max((lay for lay in off if lay.recompute == "none" and estimate(sc, lay)), key=lambda lay: lay.micro_batch)
    assert estimate(sc, big).memory_bytes > estimate(sc, replace(big, sp=1)).memory_bytes  # (whole activations)


def test_the_plan_recovers_megatrons_tp_and_pp_for_table1_row_4():
    """Row 4: an 18B GPT on 256 A100s, TP 8 x PP 1 x DP 32. Among the layouts Megatron-LM had in 2021 (no
    CP, ZeRO or sequence parallelism, full recomputation, micro-batch 8), each with the DDP it then ran
    (PyTorch's, overlapped, without a pipeline; its own local DDP, after the backward pass, with one:
    run_table_1.sh), TP 8 x PP 1 is within 3 % of the best simulated layout."""
    sc = load(str(Path(__file__).parents[1] / "benchmarks" / "megatron_table1.toml"))
    _, row = sc.variants[3]
    assert (row.parallel.tp, row.parallel.pp) == (8, 1) and row.parallel.overlap_grad_reduce
    fixed = {"cp": (1,), "zero": (0,), "sp": (0,), "recompute": ("full",), "schedule": ("1f1b", "interleaved"),
             "micro_batch": (8,)}
    rows = search(row, simulate=3, fixed=fixed | {"pp": (1,)}).rows + search(
        replace(row, parallel=replace(row.parallel, overlap_grad_reduce=False)), simulate=3,
        fixed=fixed | {"pp": (2, 4, 8)}).rows
    fits = [r for r in rows if r.report["memory"]["fits"]]
    best = min(r.report["step_time_ns"] for r in fits)
    megatron = [r.report["step_time_ns"] for r in fits if (r.layout.tp, r.layout.pp) == (8, 1)]
    assert megatron and min(megatron) <= 1.03 * best


def test_the_estimate_runs_a_pipeline_at_its_busiest_stages_pace():
    """4 stages of 4, 5 and 8 layers: the busiest stage has 1, 2 and 2 layers (the 8-layer one's last
    stage the head too), so 5 layers are estimated nearly as slow as 8, not 5/8 of them -- in the
    simulator's order."""
    lay = Layout(tp=1, pp=4, cp=1, dp=2, zero=0, micro_batch=1, recompute="none", schedule="1f1b", virtual=1)
    est, sim = {}, {}
    for layers in (4, 5, 8):
        sc = load(None, SMALL + [f"model.layers={layers}"])
        est[layers] = estimate(sc, lay).seconds
        sim[layers] = run_scenario(lay.scenario(sc), trace=False).report["step_time_ns"]
    assert est[4] < est[5] <= est[8] and est[5] > 0.9 * est[8]
    assert sim[4] < sim[5] < sim[8]


def test_fixing_the_virtual_stages_searches_that_many():
    """The interleaved schedule is searched with two chunks a stage; `--fix virtual=4` searches four
    (and only layouts with four: not an empty search)."""
    sc = load(None, SMALL + ["model.layers=8"])
    assert {lay.virtual for lay in layouts(sc) if lay.schedule == "interleaved"} == {2}
    four = list(layouts(sc, {"virtual": (4,)}))
    assert four and all(lay.schedule == "interleaved" and lay.virtual == 4 for lay in four)
    assert any(estimate(sc, lay) for lay in four)


def test_a_plan_that_cannot_finish_here_is_refused_before_it_simulates(monkeypatch, capsys):
    """Issue 36: the budget's lower bound of each chosen simulation is checked before any starts; one past
    the limit alone, or all of them together (at --jobs at a time), is refused in one line with the estimate."""
    from simcluster.run import budget
    from simcluster.analysis import planner

    sc = load(None, SMALL)
    chosen = []

    def simulated(scenarios, fold, jobs, announce, ray=None):
        chosen.extend(scenarios)
        raise RuntimeError("simulated")

    monkeypatch.setattr(planner, "_simulated", simulated)
    with pytest.raises(RuntimeError, match="simulated"):
        search(sc, simulate=3)
    bounds = [budget.meta_seconds(one) for one in chosen]
    limit = max(max(bounds), sum(bounds) / 2) * 1.001  # each fits alone, and all three two at a time
    assert len(bounds) == 3 and sum(bounds) > limit
    monkeypatch.setattr(budget, "LIMIT_S", limit)
    chosen.clear()
    with pytest.raises(RuntimeError, match="simulated"):
        search(sc, simulate=3, jobs=2)
    assert len(chosen) == 3
    chosen.clear()
    base = ["plan", "--simulate", "3"] + [x for kv in SMALL for x in ("--set", kv)]
    assert main(base + ["--jobs", "1"]) == 2 and not chosen  # one at a time they do not
    err = capsys.readouterr().err
    assert "simulating the 3 best layouts would take at least" in err and "--simulate" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(budget, "LIMIT_S", min(bounds) / 2)  # none fits alone
    assert main(base + ["--jobs", "2"]) == 2 and not chosen
    err = capsys.readouterr().err
    assert "plan: simulating " in err and "meta mode would replay at least" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_plan_table_reads_at_80_columns_and_its_help_names_its_schedules(capsys):
    """Each layout on one line, no header or value cut ("micro-…"), MFU with its digits for a small
    model; the help lists the schedules the search returns."""
    from simcluster.analysis.estimate import BUBBLE

    assert main(["plan", "--simulate", "3", *[a for s in SMALL for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "0.0 %" not in out
    rows = [line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit() and "TP" in line]
    assert len(rows) == 3 and all(" Z" in row and " mb" in row and " DP" in row for row in rows)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert all(s.upper() in helped for s in BUBBLE)


def test_the_top_rows_are_distinct_layouts_and_a_fixed_layout_shows_its_variants():
    """The rows simulated are the best distinct layouts (degrees and schedule), each with its best-estimated
    ZeRO stage, micro-batch and recomputation (megatron_3d's 8 best estimates are one layout's variants);
    a search fixed to one layout simulates its variants instead."""
    from simcluster.analysis.planner import distinct_first

    sc = load("megatron_3d")
    rows = search(sc, simulate=8).rows
    labels = [r.layout.label() for r in rows]
    assert len(labels) == 8 and len(set(labels)) == 8
    ranked = sorted((e for e in map(lambda lay: estimate(sc, lay), layouts(sc)) if e is not None),
                    key=lambda e: e.seconds)
    assert len({e.layout.label() for e in ranked[:8]}) < 8  # (what the old selection simulated)
    one = {"tp": (1,), "pp": (8,), "cp": (1,), "schedule": ("zb-h1",)}
    fixed = search(sc, simulate=4, fixed=one).rows
    assert len({r.layout.label() for r in fixed}) == 1 and len({(r.layout.zero, r.layout.micro_batch, r.layout.recompute)
                                                                for r in fixed}) == 4
    firsts = distinct_first(ranked, 3)
    assert [e.layout.label() for e in firsts] == list(dict.fromkeys(e.layout.label() for e in ranked))[:3]
    assert all(e is next(f for f in ranked if f.layout.label() == e.layout.label()) for e in firsts)
