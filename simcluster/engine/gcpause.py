"""Pause Python's cyclic garbage collector while a pass builds its large, acyclic structures.

Both passes allocate hundreds of thousands of small tuples that live until the run ends; the
collector would walk all of them again and again (its cost grows with the heap), which more than
halves throughput on big runs. Reference counting still frees everything it can; the collector
runs again as soon as the pause ends. Pauses nest: `simulate` pauses over both passes, so the
collector walks their objects once, not once per pass.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
