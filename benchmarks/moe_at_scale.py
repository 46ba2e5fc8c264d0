"""The cost of simulating mixtures of experts at scale, and what the simulation predicts (not a test).

Each row simulates one training step in meta mode in a fresh process and prints its wall time, peak
memory (the process's maximum resident set, interpreter and imports included), the ranks it ran of
the world, and the predicted step time, MFU and peak memory of the largest rank:
- DeepSeek-V3 as trained (scenarios/deepseek_v3.toml --at-scale: 61 layers, 256 experts top-8,
  PP 16 x EP 64 x ZeRO-1 with DualPipe on 2,048 GPUs, 15,360 sequences a step): evenly routed, the
  64 ep peers of a stage fold onto one (engine/fold.py), so 16 ranks run. Goal: <= 60 s, <= 4 GB.
- Mixtral 8x7B (scenarios/moe.toml --at-scale: PP 8 x DP 8 x EP 8 on 64 H100s), evenly routed
  (folded to one ep peer a group) and Zipf-skewed (model.moe_skew = 1: the ep peers differ, and only
  whole ep groups fold).

    python benchmarks/moe_at_scale.py [--quick]    (--quick: the Mixtral rows only)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time
from simcluster.config.scenario import load
from simcluster.run.runner import run_scenario
name, overrides = sys.argv[1], sys.argv[2:]
t = time.perf_counter()
o = run_scenario(load(name, overrides, at_scale=True), trace=False)
s = time.perf_counter() - t
r = o.report
print(json.dumps({"seconds": s, "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "world": r["world_size"], "simulated": len(o.result.fold.ranks) if o.result.fold else r["world_size"],
                  "step_s": r["step_time_ns"] / 1e9, "mfu": r["mfu"],
                  "peak_gb": max(v["total"] for v in r["memory_peak_bytes"].values()) / 1e9}))
"""

ROWS = [
    ("DeepSeek-V3, 2,048 GPUs, evenly routed", "deepseek_v3", []),
    ("Mixtral 8x7B, 64 GPUs, evenly routed", "moe", []),
    ("Mixtral 8x7B, 64 GPUs, Zipf-skewed", "moe", ["model.moe_skew=1"]),
]


def measure(name: str, overrides: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, *overrides], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} {' '.join(overrides)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the Mixtral rows only")
    args = p.parse_args()
    print(f"{'run':<42} {'GPUs':>5} {'simulated':>9} {'seconds':>8} {'GB':>6} {'step s':>8} {'MFU %':>6} "
          f"{'peak GB':>8}")
    for label, name, overrides in ROWS[1:] if args.quick else ROWS:
        m = measure(name, overrides)
        print(f"{label:<42} {m['world']:>5} {m['simulated']:>9} {m['seconds']:>8.1f} {m['rss_kb'] / 2**20:>6.2f} "
              f"{m['step_s']:>8.2f} {100 * m['mfu']:>6.1f} {m['peak_gb']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
