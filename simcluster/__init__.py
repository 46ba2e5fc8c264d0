"""simcluster: a deterministic emulator of a GPU training cluster.

What a notebook needs, imported when first used (so that `import simcluster.numerics` loads nothing
more than it asks for):

    import simcluster
    sc = simcluster.load("zero_memory", ["parallel.zero=1"])  # a library name or a file, and --set's
    outcome = simcluster.run_scenario(sc)  # .report (a dict, as --json prints it), .result, .scenario
    simcluster.testing.assert_bit_exact(...)  # the testing API: your own program against one device
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Outcome", "Scenario", "ScenarioError", "load", "run_all", "run_scenario", "testing"]



def __getattr__(name: str) -> Any:
    if name in ("load", "Scenario", "ScenarioError"):
        from simcluster.config import scenario as module
    elif name in ("run_scenario", "run_all", "Outcome"):
        from simcluster.run import runner as module
    elif name == "testing":
        import simcluster.testing as module

        return module
    else:
        raise AttributeError(f"module 'simcluster' has no attribute {name!r}")
    return getattr(module, name)
