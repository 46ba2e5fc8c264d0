"""benchmarks/attention_rates.py, which measures the fused attention kernels' rates on a GPU beside the H100
preset's: its FLOP count, the preset's figures it prints, and that it runs (here on the CPU's kernels)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import attention_rates  # noqa: E402


def test_the_forward_counts_two_products_of_s_squared_d_a_head_and_half_of_them_when_causal():
    assert attention_rates.forward_flops(2, 3, 4, 8, causal=False) == 4 * 2 * 3 * 4 * 4 * 8
    assert attention_rates.forward_flops(2, 3, 4, 8, causal=True) == 2 * 2 * 3 * 4 * 4 * 8


def test_the_preset_runs_a_causal_kernels_blocks_at_its_non_causal_rate():
    """At 4,096 tokens a causal kernel runs 32 x 33 / 2 = 528 of the 1,024 blocks of 128 x 128: over half the
    square the preset's rate is 631.3 x 512 / 528 (cuDNN 9.1's, tritonbench), the backward 499/609 of it."""
    forward, backward = attention_rates.preset_rates(4096, causal=True)
    assert forward == pytest.approx(631.3 * 512 / 528, rel=1e-3)
    assert backward == pytest.approx(forward * 499 / 609, rel=1e-6)
    assert attention_rates.preset_rates(4096, causal=False)[0] == pytest.approx(631.3, rel=1e-3)


def test_it_runs_on_the_cpu_and_measures_each_kernel_causal_and_not(capsys):
    rows = attention_rates.main(["--device", "cpu", "--seqs", "128", "--repeats", "1"])
    assert {(label, causal) for label, _, causal, _, _ in rows} >= {("flash", False), ("flash", True)}
    assert all(fwd > 0 and bwd > 0 for *_, fwd, bwd in rows)
    assert "per block" in capsys.readouterr().out


def test_it_measures_dropout_inside_each_kernel_that_can_draw_it_against_the_same_kernel_without(capsys):
    """--dropout (Megatron-LM's 0.1 by default): each kernel's causal rates with the dropout over its rates without.
    On a CPU only torch's unfused kernels drop out (its flash kernel refuses), so those are the row; 0 measures none."""
    rows = attention_rates.main(["--device", "cpu", "--seqs", "128", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "with dropout 0.1 inside the kernel" in out
    measured = [line.split() for line in out.split("with dropout")[1].splitlines()[2:]]
    assert [(label, int(seq)) for label, seq, *_ in measured] == [("math", 128)]
    assert all(float(x) > 0 for *_, fwd, bwd in measured for x in (fwd, bwd))
    assert {label for label, *_ in rows} == {"flash"}  # (the rows without dropout: the CPU's fused kernel only)
    attention_rates.main(["--device", "cpu", "--seqs", "128", "--repeats", "1", "--dropout", "0"])
    assert "with dropout" not in capsys.readouterr().out
