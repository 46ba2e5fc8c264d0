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
        "r0 comm:dp  ........AAAAAAAA....\n"
        "r1 compute  FFFF................\n"
        "            0 ns    50 ns 100 ns\n"
        "F forward  B backward  A all_reduce  . idle")


def test_rich_rendering_fits_the_console_width():
    events = [TraceEvent(0, "compute", "forward", "F0", 0, 1000)]
    text = plain(Timeline(Trace(events, [(0, "compute")]), width=200), width=50)
    assert max(len(line) for line in text.splitlines()) <= 50
    assert "FFFF" in text
