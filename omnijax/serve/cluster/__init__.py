"""`omnijax serve --replicas N`: N engines as one Ray Serve deployment behind Ray Serve's HTTP/WebSocket proxy.

- `omnijax.serve.cluster.launch` starts (or joins) the Ray cluster, deploys the replicas, prints the address and on
  SIGTERM drains every replica before it shuts the deployment down. It imports Ray only inside its functions (the
  `omnijax[ray]` extra), so the single-process server never needs it.
- `omnijax.serve.cluster.replica.EngineReplica` is one replica: one engine (`ServeContext`) and the same Starlette
  routes as the single-process server, plus `GET /v1/omnijax/replica` and `POST /v1/omnijax/drain`; it reports its
  admission headroom, whether it drains and the resume tokens it holds as Ray Serve routing stats.
- `omnijax.serve.cluster.sessions.ReplicaSessions` tracks a replica's WebSocket connections so a drain can end each
  one after its snapshot is on disk.
- `omnijax.serve.cluster.router.SessionAwareRouter` is the deployment's Ray Serve request router (imported by Ray
  Serve from its dotted path): a request naming a replica goes there, a resume token to the live replica holding it,
  everything else to the live replica with the most admission headroom.
- `omnijax.serve.cluster.lease.LeaseDir` leases resume tokens across replicas in the shared snapshot directory
  (`replica.SharedSnapshotStore` uses it), so one token resumes on one replica at a time.
- `omnijax.serve.cluster.roll` restarts (upgrades) the replicas one at a time through their drain route.
"""
