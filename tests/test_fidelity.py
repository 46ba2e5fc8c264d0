"""The fidelity suite's tables (benchmarks/fidelity.py) that the model meets, kept met: the rows that
simulate in a second. Published figures, each from the source its table file names."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from fidelity import TABLES, figure, table_scenario  # noqa: E402


@pytest.mark.parametrize("row", [1, 2])
def test_megatron_2022_rows_stay_within_the_goal(row):
    """Korthikanti et al. 2022 / the Megatron-LM README: 22B on 8 A100s (41.5 % MFU) and 175B on 64
    (51.4 %); predicted 41.8 and 50.6 when this test was written, 43.7 and 52.0 since its column-parallel
    backward runs as Megatron-LM's did (parallel.tp_async_backward: the reduce-scatter under the weight
    gradients, where NCCL's kernels then take SMs from the GEMM, which is not modelled). Each row within
    issue 40's goal for a row, 10 %."""
    table = TABLES["megatron-2022"]
    report = run_scenario(load(str(BENCHMARKS / table.file)).variants[row - 1][1], trace=False).report
    assert figure(report, table.metric) == pytest.approx(table.published[row - 1], rel=0.10)


def test_torchtitans_compiled_over_eager_stays_within_5_percent():
    """torchtitan's December 2024 table, 8 H100s: compiled 6,667 tokens/s a GPU, eager 5,762 (1.157);
    predicted 1.166 with its 500 W power limit and FlashAttention-2's rate, 1.137 since the H100's
    compute-bound rates are those a run sustains (the memory-bound kernels, eager's larger share, keep theirs)."""
    table = TABLES["torchtitan-2024"]
    variants = load(str(BENCHMARKS / table.file)).variants
    eager, compiled = (figure(run_scenario(variants[i][1], trace=False).report, table.metric) for i in (0, 1))
    assert compiled / eager == pytest.approx(table.published[1] / table.published[0], rel=0.05)


def test_torchtitans_async_tensor_parallel_speedup_stays_within_2_5_percent():
    """torchtitan's June 2025 table, Llama 3.1 8B on 64 H100s (FSDP 8, TP 8): async TP 4,809.4 tokens/s a
    GPU, plain TP 4,378 (1.099). Predicted 1.198 while async TP ran Megatron-LM's backward too; 1.135 once
    it left the column-parallel input gradients' reduce-scatters where they fall, as torch's pattern matcher
    does (a reduce-scatter of one GEMM's output only; those gradients sum two or three GEMMs); 1.119 since
    each fused reduce-scatter also sums its partials in a kernel of its own, as torch's does."""
    table = TABLES["torchtitan-2025"]
    variants = load(str(BENCHMARKS / table.file)).variants
    plain, overlapped = (figure(run_scenario(variants[i][1], trace=False).report, table.metric) for i in (0, 1))
    assert overlapped / plain == pytest.approx(table.published[1] / table.published[0], rel=0.025)


@pytest.mark.slow  # (a pipeline at scale, 7-24 s: the default suite's time; the tables' other tests run by default)
def test_llama_3s_step_from_8192_to_16384_gpus_stays_within_4_percent():
    """Llama 3 405B (Dubey et al. 2024, Table 4): 430 TFLOP/s a GPU on 8,192 H100s (DP 64), 400 on 16,384 (DP
    128, half the micro-batches a rank: the pipeline's bubble and the data-parallel reduction's share grow):
    0.930. Predicted 0.939 when this test was written (the rows themselves 23-25 % fast then; 7-8 % since the
    H100's compute-bound rates are those a run sustains, cluster.sustained_compute), 0.928 with the gradients
    whole until one reduce-scatter a step, and 0.896 since they are sharded as the paper's FSDP shards them
    (each micro-batch's reduced in fp32: on 16,384 GPUs every forward runs first, and the backwards' reductions
    are more exposed); this test was within 2 % until then."""
    table = TABLES["llama3-2024"]
    variants = load(str(BENCHMARKS / table.file)).variants
    small, large = (figure(run_scenario(variants[i][1], trace=False).report, table.metric) for i in (0, 1))
    assert large / small == pytest.approx(table.published[1] / table.published[0], rel=0.04)


