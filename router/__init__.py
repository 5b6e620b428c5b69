"""router: picks workers for a request. Pure decisions over token ids and worker state.

Knows no HTTP server, no engine and no transfer code (see shared/style.md).
"""
