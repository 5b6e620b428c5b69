"""Errors of kvtransfer.

    KVTransferError            root
    ├── HandshakeError         incompatible or unreachable peer (message names both values)
    ├── TransferFailed         a READ failed or timed out; the blocks are recomputed locally
    └── SettingsError          bad `kv_connector_extra_config` or stats payload (names the key);
                               also a ValueError, as the connector raised before it existed
"""


class KVTransferError(Exception):
    """Root of kvtransfer's errors."""


class HandshakeError(KVTransferError):
    pass


class TransferFailed(KVTransferError):
    pass


class SettingsError(KVTransferError, ValueError):
    pass
