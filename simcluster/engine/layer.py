"""One transformer layer's cost, to hold beside a profiler's trace of one layer (issue 40).

Read off rank 0's recorded streams before the replay (so a run with its events kept and one without,
folded or not, give the same figures): the first layer its first forward pass runs (a pass labelled
`F<micro-batch>[.<chunk>]:block<i>`), and of that micro-batch and layer the backward pass
(`B...:block<i>`) and the recomputation (`R<i>`). Each pass's kernels until one of its kind under
another label (`ENDS`: a later run is another layer's, step's or micro-batch's; a pass run beside it,
DualPipe's pipeline.together, puts kernels of the other kind between its own), as the time its kernels
take back to back at the cluster's rates
(launches included; no waits, no communication: those belong to the step, not to the layer's
kernels), and how many kernels it launches. A zero-bubble schedule's weight-gradient pass (`W...`)
covers a stage's layers together: it is not split by layer.
"""

from __future__ import annotations

import re
from typing import Any

from simcluster.engine.streams import KERNEL, KERNELS
from simcluster.topology.cluster import Cluster

FORWARD = re.compile(r"F([0-9.]+):block([0-9]+)$")
# a pass's run of kernels ends at a kernel of these kinds under another label (a recomputation, labelled by
# its layer alone, runs inside a backward pass: another backward's kernel ends it too)
ENDS = {"forward": ("forward",), "backward": ("backward",), "recompute": ("recompute", "backward")}


def layer_cost(streams: Any, cluster: Cluster, dtype: str) -> dict[str, Any] | None:
    """{"layer", "forward_ns", "backward_ns", "recompute_ns", "kernels": {pass: count}} of rank 0's first
    layer (`streams`: its streams by name), or None where it runs no transformer layer."""
    passes = [(label, kind, run) for stream in streams.values() for label, kind, run in _runs(stream.items)]
    first = next((m for label, kind, _ in passes if kind == "forward" and (m := FORWARD.match(label))), None)
    if first is None:
        return None
    micro, block = first.groups()
    wanted = {f"F{micro}:block{block}": "forward", f"B{micro}:block{block}": "backward", f"R{block}": "recompute"}
    ns = {"forward": 0, "backward": 0, "recompute": 0}
    kernels = dict.fromkeys(ns, 0)
    started: set[str] = set()
    done: set[str] = set()  # (passes whose first run of kernels has ended)
    for label, kind, run in passes:
        what = wanted.get(label)
        if what != kind:
            done |= {w for w in started if kind in ENDS[w]}
        if what is None or what in done or kind != what:
            continue
        started.add(what)
        for name, flops, nbytes in run:
            ns[what] += cluster.kernel_ns(flops, nbytes, dtype, name)
            kernels[what] += 1
    return {"layer": f"block{block}", "forward_ns": ns["forward"], "backward_ns": ns["backward"],
            "recompute_ns": ns["recompute"], "kernels": kernels}


def _runs(items: list[tuple]) -> Any:
    """(label, kind, ((name, flops, bytes), ...)) of each kernel item, in stream order."""
    for item in items:
        if item[0] == KERNEL:
            yield item[1].rpartition("/")[0], item[2], ((item[1], item[3], item[4]),)
        elif item[0] == KERNELS:
            yield item[1], item[2], item[3]
