"""Errors of kvtransfer.

    KVTransferError            root
    ├── HandshakeError         incompatible or unreachable peer (message names both values)
    └── TransferFailed         a READ failed or timed out; the blocks are recomputed locally
"""


class KVTransferError(Exception):
    """Root of kvtransfer's errors."""


class HandshakeError(KVTransferError):
    pass


class TransferFailed(KVTransferError):
    pass
