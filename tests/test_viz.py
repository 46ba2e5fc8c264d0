"""The timeline is a faithful picture of the trace (hand-made traces, hand-written pictures)."""

from simcluster.engine.trace import Trace, TraceEvent
from simcluster.viz.report_view import plain
from simcluster.viz.timeline import Timeline


def test_timeline_of_a_hand_made_trace():
    events = [TraceEvent(0, "compute", "forward", "F0", 0, 40), TraceEvent(0, "compute", "backward", "B0", 60, 100),
              TraceEvent(0, "comm:dp", "all_reduce", "all_reduce", 40, 80, 16, "dp[0, 1]"),
              TraceEvent(1, "compute", "forward", "F0", 0, 20)]
    trace = Trace(events, [(0, "compute"), (0, "comm:dp"), (1, "compute")])
    assert Timeline(trace, width=20).plain() == (
        "r0 compute  FFFFFFFF....BBBBBBBB\n"
        "r0 comm:dp  ........ARAAAAAA....\n"
        "r1 compute  FFFF................\n"
        "            0 ns    50 ns 100 ns\n"
        "F forward  B backward  A all_reduce  . idle\n"
        "over a block wide enough, its label: AR all_reduce")


def test_the_legend_explains_every_label_drawn():
    events = [TraceEvent(0, "compute", "forward", "F3/matmul", 0, 40), TraceEvent(0, "compute", "backward", "B3/mm", 40, 80),
              TraceEvent(0, "compute", "optimizer", "O1/adam", 80, 120),
              TraceEvent(0, "comm:dp", "reduce_scatter", "B3", 40, 80, 16, "dp[0, 1]")]
    legend = Timeline(Trace(events, [(0, "compute"), (0, "comm:dp")]), width=30).plain().splitlines()[-1]
    assert legend == ("over a block wide enough, its label: F3 B3: the forward and backward passes of micro-batch 3; "
                      "O1: the optimizer of step 1; RS reduce_scatter")


def test_labels_are_written_where_a_pass_fits():
    events = [TraceEvent(0, "compute", "forward", "F12/matmul", 0, 50), TraceEvent(0, "compute", "forward",
                                                                                   "F12/gelu", 50, 100),
              TraceEvent(0, "compute", "backward", "B3/matmul", 100, 110)]
    trace = Trace(events, [(0, "compute")])
    # F12 spans 10 columns: labelled; B3 spans one: too narrow for its label
    assert Timeline(trace, width=11).plain().splitlines()[0] == "r0 compute  F12FFFFFFFB"


def test_rich_rendering_fits_the_console_width():
    events = [TraceEvent(0, "compute", "forward", "F0", 0, 1000)]
    text = plain(Timeline(Trace(events, [(0, "compute")]), width=200), width=50)
    assert max(len(line) for line in text.splitlines()) <= 50
    assert "FFFF" in text


def test_the_memory_chart_measures_the_peak_against_the_device():
    """100 B of activations held from 0 to 50 ns of a 100 ns run, in 4 columns of 25 ns (the column
    holding the release shows what it held before it)."""
    from simcluster.engine.trace import MemoryEvent
    from simcluster.viz.memory_chart import MemoryChart

    trace = Trace([TraceEvent(0, "compute", "forward", "F0", 0, 100)], [(0, "compute")])
    trace.memory = (MemoryEvent(0, 0, "activations", "x", 100), MemoryEvent(0, 50, "activations", "x", -100))
    roomy = MemoryChart(trace, width=4, capacity=1000)  # 10 %: bars scaled to the peak
    assert dict(roomy.rows())["total"] == "███ " and "10 % of the device's" in roomy.caption()
    tight = MemoryChart(trace, width=4, capacity=150)  # above half: a full bar is the device, 100/150 of 8 = 5
    assert dict(tight.rows())["total"] == "▅▅▅ " and tight.caption().endswith("(bars scaled to the capacity)")
    over = MemoryChart(trace, width=4, capacity=90)
    assert dict(over.rows())["total"] == "!!! " and "OUT OF MEMORY: 111 % of the device's" in over.caption()


def test_every_letter_of_a_failed_runs_timeline_is_explained():
    """The reproducer: a rank fails, its peers' all-gather never ends, and the lane reads "AGGG...". The
    "A" is the first letter of the block's label AG, which the label line explains; every other letter
    is a glyph the legend names."""
    import re

    from simcluster.config.scenario import load
    from simcluster.run.runner import run_scenario
    from simcluster.viz.timeline import GLYPHS, SHORT

    outcome = run_scenario(load(None, ["faults.failed_rank=1", "faults.failed_at_us=50", "run.numerics=meta"]))
    lines = Timeline(outcome.result.trace, width=80).plain().splitlines()
    legend, labels = lines[-2], lines[-1]
    lanes = [line[15:] for line in lines[:-3]]
    named = {g for g, _ in GLYPHS.values() if f"{g} " in legend}
    written = set(re.findall(r"(?:[FBWRO]\d+(?:\.\d+)?|" + "|".join(SHORT.values()) + ")", labels.split(":", 1)[1]))
    for lane in lanes:
        rest = lane
        for label in sorted(written, key=len, reverse=True):
            rest = rest.replace(label, "")
        assert set(rest) - {"."} <= named, (lane, named, written)
    assert any("AG" in lane for lane in lanes) and "AG all_gather" in labels
