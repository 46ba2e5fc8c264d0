import os

import pytest
from hypothesis import HealthCheck, settings

# Derandomized everywhere: the same examples on every run, so a failure is never a lucky draw.
# "thorough" draws ten times as many (HYPOTHESIS_PROFILE=thorough) for long runs. "explore" is for hunting
# bugs: other examples for each `--hypothesis-seed=N` (the same ones again for the same N), none saved.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=250, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=100, deadline=None, derandomize=False, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.txt from the current output (review the diff before committing)")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, saying why, where CUDA is absent (each feature they touch has a CPU test too)."""
    import importlib.util

    import pytest

    if not any("gpu" in item.keywords for item in items):
        return
    cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (a `gpu` test; its CPU twin runs on gloo)"))


@pytest.fixture
def simulated(monkeypatch):
    """The training configurations (steps, micro-batches) of every simulation the runner starts, in order."""
    from simcluster.run import runner

    seen = []
    real = runner.simulate

    def counting(program, parallelism, **kwargs):
        seen.append(parallelism.data)
        return real(program, parallelism, **kwargs)
    monkeypatch.setattr(runner, "simulate", counting)
    return seen
