"""The fidelity suite's tables (benchmarks/fidelity.py) that the model meets, kept met: the rows that
simulate in a second. Published figures, each from the source its table file names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from fidelity import TABLES, figure  # noqa: E402


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
    predicted 1.166 when this test was last changed (with its 500 W power limit and FlashAttention-2's rate)."""
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


def test_llama_3s_step_from_8192_to_16384_gpus_stays_within_2_percent():
    """Llama 3 405B (Dubey et al. 2024, Table 4): 430 TFLOP/s a GPU on 8,192 H100s (DP 64), 400 on 16,384 (DP
    128, half the micro-batches a rank: the pipeline's bubble and the data-parallel reduction's share grow):
    0.930. Predicted 0.939 when this test was written (the rows themselves 23-25 % fast, as the table says)."""
    table = TABLES["llama3-2024"]
    variants = load(str(BENCHMARKS / table.file)).variants
    small, large = (figure(run_scenario(variants[i][1], trace=False).report, table.metric) for i in (0, 1))
    assert large / small == pytest.approx(table.published[1] / table.published[0], rel=0.02)