def test_llama_3s_8192_gpu_layout_fits_80_gib_as_it_trained_with_its_gradients_sharded():
    """Llama 3 405B on 8,192 H100s (TP 8, PP 16 of 8 chunks, DP 64, 32 micro-batches of 8,192 tokens): trained
    "without activation checkpointing" on 80 GB GPUs (Dubey et al. 2024, section 3.3.2), with FSDP that "shards
    optimizer states and gradients". Its busiest stage holds 140 layers' activations of a micro-batch at once
    (75 GB); with each rank's 3.2 G gradients whole in fp32 (12.7 GB) it would need 95 GB. Sharded over the 64
    data-parallel ranks they take 0.2 GB, and the stage fits."""
    table = TABLES["llama3-2024"]
    report = run_scenario(load(str(BENCHMARKS / table.file)).variants[0][1], trace=False).report
    assert report["memory"]["fits"] and report["memory"]["peak_bytes"] <= report["memory"]["capacity_bytes"]
    per_rank = report["parameters"] / (8 * 16)  # (the tensor- and pipeline-parallel ranks' share, about)
    gradients = max(v.get("gradients", 0) for v in report["memory_peak_bytes"].values())
    assert gradients == pytest.approx(4 * per_rank / 64, rel=0.05)


@pytest.mark.slow  # (a pipeline at scale, 7-24 s: the default suite's time; the tables' other tests run by default)
def test_the_h100s_sustained_compute_reproduces_the_run_it_was_fitted_to():
    """Megatron-Core r0.8's 177B GPT on 96 H100s (DP 2, a bubble under 1 %): 47 % MFU, the one figure the
    H100 preset's sustained_compute (0.76) was fitted to, and 59.9 % without it. A change to the model that
    moves this row moves what the fit stands on: refit the constant (topology/presets.py) and say so there."""
    table = TABLES["megatron-core-2024-strong"]
    assert table.fitted == (1,)
    report = run_scenario(load(str(BENCHMARKS / table.file)).variants[0][1], trace=False).report
    assert figure(report, table.metric) == pytest.approx(table.published[0], abs=0.5)  # the README's whole percent


@pytest.mark.slow  # (a pipeline at scale, 7-24 s: the default suite's time; the tables' other tests run by default)
def test_megatron_cores_pipeline_from_2304_to_4608_gpus_stays_within_2_percent():
    """The 177B GPT (TP 8 x PP 6, batch 1,152): 432.8 TFLOP/s a GPU on 2,304 H100s (the weak-scaling table, 24
    micro-batches a pipeline) and 42 % MFU on 4,608 (the strong-scaling text, 12): 0.960. Interleaved one layer a
    virtual stage, predicted 0.960 when this test was written; plain 1F1B, whose bubble grows from 5 slots in 29
    to 5 in 17, predicts 0.82: the schedule the table's files assume is the one these runs had."""
    weak, strong = TABLES["megatron-core-2024"], TABLES["megatron-core-2024-strong"]
    at_2304 = run_scenario(load(str(BENCHMARKS / weak.file)).variants[6][1], trace=False).report
    at_4608 = run_scenario(load(str(BENCHMARKS / strong.file)).variants[1][1], trace=False).report
    assert at_2304["mesh"]["dp"] == 48 and at_4608["mesh"]["dp"] == 96
    published = strong.published[1] / (100 * weak.published[6] / 989)
    assert at_4608["mfu"] / at_2304["mfu"] == pytest.approx(published, rel=0.02)


def test_an_unstated_choice_read_the_other_way_changes_that_key_in_every_row_and_nothing_else():
    """fidelity.py --unstated runs a table again for each choice its source leaves unstated (TABLES names them):
    every row the file's, with that key's value in its place, in the rows that vary it too, or its default
    (None). Nothing else in any row changes."""
    declared = 0
    for table in TABLES.values():
        base = [v for _, v in table_scenario(table, []).variants]
        for _, values in table.unstated:
            declared += 1
            other = [v for _, v in table_scenario(table, [], values).variants]
            assert len(other) == len(base) == len(table.published)
            for mine, theirs in zip(base, other, strict=True):
                for key, value in values.items():
                    section, _, name = key.partition(".")
                    assert getattr(getattr(theirs, section), name) == value
                    theirs = replace(theirs, **{section: replace(getattr(theirs, section),
                                                                 **{name: getattr(getattr(mine, section), name)})})
                assert replace(theirs, overrides=mine.overrides) == mine  # (the row's own --set list names the value)
    assert declared == 7


def test_a_set_of_a_key_the_rows_vary_sets_it_in_every_row():
    """fidelity.py --set overrides a key in every row, one the rows vary too (where `simcluster run --set` of
    such a key picks the rows with that value: here it would leave Megatron-Core's 5 pipelined rows only)."""
    table = TABLES["megatron-core-2024"]
    rows = [v for _, v in table_scenario(table, ["model.micro_batch=2", "model.dropout=0.0"]).variants]
    assert len(rows) == len(table.published) == 9
    assert {v.model.micro_batch for v in rows} == {2} and {v.model.dropout for v in rows} == {0.0}
    assert [v.model.layers for v in rows] == [24, 30, 32, 48, 84, 92, 96, 96, 112]  # (the rest as the file has it)


