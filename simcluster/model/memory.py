"""What a rank holds, by category, over time: the memory accounting hook of DESIGN.md ("Memory").

The model tells the ledger when it starts and stops holding a named buffer; the ledger keeps the
current total per category and the peak. Bytes are in the logical dtype (a partial's limbs are an
artifact of exact mode and are never charged).
"""

from __future__ import annotations

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "temporaries")
TIERS = ("gpu", "cpu", "nvme")  # where a rank keeps a buffer: device memory, its host's memory, its host's NVMe


def in_tier(category: str, tier: str) -> str:
    """The name a category has in a tier: itself on the device, "cpu:optimizer" in the host's memory."""
    if tier not in TIERS:
        raise ValueError(f"unknown memory tier {tier!r}; valid: {', '.join(TIERS)}")
    return category if tier == "gpu" else f"{tier}:{category}"


def tier_of(category: str) -> str:
    """Where a category's buffers are (the inverse of in_tier)."""
    return category.split(":", 1)[0] if ":" in category else "gpu"


class MemoryLedger:
    """Buffers held by (tiered) category; `peak_total` is the device's."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        self.current: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peaks: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.timeline: list[tuple[str, str, int, int]] = []  # (category, name, +/- bytes, device total after)

    def _key(self, category: str, tier: str = "gpu") -> str:
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; valid: {', '.join(CATEGORIES)}")
        key = in_tier(category, tier)
        if key not in self.held:
            self.held[key], self.current[key], self.peaks[key] = {}, 0, 0
        return key

    def _device(self) -> int:
        return sum(v for c, v in self.current.items() if tier_of(c) == "gpu")

    def hold(self, category: str, name: str, nbytes: int, tier: str = "gpu") -> None:
        key = self._key(category, tier)
        if name in self.held[key]:
            raise ValueError(f"{key} buffer {name!r} is already held")
        self.held[key][name] = int(nbytes)
        self.current[key] += int(nbytes)
        self.peaks[key] = max(self.peaks[key], self.current[key])
        total = self._device()
        self.peak_total = max(self.peak_total, total)
        self.timeline.append((key, name, int(nbytes), total))

    def release(self, category: str, name: str, tier: str = "gpu") -> None:
        key = self._key(category, tier)
        nbytes = self.held[key].pop(name)
        self.current[key] -= nbytes
        self.timeline.append((key, name, -nbytes, self._device()))

    def peak(self, category: str, tier: str = "gpu") -> int:
        return self.peaks[self._key(category, tier)]
