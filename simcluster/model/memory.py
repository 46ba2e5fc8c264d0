"""What a rank holds, by category, over time: the memory accounting hook of DESIGN.md ("Memory").

The model tells the ledger when it starts and stops holding a named buffer; the ledger keeps the
current total per category and the peak. Bytes are in the logical dtype (a partial's limbs are an
artifact of exact mode and are never charged).
"""

from __future__ import annotations

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "temporaries")


class MemoryLedger:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        self.current: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peaks: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.timeline: list[tuple[str, str, int, int]] = []  # (category, name, +/- bytes, total after)

    def _check(self, category: str) -> None:
        if category not in self.held:
            raise ValueError(f"unknown memory category {category!r}; valid: {', '.join(CATEGORIES)}")

    def hold(self, category: str, name: str, nbytes: int, tier: str = "gpu") -> None:
        self._check(category)
        if name in self.held[category]:
            raise ValueError(f"{category} buffer {name!r} is already held")
        self.held[category][name] = int(nbytes)
        self.current[category] += int(nbytes)
        self.peaks[category] = max(self.peaks[category], self.current[category])
        total = sum(self.current.values())
        self.peak_total = max(self.peak_total, total)
        self.timeline.append((category, name, int(nbytes), total))

    def release(self, category: str, name: str, tier: str = "gpu") -> None:
        self._check(category)
        nbytes = self.held[category].pop(name)
        self.current[category] -= nbytes
        self.timeline.append((category, name, -nbytes, sum(self.current.values())))

    def peak(self, category: str) -> int:
        self._check(category)
        return self.peaks[category]
