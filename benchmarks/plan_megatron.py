"""Does `simcluster plan` pick what Megatron-LM picked? (not a test)

For rows of Megatron-LM's Table 1 (benchmarks/megatron_table1.toml: Narayanan et al. 2021 chose
TP 8 inside a node and the fewest pipeline stages that fit), searches the layouts Megatron-LM then
had (no CP, no ZeRO, no sequence parallelism, full recomputation, the row's own micro-batch size,
1F1B or interleaved; any TP and PP), each with the data parallelism it then ran: PyTorch's DDP
(overlapped) without a pipeline, its own local DDP (one all-reduce after the backward pass) with one
-- its pipelined schedules had no `no_sync`, so PyTorch's DDP would have all-reduced every
micro-batch, and the authors' script (examples/sc21/run_table_1.sh) sets DDP=local on every row with
PP > 1 -- and
prints the plan's best simulated layout beside Megatron's own, simulated the same way: Megatron's
choice is recovered when it is the best or within 3 % of the best's step time. Ends with the
estimate's rate (layouts a minute, the whole space, one core).

    python benchmarks/plan_megatron.py [--rows 4-7] [--simulate 3] [--set cluster.profile=a100.toml]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from simcluster.analysis.planner import search
from simcluster.run.runner import run_scenario
from table1 import arguments, table

MEGATRON_2021 = {"cp": (1,), "zero": (0,), "sp": (0,), "recompute": ("full",), "schedule": ("1f1b", "interleaved")}


def megatron_2021(v, simulate: int, **only: tuple):
    """The best of the layouts Megatron-LM had in 2021 (the module's docstring), with their DDP; `only`:
    fields fixed further (tp=(8,), pp=(2,))."""
    fixed = MEGATRON_2021 | {"micro_batch": (v.model.micro_batch,)} | only
    found = []
    for pipelined in (False, True):
        w = replace(v, parallel=replace(v.parallel, overlap_grad_reduce=not pipelined))
        pp = tuple(p for p in only.get("pp", range(1, v.model.layers + 1)) if (p > 1) == pipelined)
        if pp:
            found += search(w, simulate=simulate, fixed=fixed | {"pp": pp}).rows
    return min(found, key=lambda r: (not r.report["memory"]["fits"], r.report["step_time_ns"], r.layout.label()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments(p, "4-10")
    p.add_argument("--simulate", type=int, default=3, help="layouts the plan simulates per row (default 3)")
    args = p.parse_args()
    sc, rows = table(args, __file__)
    print(f"{'row':>3} {'Megatron':<20} {'step s':>7} {'plan best':<36} {'step s':>7} {'Megatron/best':>13} "
          f"{'its TP/PP at best/best':>22} {'recovered':>9} {'wall s':>6}")
    for i in rows:
        _, v = sc.variants[i - 1]
        t = time.perf_counter()
        best = megatron_2021(v, args.simulate)
        p_ = v.parallel
        same = megatron_2021(v, args.simulate, tp=(p_["tp"],), pp=(p_["pp"],))  # its TP/PP, the best schedule
        ours = run_scenario(v, trace=False).report
        mine = f"TP{p_['tp']} PP{p_['pp']} DP{p_['dp']}"
        b, top = best.layout, best.report["step_time_ns"]
        ratio, tp_pp = ours["step_time_ns"] / top, same.report["step_time_ns"] / top
        print(f"{i:>3} {mine:<20} {ours['step_time_ns'] / 1e9:>7.2f} {b.label():<36} {top / 1e9:>7.2f} "
              f"{ratio:>13.3f} {tp_pp:>22.3f} {'yes' if tp_pp <= 1.03 else 'no':>9} "
              f"{time.perf_counter() - t:>6.0f}", flush=True)
    t = time.perf_counter()
    whole = search(sc.variants[-1][1], simulate=0)
    print(f"estimate: {whole.examined} layouts of row 10 in {time.perf_counter() - t:.1f} s "
          f"= {whole.per_minute:,.0f} a minute (one core)")


if __name__ == "__main__":
    main()
