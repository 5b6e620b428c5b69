"""kvtransfer: pdserve's own vLLM KV connector, moving KV-cache blocks over NIXL/UCX.

Runs inside vLLM's engine processes. It imports vLLM and NIXL, never `serve/`, `router/`
or `bench/`.

    connector.py   PdConnector, the thin KVConnectorBase_V1 that vLLM loads; delegates by side
    scheduler.py   scheduler side: which requests hold blocks for a remote decode, which load
    worker.py      worker side: PdWorker, wiring the roles below for the connector
    leases.py      prefill side: the lease table (pure, on an injected clock)
    holder.py      prefill side: lease table behind the side channel, NIXL progress while read
    reader.py      decode side: handshake, acquire, READ, release; failures recompute
    nixl_agent.py  the NIXL agent wrapper (registration, descriptors, READ post/check)
    faults.py      test-only fault hooks (a pause before each READ)
    side_channel.py  ZMQ side channel: versioned handshake, acquire/release of held blocks
    layout.py      KV memory layout and merged transfer descriptors (pure)
    protocol.py    typed messages, PROTOCOL_VERSION, compatibility hash, transfer params,
                   ConnectorSettings (the typed kv_connector_extra_config)
    transport.py   UCX transport profiles (rdma / shm / tcp) and their detection
    metrics.py     KvStats and the `pdserve_kv_*` Prometheus metrics (KvMetrics); no vLLM
    stats.py       PdKVStats, vLLM's KVConnectorStats around KvStats
"""
