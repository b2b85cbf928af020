"""The Router's security flags: client API keys, admin token, the backends' key, TLS.

Secrets come from files or environment variables so they never have to be on the command line
(where every local user sees them in the process list); ``--api-key`` is accepted too, as on
``vllm serve``. Error messages name the file or variable, never the secret.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from proxy.access.tls import client_context, server_context
from proxy.router_config import AccessConfig, BackendTlsConfig, TlsConfig

API_KEY_ENV = "PD_ROUTER_API_KEY"
ADMIN_TOKEN_ENV = "PD_ROUTER_ADMIN_TOKEN"
BACKEND_KEY_ENV = "PD_BACKEND_API_KEY"
#: Read last for the backends' key: what vLLM-Ascend's example proxy sends to its backends.
LEGACY_BACKEND_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class Security:
    """What :func:`security_from_args` validated."""

    access: AccessConfig
    backend_authorization: str | None
    tls: TlsConfig | None
    backend_tls: BackendTlsConfig | None


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--api-key*``, ``--admin-token-file``, ``--generated-admin-token-file``, ``--insecure-admin``,
    ``--backend-api-key-file`` and ``--ssl-*`` flags."""
    add = parser.add_argument
    add(
        "--api-key",
        nargs="+",
        metavar="KEY",
        help="clients must send 'Authorization: Bearer <one of these>' on /v1/* (as vllm serve's --api-key; "
        "/health and /metrics stay open). Visible in the process list: prefer --api-key-file or "
        f"${API_KEY_ENV} (read when neither flag is given)",
    )
    add("--api-key-file", metavar="PATH", help="file with the client API keys, one per line")
    add(
        "--admin-token-file",
        metavar="PATH",
        help="file with the bearer token the admin routes (/instances*, /reset_prefix_cache) require "
        f"(default: ${ADMIN_TOKEN_ENV}; without either, the Router generates one at start-up, see "
        "--generated-admin-token-file)",
    )
    add(
        "--generated-admin-token-file",
        metavar="PATH",
        help="where the Router writes the admin token it generates when none is configured (mode 0600; "
        "default: $XDG_RUNTIME_DIR/pd-router/admin-token-<port>, else <tmp>/pd-router-<uid>/admin-token-<port>)",
    )
    add(
        "--insecure-admin",
        action="store_true",
        help="no admin token at all: admin routes answer anyone who reaches the Router (default: off; a token "
        "is configured or generated)",
    )
    add(
        "--backend-api-key-file",
        metavar="PATH",
        help="file with the key sent to every P and D as 'Authorization: Bearer <key>' (their vllm serve "
        f"--api-key; default: ${BACKEND_KEY_ENV}, else ${LEGACY_BACKEND_KEY_ENV}); the client's "
        "Authorization header is never passed on",
    )
    add("--ssl-certfile", metavar="PATH", help="serve HTTPS with this certificate (chain) file; needs --ssl-keyfile")
    add("--ssl-keyfile", metavar="PATH", help="the private key file of --ssl-certfile")
    add("--ssl-ca-certs", metavar="PATH", help="CA certificates that client certificates are verified against")
    add(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="client certificate: 0 not asked, 1 optional, 2 required (ssl.VerifyMode; default: %(default)s)",
    )
    add("--ssl-ciphers", metavar="CIPHERS", help="TLS 1.2 cipher suites (OpenSSL cipher list)")
    add(
        "--backend-ssl",
        action="store_true",
        help="call every P and D over HTTPS, their certificates verified (the system's CAs unless "
        "--backend-ssl-ca-certs); implied by the other --backend-ssl-* flags",
    )
    add(
        "--backend-ssl-ca-certs", metavar="PATH", help="CA certificates the backends' certificates are verified against"
    )
    add("--backend-ssl-certfile", metavar="PATH", help="the Router's client certificate for backends that ask for one")
    add("--backend-ssl-keyfile", metavar="PATH", help="the private key of --backend-ssl-certfile")


