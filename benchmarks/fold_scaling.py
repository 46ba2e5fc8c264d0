"""The simulator's own cost against the world size, folded and unfolded (not a test).

Each row simulates one training step in meta mode in a fresh process and prints its wall time and
peak memory (the process's maximum resident set, interpreter and imports included). Two series:
- a 7.5B GPT (32 layers, hidden 4096, sequence 2048) on TP 2 x PP 4 x DP d, 8 micro-batches per
  replica, d = 1 .. 16: unfolded (every rank runs) against folded (one replica and one tp rank of
  each group run, engine/fold.py); the growth exponent is the slope of log(seconds) on log(ranks);
- Llama 3 405B on TP 8 x PP 16 x DP d as the paper ran it (d = 64: 8,192 H100s, 32 sequences per
  replica; d = 128: 16,384 H100s, 16 per replica; Dubey et al. 2024, Table 4), folded;
- the same at d = 64 with more micro-batches a step (m = 128 .. 4,096 per replica), whose pipeline
  rounds are simulated twice (simcluster/run/pipeline_steady.py), and m = 128 with every micro-batch
  simulated, for comparison.
The Llama's gradients are taken whole until one reduce-scatter a step (ZeRO-1), for its rounds to repeat: the
scenario's ZeRO-2 (the paper's FSDP shards them) reduce-scatters every micro-batch's, which fall further behind
each round, and are all simulated.
Folded and unfolded runs, and rounds simulated twice or all, give the same report (tests/test_fold.py,
tests/test_pipeline_steady.py); only the cost differs.

    python benchmarks/fold_scaling.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

CHILD = """
import json, resource, sys, time
from simcluster.config.scenario import load
from simcluster.run import runner
from simcluster.run.runner import run_all
name, fold, rounds, overrides = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4:]
if not rounds:
    runner._rounds = lambda sc, faults: None  # (every micro-batch simulated)
t = time.perf_counter()
sc = load(name, overrides, at_scale=True)
o = run_all(sc.variants[0][1] if sc.variants else sc, fold=fold)
s = time.perf_counter() - t
print(json.dumps({"seconds": s, "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "world": o.report["world_size"], "simulated": len(o.result.fold.ranks) if o.result.fold else
                  o.report["world_size"], "step_ms": o.report["step_time_ns"] / 1e6}))
"""


def measure(name: str, fold: bool, overrides: list[str], rounds: bool = True) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, "1" if fold else "0", "1" if rounds else "0", *overrides],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} {' '.join(overrides)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def gpt(dp: int) -> list[str]:
    return ["parallel.tp=2", "parallel.pp=4", f"parallel.dp={dp}", "parallel.zero=1", "parallel.schedule=1f1b",
            "parallel.virtual_stages=1", f"model.global_batch={8 * dp}", "model.micro_batch=1",
            "cluster.gpus_per_node=8", f"cluster.nodes={dp}"]


def llama(dp: int, per_replica: int) -> list[str]:
    return [f"parallel.dp={dp}", f"cluster.nodes={16 * dp}", f"model.global_batch={per_replica * dp}", "parallel.zero=1"]


def row(label: str, m: dict) -> None:
    print(f"{label:<50} {m['world']:>6} {m['simulated']:>9} {m['seconds']:>8.1f} {m['rss_kb'] / 2**20:>8.2f} "
          f"{m['step_ms']:>10.1f}")


def slope(points: list[tuple[int, float]]) -> float:
    xs, ys = [math.log(w) for w, _ in points], [math.log(s) for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the GPT series only, up to DP 4")
    args = p.parse_args()
    print(f"{'run':<50} {'GPUs':>6} {'simulated':>9} {'seconds':>8} {'GB':>8} {'step ms':>10}")
    degrees = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16]
    series: dict[bool, list[tuple[int, float]]] = {False: [], True: []}
    for fold in (False, True):
        for dp in degrees:
            m = measure("megatron_3d", fold, gpt(dp))
            row(f"GPT 7.5B TP2 x PP4 x DP{dp}, {'folded' if fold else 'unfolded'}", m)
            series[fold].append((m["world"], m["seconds"]))
    for fold in (False, True):
        print(f"growth exponent ({'folded' if fold else 'unfolded'}): seconds ~ ranks^{slope(series[fold]):.2f}")
    if not args.quick:
        for dp, per in ((64, 32), (128, 16)):
            m = measure("llama3_4d", True, llama(dp, per))
            row(f"Llama 3 405B TP8 x PP16 x DP{dp}, {per} seq/replica", m)
        for per, rounds in ((128, False), (128, True), (512, True), (4096, True)):
            m = measure("llama3_4d", True, llama(64, per), rounds)
            row(f"Llama 3 405B DP64, {per} seq/replica, " + ("rounds twice" if rounds else "every one"), m)


if __name__ == "__main__":
    main()
