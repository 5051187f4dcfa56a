"""Scale-out: routed experts sharded over cluster workers (Ray actors), output unchanged.

* :mod:`runtime.cluster.placement`: which worker owns which expert (weighted rendezvous);
* :mod:`runtime.cluster.worker`: one worker's share in its own expert store, and its compute;
* :mod:`runtime.cluster.source`: the coordinator's expert source (requests out, replies in,
  fallback to its own reads when a worker fails);
* :mod:`runtime.cluster.ray_backend`: the workers as Ray actors (imports Ray; optional extra).

Shape legend: key = (layer, expert).
"""

from runtime.cluster.placement import assign, shares, worker_weights
from runtime.cluster.source import ClusterExperts, WorkerFailed, WorkerLink

__all__ = ["ClusterExperts", "WorkerFailed", "WorkerLink", "assign", "shares", "worker_weights"]
