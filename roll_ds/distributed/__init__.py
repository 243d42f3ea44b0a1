"""Ray cluster layer: device_mapping -> placement groups, role clusters, dispatch.

Modules (import them directly; this package imports nothing heavy):

    placement.py         pure planning: device ids -> nodes, bundles, per-actor resource shares
    resource_manager.py  Ray side: pick nodes, reserve one placement group per node, fail fast
    worker.py            Worker base class of every role's actors (rank env, threads, node info)
    dispatch.py          @register(Dispatch.X) on Worker methods; how a call fans out and gathers
    batch.py             Batch: tensors + non-tensor columns + meta, chunk/concat/select/index
    cluster.py           Cluster: one role = world_size Worker actors; dispatching calls
    ray_init.py          connect(): start a local Ray or join a cluster, timed
    errors.py            PlacementError, WorkerError, WorkerTimeoutError
"""
