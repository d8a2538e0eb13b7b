"""The cluster tier: saria objects in Mooncake Store, shared across hosts (docs/cluster.md)."""

from saria.dataplane.cluster.errors import (ClusterClosed, ClusterError, ClusterMiss, ClusterOff, ClusterTimeout,
                                            ClusterWriteError, ObjectAbsent, ObjectCorrupt, ObjectUnauthentic,
                                            ObjectUnknownEpoch)
from saria.dataplane.cluster.layout import Layout, identity_digest
from saria.dataplane.cluster.store import ClusterStore

__all__ = ["ClusterClosed", "ClusterError", "ClusterMiss", "ClusterOff", "ClusterStore", "ClusterTimeout",
           "ClusterWriteError", "Layout", "ObjectAbsent", "ObjectCorrupt", "ObjectUnauthentic", "ObjectUnknownEpoch",
           "identity_digest"]
