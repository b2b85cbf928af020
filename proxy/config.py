"""The Router's configuration: its backends and its timeouts, as validated by :mod:`proxy.cli`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode"]


def url_host(host: str) -> str:
    """Return ``host`` as it must appear in a URL (IPv6 literals get square brackets)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


@dataclass(frozen=True)
class Backend:
    """One vLLM instance behind the Router.

    ``bootstrap_port`` is the port of the prefill deployment's bootstrap server, which the
    decode side contacts to find P's ranks; it is ``None`` for decoders.
    """

    role: Role
    host: str
    port: int
    bootstrap_port: int | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the instance's OpenAI-compatible server."""
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def name(self) -> str:
        """Short name used in logs and error messages, e.g. ``prefiller 10.0.0.1:8001``."""
        kind = "prefiller" if self.role == "prefill" else "decoder"
        return f"{kind} {url_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class RouterConfig:
    """Everything :func:`proxy.app.create_app` needs to serve."""

    prefillers: tuple[Backend, ...]
    decoders: tuple[Backend, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    #: Attempts per backend request when the connection cannot be opened (vLLM-Ascend semantics:
    #: the total number of attempts, not the number of extra ones).
    max_retries: int = 3
    #: Base delay of the exponential back-off between those attempts, in seconds.
    retry_delay: float = 0.001
    #: Total time allowed for one backend request (including a streamed body), in seconds.
    request_timeout: float = 600.0
    #: Time allowed to open a connection to a backend, in seconds.
    connect_timeout: float = 5.0
    #: Timeout of each backend's ``/health`` call made by the Router's ``/health``, in seconds.
    health_timeout: float = 2.0
    log_level: str = "INFO"

    def describe(self) -> str:
        """One-line summary of the backends, e.g. ``P: h:8001 (bootstrap 18800), D: h:8002``."""
        prefill = ", ".join(f"{url_host(b.host)}:{b.port} (bootstrap {b.bootstrap_port})" for b in self.prefillers)
        decode = ", ".join(f"{url_host(b.host)}:{b.port}" for b in self.decoders)
        return f"P: {prefill}; D: {decode}"