def test_megatron_cores_32b_row_runs_a_ranks_batch_as_one_micro_batch():
    """Megatron-Core r0.8's 32B GPT on 384 H100s (TP 8, DP 48, 4 sequences a rank): 459.6 TFLOP/s a GPU, a
    0.89 s step. Each data-parallel group has one GPU a node, and a step's fp32 gradients (reduce-scattered)
    and bf16 weights (all-gathered) cross that GPU's one 400 Gb/s NIC: over 23 GB, 462 ms at line rate.
    Split into 4 micro-batches of 1 they hide under a quarter of the compute (the last backward, the first
    forward), and the published step would need its compute at 72 % of the peak: the micro-batch, which
    the table does not state, was larger. Predicted 28 % slow at micro-batch 1 and 6.5 % fast at 4 when
    this test was written."""
    table = TABLES["megatron-core-2024"]
    row = load(str(BENCHMARKS / table.file)).variants[3][1]
    assert (row.model.micro_batch, row.parallel.tp, row.parallel.pp, row.parallel.dp) == (4, 8, 1, 48)
    reports = {mb: run_scenario(replace(row, model=replace(row.model, micro_batch=mb)), trace=False).report
               for mb in (1, 4)}
    dp_bytes = sum(c["bytes_per_rank"] for c in reports[1]["communication"] if c["group"] == "dp")
    assert dp_bytes / reports[1]["steps"] > 23e9  # a step's data-parallel traffic a GPU, through one NIC
    error = {mb: figure(r, table.metric) / table.published[3] - 1 for mb, r in reports.items()}
    assert error[1] < -0.20 and abs(error[4]) <= 0.10


@pytest.mark.parametrize("name", ["torchtitan-2024", "torchtitan-2025"])
def test_torchtitans_tables_stay_within_the_goal(name):
    """torchtitan's December 2024 (Llama 3.1 8B, FSDP on 8 and 128 H100s, eager and compiled) and June 2025
    (8B on 64 and 70B on 256, FSDP x TP 8, plain and async TP) tables, every row within issue 40's goal: a
    mean |error| of 5 %, none over 10 %. Means 2.5 and 3.8 %, worst rows 5.2 and 6.9 % when this test was
    written; 4.9 and 2.5 %, 7.6 and 5.1 %, once kernels moved their tensors' own bytes (and the share was
    refitted); 19.2 and 17.5 % means before the H100's rates were those a run sustains."""
    table = TABLES[name]
    errors = [figure(run_scenario(v, trace=False).report, table.metric) / want - 1
              for (_, v), want in zip(load(str(BENCHMARKS / table.file)).variants, table.published, strict=True)]
    assert max(abs(e) for e in errors) <= 0.10 and sum(abs(e) for e in errors) / len(errors) <= 0.05


def test_torchtitans_peak_of_tensors_sits_under_the_reserved_peak_it_logged():
    """torchtitan logs the caching allocator's reserved peak (torch.cuda.memory_stats' reserved_bytes.all.peak:
    82.4, 77.0, 67.0 and 62.0 GiB), which holds the live tensors' peak that simcluster predicts and what the
    allocator keeps cached. So each prediction is at most that, and not far under it: 74.3, 74.3, 58.5 and
    58.5 GiB (0.87 to 0.96 of it) when this test was written."""
    table = TABLES["torchtitan-2024"]
    for (_, v), reserved in zip(load(str(BENCHMARKS / table.file)).variants, table.memory, strict=True):
        tensors = run_scenario(v, trace=False).report["memory"]["peak_bytes"] / 2**30
        assert 0.8 * reserved <= tensors <= reserved, (tensors, reserved)


def test_one_stack_on_an_a100_and_an_h100_speeds_up_as_published_within_10_percent():
    """LLM Foundry's 2023 MPT table: the same configurations (760M to 13B, FSDP on 8 GPUs) on A100s and on
    H100s, 1.95 to 2.29 times the tokens a second. What one stack does on either GPU cancels; what is left is the
    hardware, the H100's rates as a run sustains them (cluster.sustained_compute, fitted elsewhere): predicted
    within +0.4 to +13.8 % when this test was written (then 15 % was asked), -6.4 to +7.8 % once kernels moved
    their tensors' own bytes and its loss was flash-attn's fused one, and 19 to 35 % over with the benchmark
    rates alone."""
    table = TABLES["llm-foundry-2023"]
    variants = load(str(BENCHMARKS / table.file)).variants
    for a100, h100 in table.ratios:
        got = [figure(run_scenario(variants[i - 1][1], trace=False).report, table.metric) for i in (a100, h100)]
        assert [variants[i - 1][1].cluster.preset for i in (a100, h100)] == ["dgx-a100", "dgx-h100"]
        assert got[1] / got[0] == pytest.approx(table.published[h100 - 1] / table.published[a100 - 1], rel=0.10)


