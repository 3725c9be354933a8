"""Cluster simulation: replicas behind a router, prefill/decode disaggregation, the cost
of a plan (docs/design.md, "Clusters")."""

from sim.cluster.description import ClusterError, ClusterSpec, load_cluster, replicas
from sim.cluster.simulate_cluster import ClusterResult, simulate_cluster

__all__ = [
    "ClusterError",
    "ClusterResult",
    "ClusterSpec",
    "load_cluster",
    "replicas",
    "simulate_cluster",
]
