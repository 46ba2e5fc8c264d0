"""Does `simcluster plan` pick what Megatron-LM picked? (not a test)

For rows of Megatron-LM's Table 1 (benchmarks/megatron_table1.toml: Narayanan et al. 2021 chose
TP 8 inside a node and the fewest pipeline stages that fit), searches the layouts Megatron-LM then
had (no CP, no ZeRO, full recomputation, the row's own micro-batch size, 1F1B or interleaved; any TP
and PP) and
prints the plan's best simulated layout beside Megatron's own, simulated the same way: Megatron's
choice is recovered when it is the best or within 3 % of the best's step time. Ends with the
estimate's rate (layouts a minute, the whole space, one core).

    python benchmarks/plan_megatron.py [--rows 4-7] [--simulate 3] [--set cluster.profile=a100.toml]
"""

from __future__ import annotations

import argparse
import time

from simcluster.planner import search
from simcluster.runner import run_scenario
from table1 import arguments, table

MEGATRON_2021 = {"cp": (1,), "zero": (0,), "recompute": ("full",), "schedule": ("1f1b", "interleaved")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments(p, "4-10")
    p.add_argument("--simulate", type=int, default=3, help="layouts the plan simulates per row (default 3)")
    args = p.parse_args()
    sc, rows = table(args, __file__)
    print(f"{'row':>3} {'Megatron':<24} {'step s':>7} {'plan best':<24} {'step s':>7} {'Megatron/best':>13} "
          f"{'recovered':>9} {'wall s':>6}")
    for i in rows:
        _, v = sc.variants[i - 1]
        t = time.perf_counter()
        found = search(v, simulate=args.simulate, fixed=MEGATRON_2021 | {"micro_batch": (v.model["micro_batch"],)})
        ours = run_scenario(v, trace=False).report
        p_ = v.parallel
        mine = f"TP{p_['tp']} PP{p_['pp']} DP{p_['dp']}"
        best = found.rows[0]
        b = best.layout
        ratio = ours["step_time_ns"] / best.report["step_time_ns"]
        same = (b.tp, b.pp) == (p_["tp"], p_["pp"])
        print(f"{i:>3} {mine:<24} {ours['step_time_ns'] / 1e9:>7.2f} {b.label():<24} "
              f"{best.report['step_time_ns'] / 1e9:>7.2f} {ratio:>13.3f} {'yes' if same or ratio <= 1.03 else 'no':>9} "
              f"{time.perf_counter() - t:>6.0f}", flush=True)
    t = time.perf_counter()
    whole = search(sc.variants[-1][1], simulate=0)
    print(f"estimate: {whole.examined} layouts of row 10 in {time.perf_counter() - t:.1f} s "
          f"= {whole.per_minute:,.0f} a minute (one core)")


if __name__ == "__main__":
    main()
