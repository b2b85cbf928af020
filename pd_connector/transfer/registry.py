"""Transfer backends by name (``kv_connector_extra_config.backend``, default ``mooncake``): their
options (``BackendOptions``, ``BackendSpec``) and the factory that opens one at worker start.

This module is vLLM-free and imports no backend at import time: ``config`` uses it to check a
backend's name and options when it parses, the worker (``create_backend``) to open the backend.
A backend module is imported the first time its name is used.

Adding a backend: one module under ``pd_connector/transfer/`` that defines ``BACKEND = BackendSpec(...)``
(its option keys and their types, a parser that turns them into its options, and a factory
``(DisaggConfig) -> TransferBackend``), plus one entry in ``_MODULES`` below. Its keys are accepted at
the top level of ``kv_connector_extra_config`` (vLLM-Ascend's ``use_ascend_direct`` and
``ascend_local_comm_res_path`` are the Mooncake backend's). Tests and plugins may also call
``register_backend(name, factory)``; a backend that must be enabled explicitly (``null``, the
benchmarks' backend that moves no byte) is registered whole by ``register_spec``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig
    from pd_connector.transfer.backend import TransferBackend

DEFAULT_BACKEND = "mooncake"

#: Backend name -> the module defining its ``BACKEND`` spec, imported on first use. One entry per backend.
_MODULES: dict[str, str] = {
    "mooncake": "pd_connector.transfer.mooncake",
    "device_copy": "pd_connector.transfer.device_copy",
}


class OptionError(ValueError):
    """A backend option is invalid; the message names the key (``kv_connector_extra_config.<key>``) and value."""


class UnknownBackendError(ValueError):
    """No backend is registered under this name."""


class BackendOptions(Protocol):
    """One backend's parsed options, and what the rest of PDConnector asks of them."""

    @property
    def batch_limit(self) -> int:
        """Most (src, dst, len) entries one write call may take (``max_batch_entries`` is checked against it)."""
        ...

    @property
    def uses_hixl(self) -> bool:
        """Whether the bytes move over Ascend's HIXL, so vLLM-Ascend's QoS and timeout settings apply."""
        ...

    @property
    def batch_stall_s(self) -> float:
        """The longest one batch write may take before the transport itself fails it, in seconds.

        The timing contract of a write after a reader gave up: P's slowest batch, retries included, is
        ``transfer.backend.batch_budget_s(batch_stall_s)``, and D keeps a stopped load's blocks out of
        reuse that long plus peer_timeout_s and a margin (``transfer.loads.stop_wait_s``). A backend
        derives it from its own options and the environment its transport reads."""
        ...

    def memory_problem(self, device_types: Iterable[str], regions: int, staging: int) -> str | None:
        """Why this backend cannot move KV on ``device_types`` in ``regions`` registered regions
        (``staging`` of them P's NHD staging buffer); None when it can."""
        ...

    def prepare_rank(self, local_rank: int) -> None:
        """Set up this worker rank's environment before the backend opens (e.g. endpoint files)."""
        ...


#: ``batch_stall_s`` of a backend whose batch is a local copy in this process (no peer, no network):
#: a bound for a loop of memory copies, so a stopped load is not held for a network transport's timeout.
LOCAL_COPY_STALL_S = 2.0


@dataclass(frozen=True)
class NoOptions:
    """The options of a backend without keys: no limits but the batch size, nothing to prepare."""

    batch_limit: int = 1 << 16
    uses_hixl: bool = False
    batch_stall_s: float = LOCAL_COPY_STALL_S

    def memory_problem(self, device_types: Iterable[str], regions: int, staging: int) -> str | None:
        return None

    def prepare_rank(self, local_rank: int) -> None:
        return None


def _no_options(raw: Mapping[str, Any]) -> NoOptions:
    return NoOptions()


@dataclass(frozen=True)
class BackendSpec:
    """What a backend module declares: its option keys with their types, their parser, its factory."""

    #: Factory: opens the backend for one worker rank; ``cfg.backend_options`` is what ``parse`` returned.
    open: Callable[[DisaggConfig], TransferBackend]
    #: Its ``kv_connector_extra_config`` keys and their types (str, int, float, bool), coerced by ``config``.
    keys: Mapping[str, type] = field(default_factory=dict)
    #: The given keys (coerced, unset ones absent) -> options; raises OptionError naming the key.
    parse: Callable[[Mapping[str, Any]], BackendOptions] = _no_options


_REGISTERED: dict[str, BackendSpec] = {}


def register_backend(
    name: str,
    factory: Callable[[DisaggConfig], TransferBackend],
    options_of: str = "",
    parse: Callable[[Mapping[str, Any]], BackendOptions] | None = None,
) -> None:
    """Make ``name`` a valid ``backend`` value; ``factory(cfg)`` opens one for a worker rank.

    Its option keys are those of backend ``options_of`` (default: the default backend's, so a test's
    spy of the default backend takes the same keys), and so is their parser unless ``parse`` is given
    (e.g. options with another ``batch_stall_s``).
    """
    if not name:
        raise ValueError("a transfer backend needs a non-empty name")
    base = spec_of(options_of or DEFAULT_BACKEND)
    _REGISTERED[name] = replace(base, open=factory, parse=parse or base.parse)


def register_spec(name: str, spec: BackendSpec) -> None:
    """Make ``name`` a valid ``backend`` value with a whole spec of its own (keys, parser, factory).

    For backends that must never be picked by a deployment's config unless a program registered them
    first (``null_backend.enable``): names in ``_MODULES`` are known to every process, these are not.
    """
    if not name:
        raise ValueError("a transfer backend needs a non-empty name")
    if name in _MODULES:
        raise ValueError(f"transfer backend {name!r} is built in; register another name")
    _REGISTERED[name] = spec


def known_backends() -> tuple[str, ...]:
    return tuple(sorted({*_MODULES, *_REGISTERED}))


def unknown_backend_message(name: str) -> str:
    return f"unknown transfer backend {name!r}; known backends: {list(known_backends())}"


def spec_of(name: str) -> BackendSpec:
    """The spec of backend ``name`` (its module imported on first use); UnknownBackendError if none."""
    spec = _REGISTERED.get(name)
    if spec is not None:
        return spec
    module = _MODULES.get(name)
    if module is None:
        raise UnknownBackendError(unknown_backend_message(name))
    spec = importlib.import_module(module).BACKEND
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"{module}.BACKEND must be a BackendSpec, got {type(spec).__name__}")
    return spec


def option_owners() -> dict[str, list[str]]:
    """Every backend option key -> the backends that take it."""
    owners: dict[str, list[str]] = {}
    for name in known_backends():
        for key in spec_of(name).keys:
            owners.setdefault(key, []).append(name)
    return owners


def create_backend(cfg: DisaggConfig) -> TransferBackend:
    """Open the backend ``cfg.backend`` names for this worker rank (UnknownBackendError if none)."""
    return spec_of(cfg.backend).open(cfg)


def default_options() -> BackendOptions:
    """The default backend's options with none of its keys set (``DisaggConfig``'s default)."""
    return spec_of(DEFAULT_BACKEND).parse({})
