"""The fuzzer (tests/fuzzing.py) in the default suite: generated command lines never end in a traceback,
an unknown exit status, a refusal over one line or a hang. The long run is benchmarks/fuzz.py."""

import os
import random

from hypothesis import given, settings
from hypothesis import strategies as st

import simcluster.cli
from fuzzing import Case, attempt, generate


@settings(max_examples=150)  # (the long run: benchmarks/fuzz.py)
@given(st.randoms(use_true_random=False))
def test_generated_command_lines_never_crash_or_hang(tmp_path_factory, rnd):
    folder = tmp_path_factory.mktemp("fuzz")
    case = generate(rnd, folder)
    here = sorted(os.listdir("."))
    outcome = attempt(case, limit_s=60)
    assert not outcome.problem, (outcome.problem, case.argv, case.note)
    assert sorted(os.listdir(".")) == here  # (it wrote nothing where the suite runs)


def test_the_fuzzer_sees_a_traceback_a_bad_status_and_a_hang(monkeypatch, tmp_path):
    """The detector itself: an exception out of main, an exit status the tool never uses, a refusal in
    two lines, a run over its limit."""
    case = generate(random.Random(0), tmp_path)

    def boom(argv):
        raise KeyError("x")
    monkeypatch.setattr(simcluster.cli, "_main", boom)
    assert attempt(Case(case.argv, "", tmp_path), 5).problem.startswith("traceback: KeyError")
    monkeypatch.setattr(simcluster.cli, "_main", lambda argv: 7)
    assert attempt(case, 5).problem == "exit status 7"

    def two_lines(argv):
        print("error: one\nerror: two", file=__import__("sys").stderr)
        return 2
    monkeypatch.setattr(simcluster.cli, "_main", two_lines)
    assert "2 error lines" in attempt(case, 5).problem

    def forever(argv):
        while True:
            pass
    monkeypatch.setattr(simcluster.cli, "_main", forever)
    assert attempt(case, 1).problem == "did not finish in 1 s"

    def swallowed(argv):  # a hang whose interruption the tool reports as an error (the emulator reports a
        try:  # rank's exception as that rank's, exit 2): still a run over its limit
            while True:
                pass
        except BaseException:  # noqa: BLE001
            print("error: rank 3: interrupted", file=__import__("sys").stderr)
            return 2
    monkeypatch.setattr(simcluster.cli, "_main", swallowed)
    assert attempt(case, 1).problem == "did not finish in 1 s"
