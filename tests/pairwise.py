"""All-pairs covering arrays: a few rows in which every pair of option values that some valid row can
hold appears at least once, built greedily from a seeded pool (the same rows on every run)."""

import heapq
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

    candidates = [draw() for _ in range(5 * pool)]
    covers = [pairs(row) for row in candidates]
    feasible = set().union(*covers)
    # pairs no random valid row holds may still be feasible: look for each with its two values fixed
    for (a, b) in itertools.combinations(names, 2):
        for va, vb in itertools.product(options[a], options[b]):
            if ((a, va), (b, vb)) in feasible:
                continue
            for _ in range(200):
                row = {n: rng.choice(options[n]) for n in names} | {a: va, b: vb}
                if valid(row):
                    candidates.append(row)
                    covers.append(pairs(row))
                    feasible |= covers[-1]
                    break
    # greedy: each time the row that covers the most pairs still uncovered (the first such), found lazily: a row's
    # count only falls as pairs are covered, so one whose fresh count still leads every other's older one leads
    uncovered, rows = set(feasible), []
    heap = [(-len(got), i) for i, got in enumerate(covers)]
    heapq.heapify(heap)
    while uncovered:
        _, i = heapq.heappop(heap)
        fresh = (-len(covers[i] & uncovered), i)
        if heap and fresh > heap[0]:
            heapq.heappush(heap, fresh)
            continue
        rows.append(candidates[i])
        uncovered -= covers[i]
    return rows, feasible
