"""Launch: Ray, placement groups and actor groups from ``spec.layout`` (see cluster.py)."""

from rlhf.launch.cluster import Cluster, init_ray, start_cluster
from rlhf.launch.group import ActorGroup

__all__ = ["ActorGroup", "Cluster", "init_ray", "start_cluster"]
