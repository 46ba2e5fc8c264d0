"""The long fuzz run (issue 14): N generated command lines (tests/fuzzing.py), each run in this process
with a time limit; prints what the tool did with them and every problem found (a traceback, an unknown
exit status, a refusal over one line, a run that does not finish). A case over the limit is run again
with a longer one (--slow-limit-s): one that then finishes is listed as slow, not as a problem (a plan at
scale legitimately takes a minute; the budget refuses up front only what cannot finish in a day).

    python benchmarks/fuzz.py [--cases 10000] [--seed 0] [--limit-s 20] [--slow-limit-s 600]

Deterministic: the same seed draws the same cases. Exit status 1 if any problem was found.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzzing import attempt, generate  # noqa: E402


def short(argv: list[str]) -> str:
    """The command line as a list, each argument cut to 100 characters."""
    return repr([a if len(a) <= 100 else a[:60] + f"...({len(a)} chars)" for a in argv])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-s", type=int, default=20, help="seconds a case may take (default 20)")
    p.add_argument("--slow-limit-s", type=int, default=600,
                   help="seconds a case over --limit-s may take when run again before it is a problem (default 600)")
    args = p.parse_args()
    statuses: collections.Counter[str] = collections.Counter()
    problems, slow = [], []
    began = time.monotonic()  # (progress only: nothing printed depends on it but the elapsed column)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.cases):
            folder = Path(tmp) / f"case{i}"
            folder.mkdir()
            case = generate(random.Random(args.seed * 1_000_003 + i), folder)
            outcome = attempt(case, args.limit_s)
            if outcome.status is None and outcome.problem.startswith("did not finish"):
                start = time.monotonic()
                outcome = attempt(case, args.slow_limit_s)
                if not outcome.problem:
                    slow.append((i, time.monotonic() - start, case.argv))
                    print(f"case {i}: finished in {slow[-1][1]:.0f} s: {short(case.argv)}", file=sys.stderr, flush=True)
            statuses[str(outcome.status) if outcome.status is not None else "none"] += 1
            if outcome.problem:
                problems.append((i, outcome.problem, case.argv, case.note))
                print(f"case {i}: {outcome.problem}: {short(case.argv)}", file=sys.stderr, flush=True)
            if (i + 1) % 250 == 0:
                print(f"{i + 1:>6} cases, {len(problems)} problems, {time.monotonic() - began:.0f} s",
                      file=sys.stderr, flush=True)
    print(f"| cases | exit 0 | exit 1 | exit 2 | exit 3 | exit 4 | over {args.limit_s} s, finished | problems |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.cases} | " + " | ".join(str(statuses.get(k, 0)) for k in "01234") + f" | {len(slow)} | "
          f"{len(problems)} |")
    for i, seconds, argv in slow:
        print(f"\ncase {i}: finished in {seconds:.0f} s (over {args.limit_s} s)\n  argv: {short(argv)}")
    for i, problem, argv, note in problems[:50]:
        print(f"\ncase {i}: {problem}\n  argv: {short(argv)}" + (f"\n  file:\n{note[:2000]}" if note else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
