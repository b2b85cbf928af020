"""Opens the transfer backend a config names, at worker start.

The names, where each backend lives and how its options parse are in ``pd_connector.transfer_backends``
(vLLM-free, checked when the config is parsed); this module only opens the backend. Adding a
backend: see ``pd_connector.transfer_backends``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer_backends import (
    DEFAULT_BACKEND,
    UnknownBackendError,
    known_backends,
    register_backend,
    spec_of,
    unknown_backend_message,
)

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

__all__ = [
    "DEFAULT_BACKEND",
    "UnknownBackendError",
    "create_backend",
    "known_backends",
    "register_backend",
    "unknown_backend_message",
]


def create_backend(cfg: DisaggConfig) -> TransferBackend:
    """Open the backend ``cfg.backend`` names for this rank (UnknownBackendError if none)."""
    return spec_of(cfg.backend).open(cfg)
