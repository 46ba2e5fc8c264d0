"""What one kernel costs on a preset, for the tests of what scales the compute-bound rates (a power
limit, the share a run sustains)."""

from simcluster.topology.cluster import Cluster

A_GEMM = (1, 2048, 33 * 128, 4096)  # whole waves of 132 SMs: compute-bound, no quantisation


def busy_ns(spec, work, nbytes=0.0, name=""):
    """A kernel's time without its launch gap."""
    return Cluster(spec).kernel_ns(work, nbytes, "bf16", name) - spec.kernel_overhead_ns
