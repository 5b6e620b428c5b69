"""kvtransfer: pdserve's own vLLM KV connector, moving KV-cache blocks over NIXL/UCX.

Runs inside vLLM's engine processes. It imports vLLM and NIXL, never `serve/` or `router/`.

    connector.py   PdConnector, the thin KVConnectorBase_V1 that vLLM loads; delegates by side
    scheduler.py   scheduler side: which requests hold blocks for a remote decode, which load
    worker.py      worker side: NIXL agent, leases, one-sided READs, completion
    side_channel.py  ZMQ side channel: versioned handshake, acquire/release of held blocks
    layout.py      KV memory layout and merged transfer descriptors (pure)
    protocol.py    typed messages, PROTOCOL_VERSION, compatibility hash, transfer params
    transport.py   UCX transport profiles (rdma / shm / tcp) and their detection
    stats.py       connector stats, exported by the worker as `pdserve_kv_*` metrics
"""
