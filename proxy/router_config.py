"""The Router's configuration: its backends, routing policy and limits, as validated by :mod:`proxy.cli`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.admin.rebalance_flags import RebalanceConfig
from proxy.planning.flags import PathConfig
from proxy.upstream.routing import POLICIES, RoutingOptions

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

#: The ``--routing`` names, from :data:`proxy.upstream.routing.POLICIES` (the first is the default).
ROUTING_POLICIES: tuple[str, ...] = tuple(POLICIES)


@dataclass(frozen=True)
class TlsConfig:
    """The Router's HTTPS listener (``--ssl-*``, as ``vllm serve``): certificate chain and key
    files, and for client certificates the CA file and ``ssl.VerifyMode`` value (0 none, 1
    optional, 2 required)."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None
    cert_reqs: int = 0
    ciphers: str | None = None


@dataclass(frozen=True)
class BackendTlsConfig:
    """HTTPS to every P and D (``--backend-ssl*``): the CA file their certificates are verified
    against (``None``: the system's), and the Router's own certificate and key if they ask for one."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None


@dataclass(frozen=True)
class AccessConfig:
    """Who may call the Router (:mod:`proxy.access.api_keys`); secrets are never in ``repr``.

    ``api_keys``: clients must send ``Authorization: Bearer <one of them>`` on ``/v1/*``
    (``--api-key``/``--api-key-file``/``PD_ROUTER_API_KEY``; empty: no key needed).
    ``admin_token``: the bearer token of the admin routes (``/instances*``,
    ``/reset_prefix_cache``); ``None``: ``python -m proxy`` generates one (:mod:`proxy.access.admin_token`)
    unless ``insecure_admin`` (admin routes answer anyone); an application built without either
    refuses every admin call. ``generated_token_file``: where the generated one is (or goes:
    ``--generated-admin-token-file``).
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_token: str | None = field(default=None, repr=False)
    insecure_admin: bool = False
    generated_token_file: str | None = None


def url_host(host: str) -> str:
    """Return ``host`` as it must appear in a URL (IPv6 literals get square brackets)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


@dataclass(frozen=True)
class Backend:
    """One vLLM instance behind the Router.

    ``bootstrap_port`` is the port of the prefill deployment's bootstrap server, which the
    decode side contacts to find P's ranks. A decoder has one only when it serves pushes of its own
    KV (the connector's ``migration``): it is then *movable by KV* (:attr:`movable`: a drain moves
    its streams with their KV, :mod:`proxy.strategies.kv_move`); ``None`` otherwise. The server runs in the
    deployment's DP-rank-0 leader: ``bootstrap_host`` names that host when it is not this
    instance's (a DP rank on another node), ``None`` meaning ``host``. ``dp_rank`` is this
    instance's DP rank within its deployment, sent to D as ``prefill_dp_rank``; ``None`` (the
    default) leaves it out, and D then asks the bootstrap server which DP rank holds the room
    (the only way for vLLM's internal DP, where the API server picks the engine).

    ``both``: one side of a kv_role kv_both instance (``--both-hosts``): the pool holds it once per
    role, and never pairs it with itself (:meth:`same_instance`).
    """

    role: Role
    host: str
    port: int
    bootstrap_port: int | None = None
    bootstrap_host: str | None = None
    dp_rank: int | None = None
    both: bool = False

    def same_instance(self, other: Backend) -> bool:
        """Whether ``other`` is this very vLLM instance (a kv_both instance's other role)."""
        return (self.host, self.port) == (other.host, other.port)

    @property
    def bootstrap_address(self) -> tuple[str, int | None]:
        """(host, port) of the bootstrap server D contacts for this prefiller's KV."""
        return (self.bootstrap_host or self.host, self.bootstrap_port)

    @property
    def movable(self) -> bool:
        """A decoder whose streams a drain moves with their KV (its bootstrap port is known)."""
        return self.role == "decode" and self.bootstrap_port is not None

    def url(self, tls: bool = False) -> str:
        """``http://host:port`` of the instance's OpenAI-compatible server; ``https://`` with
        ``tls`` (the Router calls its backends over HTTPS: ``--backend-ssl*``)."""
        return f"{'https' if tls else 'http'}://{url_host(self.host)}:{self.port}"

    @property
    def address(self) -> str:
        """``host:port`` (the ``backend`` label of the Router's metrics)."""
        return f"{url_host(self.host)}:{self.port}"

    @property
    def name(self) -> str:
        """Short name used in logs and error messages, e.g. ``prefiller 10.0.0.1:8001``."""
        kind = "prefiller" if self.role == "prefill" else "decoder"
        return f"{kind} {self.address}{' (kv_both)' if self.both else ''}"

    @property
    def key(self) -> tuple[str, str, int]:
        """Identity of the instance in the pool: role, host and port."""
        return (self.role, self.host, self.port)


@dataclass(frozen=True)
class RouterConfig:
    """Everything :func:`proxy.app.create_app` needs to serve."""

    prefillers: tuple[Backend, ...]
    decoders: tuple[Backend, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    #: Attempts per client request (vLLM-Ascend meaning: the total number of tries, not the
    #: number of extra ones). A failed attempt is retried on another P/D pair with a fresh room,
    #: only while no byte of the answer went to the client.
    max_retries: int = 3
    #: Base delay of the exponential back-off between those attempts, in seconds.
    retry_delay: float = 0.001
    #: Total time allowed for one client request (all attempts, streamed body included), in seconds.
    request_timeout: float = 600.0
    #: Time allowed to open a connection to a backend, in seconds.
    connect_timeout: float = 5.0
    #: Routing policy, one of :data:`ROUTING_POLICIES`.
    routing: str = "room"
    #: Tuning of the stateful policies (``--cache-aware-*``).
    routing_options: RoutingOptions = RoutingOptions()
    #: Seconds between two health checks (``GET /health``) of every backend; 0 turns the
    #: background checks off (backends are then marked unhealthy only by connection failures,
    #: and healthy again by a ``GET /health`` on the Router).
    health_interval: float = 5.0
    #: Timeout of one backend health check, in seconds.
    health_timeout: float = 2.0
    #: Largest request body accepted, in bytes (larger: HTTP 413).
    max_body_size: int = 32 * 1024 * 1024
    #: Seconds a client has to send a request's headers, from its first byte (``--header-timeout``);
    #: seconds without a body byte (``--body-timeout``) and without its reading any of the answer
    #: (``--write-timeout``) before the connection is closed (:mod:`proxy.server.hot_connection`).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    write_timeout: float = 30.0
    #: Instances added at run time that do not answer their health check yet: how many checks
    #: they get, and how many seconds apart (vLLM-Ascend's flags), before they are dropped.
    max_waiting_retries: int = 3
    waiting_retry_interval: float = 10.0
    log_level: str = "INFO"
    #: ``Authorization`` sent to every backend on every call, in place of the client's (which
    #: never reaches P or D): ``Bearer <key>`` from ``--backend-api-key-file``, else
    #: ``PD_BACKEND_API_KEY``, else ``OPENAI_API_KEY`` (what vLLM-Ascend's proxy sends).
    backend_authorization: str | None = field(default=None, repr=False)
    #: Client keys and the admin token (:mod:`proxy.access.api_keys`).
    access: AccessConfig = AccessConfig()
    #: HTTPS instead of HTTP when set (``--ssl-certfile``/``--ssl-keyfile``).
    tls: TlsConfig | None = None
    #: HTTPS to the backends when set (``--backend-ssl*``).
    backend_tls: BackendTlsConfig | None = None
    #: Use a client-given ``bootstrap_room`` (``--trust-client-room``); otherwise every request
    #: gets a random one. Either way, a room already in flight is refused (HTTP 409).
    trust_client_room: bool = False
    #: Streamed completions get P's own first token at once (:mod:`proxy.strategies.first_token`); D then
    #: loads P's KV and decodes the rest (``--first-token-from-prefill``, on by default).
    first_token_from_prefill: bool = True
    #: Where each request prefills (``--path-policy`` and its tuning: :mod:`proxy.planning.live`).
    paths: PathConfig = PathConfig()
    #: Router processes sharing the port (``--workers``, :mod:`proxy.server.workers`).
    workers: int = 1
    #: Continuations of an answer a decoder cut with ``stop_reason: "recomputed"`` (vLLM-Ascend's
    #: ``recompute_scheduler_enable``; :mod:`proxy.strategies.recompute`), per request; 0 passes it on as is.
    max_recomputes: int = 3
    #: Resumed legs per request of a stream cut by its decoder after it started (``--resume-attempts``,
    #: :mod:`proxy.strategies.resume`): another decoder continues it from the tokens sent; 0: the error event.
    resume_attempts: int = 2
    #: Streams moved off an overloaded decoder by KV (``--rebalance*``, :mod:`proxy.admin.rebalance`).
    rebalance: RebalanceConfig = RebalanceConfig()

    def describe(self) -> str:
        """One-line summary of the backends, e.g. ``P: h:8001 (bootstrap 18800); D: h:8002``."""
        prefill = ", ".join(_describe_prefiller(b) for b in self.prefillers)
        decode = ", ".join(
            f"{b.address} (bootstrap {b.bootstrap_port})"
            if b.movable
            else f"{b.address} (kv_both)"
            if b.both
            else b.address
            for b in self.decoders
        )
        return f"P: {prefill}; D: {decode}; routing: {self.routing}"


def _describe_prefiller(backend: Backend) -> str:
    host, port = backend.bootstrap_address
    where = f"bootstrap {port}" if host == backend.host else f"bootstrap {url_host(host)}:{port}"
    if backend.dp_rank is not None:
        where += f", dp rank {backend.dp_rank}"
    if backend.both:
        where += ", kv_both"
    return f"{backend.address} ({where})"