def test_the_gap_column_is_the_published_step_less_the_predicted_one(capsys):
    """fidelity.py's `gap ms`: Megatron-Core's 1.7B row published 408.8 TFLOP/s a GPU; its step, by
    Megatron's own FLOPs formula (72 B s l h^2 (1 + s/6h + V/12lh), 192 sequences on 48 GPUs), took 451.9 ms.
    The column is that step less the one predicted (a sign flipped, or the predicted step taken as the
    published one, prints something else)."""
    from fidelity import run_table

    table = TABLES["megatron-core-2024"]
    run_table("megatron-core-2024", table, "1", [])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("1 48"))
    gap_ms = float(line.split("%")[1].split()[0])
    published_s = 72 * 192 * 4096 * 24 * 2048**2 * (1 + 4096 / (6 * 2048) + 131072 / (12 * 24 * 2048)) / 48 / 408.8e12
    report = run_scenario(load(str(BENCHMARKS / table.file)).variants[0][1], trace=False).report
    assert gap_ms == pytest.approx(1e3 * published_s - report["step_time_ns"] / 1e6, abs=1.0)
    assert gap_ms > 0  # (the row is predicted fast: its published step is the longer)


def test_the_breakdown_under_a_row_is_its_busiest_ranks_compute_by_kind_and_exposed_communication(capsys):
    """fidelity.py --breakdown: under the 1.7B row, rank 0's step as GEMMs, fused attention and other kernels (which
    add up to its compute stream's busy time a step) and the communication left exposed (communication less what
    runs under compute)."""
    from fidelity import run_table

    table = TABLES["megatron-core-2024"]
    run_table("megatron-core-2024", table, "1", [], details=True)
    line = next(x for x in capsys.readouterr().out.splitlines() if "ms a step" in x)
    figures = [float(part.split()[-1]) for part in line.split(":", 1)[1].replace(";", ",").split(",")]
    gemm, attention, other, exposed, step = figures
    report = run_scenario(load(str(BENCHMARKS / table.file)).variants[0][1], trace=False).report
    busy = report["busy_ns"]["0"]["compute"] / report["steps"] / 1e6
    comm = report["communication_overlap"]["per_rank"]["0"]
    assert gemm + attention + other == pytest.approx(busy, abs=0.2) and gemm > attention > 0 and other > 0
    assert exposed == pytest.approx((comm["communication_ns"] - comm["hidden_ns"]) / report["steps"] / 1e6, abs=0.1)
    assert step == pytest.approx(report["step_time_ns"] / 1e6, abs=0.1)


def test_a_row_predicted_out_of_memory_is_named_after_the_tables_errors(capsys):
    """Every row of a table ran, so a row the model says would not fit its GPUs is a reading to look at again
    (Llama 3's rows did not fit while its gradients were read whole, where the paper's FSDP shards them)."""
    from fidelity import main

    main(["--table", "llama3-2024", "--rows", "2"])
    assert "out of memory" not in capsys.readouterr().out
    main(["--table", "llama3-2024", "--rows", "2", "--set", "parallel.zero=1"])
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  2 16384") and "GB OOM" in line for line in out)
    assert out[-1] == "row 2 predicted out of memory, where the publication ran it"
    assert out[-2].startswith("mean |error|")


def test_an_override_a_row_refuses_when_it_runs_ends_the_script_with_one_line():
    """An override that builds but that a row refuses when it runs (Llama 3's interleaved pipeline takes a micro-batch
    group of 16 to 32) ends fidelity.py with the reason, as one refused when the table is built does: no traceback."""
    from fidelity import main

    with pytest.raises(SystemExit) as refused:
        main(["--table", "llama3-2024", "--rows", "1", "--set", "parallel.microbatch_group=2"])
    assert str(refused.value) == ("fidelity.py: the interleaved schedule's micro-batch group N=2 must lie in "
                                  "[p, m] = [16, 32]")
    with pytest.raises(SystemExit) as unknown:
        main(["--table", "llama3-2024", "--set", "parallel.nosuch=2"])
    assert str(unknown.value).startswith("fidelity.py: unknown key 'parallel.nosuch'")
