"""Hardware presets, network topology and the cost of kernels and collectives."""

from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import PRESETS, ClusterSpec, preset

__all__ = ["Cluster", "ClusterSpec", "PRESETS", "preset"]
