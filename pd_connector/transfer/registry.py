"""Transfer backends by name (``kv_connector_extra_config.backend``, default ``mooncake``).

Adding a backend: a module with a class that implements ``backend.TransferBackend`` and a
factory ``(DisaggConfig) -> TransferBackend``, plus one line in ``_FACTORIES`` below (or a
``register_backend(name, factory)`` call, e.g. from a plugin or a test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.mooncake import MooncakeBackend

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

DEFAULT_BACKEND = "mooncake"

BackendFactory = Callable[["DisaggConfig"], TransferBackend]

_FACTORIES: dict[str, BackendFactory] = {
    "mooncake": MooncakeBackend.from_config,
}


class UnknownBackendError(ValueError):
    """No backend is registered under this name."""


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``name`` a valid ``backend`` value; ``factory(cfg)`` opens one for a worker rank."""
    if not name:
        raise ValueError("a transfer backend needs a non-empty name")
    _FACTORIES[name] = factory


def known_backends() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def unknown_backend_message(name: str) -> str:
    return f"unknown transfer backend {name!r}; known backends: {list(known_backends())}"


def create_backend(cfg: DisaggConfig) -> TransferBackend:
    """Open the backend ``cfg.backend`` names for this rank."""
    factory = _FACTORIES.get(cfg.backend)
    if factory is None:
        raise UnknownBackendError(unknown_backend_message(cfg.backend))
    return factory(cfg)
