"""All-pairs covering arrays: a few rows in which every pair of option values that some valid row can
hold appears at least once, built greedily from a seeded pool (the same rows on every run)."""

import itertools
import random


def covering_rows(options, valid, *, seed=0, pool=400):
    """Rows (dicts) over `options` (name -> values) that satisfy `valid(row)`, together covering every
    feasible pair of (name, value) choices."""
    rng = random.Random(seed)
    names = list(options)

    def pairs(row):
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    def draw():
        while True:
            row = {n: rng.choice(options[n]) for n in names}
            if valid(row):
                return row

    feasible = set()
    candidates = [draw() for _ in range(5 * pool)]
    for row in candidates:
        feasible |= pairs(row)
    # pairs no random valid row holds may still be feasible: look for each with its two values fixed
    for (a, b) in itertools.combinations(names, 2):
        for va, vb in itertools.product(options[a], options[b]):
            if ((a, va), (b, vb)) in feasible:
                continue
            for _ in range(200):
                row = {n: rng.choice(options[n]) for n in names} | {a: va, b: vb}
                if valid(row):
                    candidates.append(row)
                    feasible |= pairs(row)
                    break
    uncovered, rows = set(feasible), []
    covers = [(row, pairs(row)) for row in candidates]
    while uncovered:
        row, got = max(covers, key=lambda c: len(c[1] & uncovered))
        rows.append(row)
        uncovered -= got
    return rows, feasible
