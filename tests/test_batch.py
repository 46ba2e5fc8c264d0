"""Time to a target loss against batch size (simcluster/report/critical_batch.py, McCandlish et al. 2018), and the
critical_batch scenario's curve of wall time against GPUs."""

import pytest

from simcluster.cli import main
from simcluster.config.scenario import ScenarioError, build, load
from simcluster.report import critical_batch as batch
from simcluster.run.runner import run_all, run_scenario


@pytest.mark.parametrize("b", [1e3, 2.5e6, 7e7])
def test_steps_and_examples_lie_on_the_papers_hyperbola(b):
    """(S/S_min - 1)(E/E_min - 1) = 1, E = B S, and at B = B_noise twice the fewest of each."""
    b_noise, e_min = 2.5e6, 26e9
    s_min = e_min / b_noise
    s, e = batch.steps(b, b_noise, s_min), batch.examples(b, b_noise, e_min)
    assert (s / s_min - 1) * (e / e_min - 1) == pytest.approx(1.0, rel=1e-12)
    assert e == pytest.approx(b * s, rel=1e-12)
    assert batch.steps(b_noise, b_noise, s_min) == pytest.approx(2 * s_min)
    assert batch.examples(b_noise, b_noise, e_min) == pytest.approx(2 * e_min)


def test_doubling_the_batch_halves_the_steps_only_below_the_noise_scale():
    b_noise, s_min = 1e6, 1e4
    small, large = b_noise / 1000, b_noise * 1000
    assert batch.steps(small, b_noise, s_min) / batch.steps(2 * small, b_noise, s_min) > 1.99
    assert batch.steps(large, b_noise, s_min) / batch.steps(2 * large, b_noise, s_min) < 1.001


def test_the_critical_batch_scenario_shows_where_gpus_stop_paying():
    outcome = run_all(load("critical_batch"))
    rows = [o.report for _, o in outcome.variants]
    for r in rows:
        t = r["target"]
        assert t["batch_tokens"] == r["scenario"]["model"]["global_batch"] * r["scenario"]["model"]["seq"]
        assert t["wall_s"] == pytest.approx(t["steps"] * r["step_time_ns"] * 1e-9)
        assert t["gpu_hours"] == pytest.approx(t["wall_s"] * r["world_size"] / 3600)
        assert t["steps"] == pytest.approx(t["s_min"] * (1 + t["b_noise_tokens"] / t["batch_tokens"]))
    gains = [a["target"]["wall_s"] / b["target"]["wall_s"] for a, b in zip(rows, rows[1:])]
    assert gains[0] > 1.8 and gains[-1] < 1.3  # each doubling of the GPUs buys less
    assert all(x > y for x, y in zip(gains, gains[1:]))
    hours = [r["target"]["gpu_hours"] for r in rows]
    past = [h for r, h in zip(rows, hours) if r["target"]["batch_tokens"] > r["target"]["b_noise_tokens"]]
    assert past and all(x < y for x, y in zip(past, past[1:]))  # past B_noise, more GPUs cost more hours


def test_the_curve_is_drawn_under_the_comparison(capsys):
    assert main(["run", "critical_batch"]) == 0
    out = capsys.readouterr().out
    assert "wall time to the target loss" in out and "for 2x GPUs" in out


def test_a_target_needs_both_figures():
    with pytest.raises(ScenarioError, match="needs both"):
        run_scenario(build({}, ["run.numerics=meta", "target.b_noise_tokens=1e6"]))