def _check_secret(parser: argparse.ArgumentParser, secret: str, source: str) -> str:
    if not secret:
        parser.error(f"{source}: empty key")
    if any(c.isspace() or not c.isprintable() for c in secret) or not secret.isascii():
        parser.error(f"{source}: a key must be printable ASCII without spaces (the key is not shown)")
    return secret


def _read_lines(parser: argparse.ArgumentParser, flag: str, path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.strip() for line in file]
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"{flag} {path}: cannot read it: {exc}")
    keys = [_check_secret(parser, line, f"{flag} {path}") for line in lines if line]
    if not keys:
        parser.error(f"{flag} {path}: the file holds no key")
    return keys


def _one_secret(parser: argparse.ArgumentParser, flag: str, path: str | None, *envs: str) -> str | None:
    """The secret in the file ``path`` (exactly one line), else in the first set variable of ``envs``."""
    if path is not None:
        keys = _read_lines(parser, flag, path)
        if len(keys) != 1:
            parser.error(f"{flag} {path}: the file must hold exactly one key (found {len(keys)} lines)")
        return keys[0]
    for env in envs:
        if value := os.environ.get(env, "").strip():
            return _check_secret(parser, value, f"${env}")
    return None


def _api_keys(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, ...]:
    keys = [_check_secret(parser, k, "--api-key") for k in args.api_key or ()]
    if args.api_key_file is not None:
        keys += _read_lines(parser, "--api-key-file", args.api_key_file)
    if not keys and (value := os.environ.get(API_KEY_ENV, "").strip()):
        keys = [_check_secret(parser, value, f"${API_KEY_ENV}")]
    return tuple(dict.fromkeys(keys))


def _tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsConfig | None:
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        parser.error("--ssl-certfile and --ssl-keyfile go together: give both or neither")
    if args.ssl_certfile is None:
        for flag in ("ssl_ca_certs", "ssl_ciphers"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} needs --ssl-certfile and --ssl-keyfile")
        if args.ssl_cert_reqs:
            parser.error("--ssl-cert-reqs needs --ssl-certfile and --ssl-keyfile")
        return None
    tls = TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs, args.ssl_ciphers)
    try:
        server_context(tls)  # fail now, with the file named, rather than when serving
    except ValueError as exc:
        parser.error(str(exc))
    return tls


def _backend_tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> BackendTlsConfig | None:
    if args.backend_ssl_keyfile is not None and args.backend_ssl_certfile is None:
        parser.error("--backend-ssl-keyfile needs --backend-ssl-certfile")
    files = (args.backend_ssl_ca_certs, args.backend_ssl_certfile, args.backend_ssl_keyfile)
    if not args.backend_ssl and all(f is None for f in files):
        return None
    tls = BackendTlsConfig(*files)
    try:
        client_context(tls)
    except ValueError as exc:
        parser.error(str(exc))
    return tls


def security_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Security:
    """Validate the security flags (errors exit with code 2, naming the flag or file)."""
    api_keys = _api_keys(parser, args)
    admin_token = _one_secret(parser, "--admin-token-file", args.admin_token_file, ADMIN_TOKEN_ENV)
    if admin_token is not None and admin_token in api_keys:
        parser.error("the admin token must differ from every client API key")
    if admin_token is not None and args.insecure_admin:
        parser.error("--insecure-admin has no effect with an admin token configured: drop one of them")
    backend_key = _one_secret(
        parser, "--backend-api-key-file", args.backend_api_key_file, BACKEND_KEY_ENV, LEGACY_BACKEND_KEY_ENV
    )
    if args.generated_admin_token_file is not None and (admin_token is not None or args.insecure_admin):
        parser.error("--generated-admin-token-file is used only without an admin token and without --insecure-admin")
    return Security(
        AccessConfig(api_keys, admin_token, args.insecure_admin, args.generated_admin_token_file),
        f"Bearer {backend_key}" if backend_key else None,
        _tls(parser, args),
        _backend_tls(parser, args),
    )
