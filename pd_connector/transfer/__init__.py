"""Data plane: Mooncake TransferEngine wrapper and the per-rank KVTransferManager."""
