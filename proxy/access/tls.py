"""TLS contexts: the Router's HTTPS listener (``--ssl-*``, ``vllm serve``'s flags) and its HTTPS
calls to the backends (``--backend-ssl*``)."""

from __future__ import annotations

import ssl

from proxy.router_config import BackendTlsConfig, TlsConfig

#: ``--ssl-cert-reqs`` values (``ssl.VerifyMode``), as ``vllm serve`` takes them.
CERT_REQS = {int(ssl.CERT_NONE): ssl.CERT_NONE, int(ssl.CERT_OPTIONAL): ssl.CERT_OPTIONAL,
             int(ssl.CERT_REQUIRED): ssl.CERT_REQUIRED}  # fmt: skip


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or newer) for ``tls``.

    Raises ``ValueError`` naming the file or value that could not be used.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {tls.certfile!r} with key {tls.keyfile!r}: {exc}") from None
    if tls.ca_certs:
        try:
            context.load_verify_locations(cafile=tls.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the CA certificates {tls.ca_certs!r}: {exc}") from None
    if tls.cert_reqs not in CERT_REQS:
        raise ValueError(f"ssl cert_reqs must be one of {sorted(CERT_REQS)} (got {tls.cert_reqs})")
    if tls.cert_reqs != int(ssl.CERT_NONE) and not tls.ca_certs:
        raise ValueError("client certificates (ssl cert_reqs 1 or 2) need the CA certificates (--ssl-ca-certs)")
    context.verify_mode = CERT_REQS[tls.cert_reqs]
    if tls.ciphers:
        try:
            context.set_ciphers(tls.ciphers)
        except ssl.SSLError as exc:
            raise ValueError(f"invalid --ssl-ciphers {tls.ciphers!r}: {exc}") from None
    return context


def client_context(tls: BackendTlsConfig) -> ssl.SSLContext:
    """A client-side TLS context for the calls to P and D: their certificate verified (against
    ``tls.ca_certs``, else the system's CAs) and its host name checked; the Router's own
    certificate sent when given. Raises ``ValueError`` naming the file that could not be used."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.ca_certs:
        try:
            context.load_verify_locations(cafile=tls.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the backends' CA certificates {tls.ca_certs!r}: {exc}") from None
    if tls.certfile:
        try:
            context.load_cert_chain(tls.certfile, tls.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the Router's client certificate {tls.certfile!r}: {exc}") from None
    return context
