"""Errors a simulated run reports instead of hanging or silently going wrong."""

from __future__ import annotations


class SimulationError(RuntimeError):
    """The ranks' programs do not fit together (a real cluster would hang or corrupt data)."""


class CollectiveMismatchError(SimulationError):
    """Ranks issued different operations as the same call on one group (or one send/recv channel)."""


class DeadlockError(SimulationError):
    """No rank can proceed: every unfinished rank waits for a rank that will never answer."""


class FoldError(SimulationError):
    """A folded run (engine/fold.py) is not symmetric under its fold: it must run unfolded."""
