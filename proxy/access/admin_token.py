"""The admin token the Router makes for itself when none is configured.

Without ``--admin-token-file`` / ``PD_ROUTER_ADMIN_TOKEN`` (and without ``--insecure-admin``) the
Router draws a random token at start-up, writes it to a file only its user can read (mode 0600,
in a directory only its user can enter, 0700) and logs the path; the admin routes then need it
like a configured one. Nothing else on the host, loopback callers included, can call them.

Where (:func:`default_token_path`): ``--generated-admin-token-file`` if given, else
``$XDG_RUNTIME_DIR/pd-router/admin-token-<port>``, else ``<tmp>/pd-router-<uid>/admin-token-<port>``.
Tools on the same host under the same user read it with :func:`read_token` /
:func:`admin_headers` (the port is the Router's ``--port``). The supervisor removes the file
when it exits.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from dataclasses import replace
from pathlib import Path

from proxy.router_config import RouterConfig

#: Bytes of randomness in a generated token (URL-safe base64 text of about 43 characters).
TOKEN_BYTES = 32


def default_token_path(port: int) -> Path:
    """Where a Router listening on ``port`` writes the token it generated."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "pd-router" / f"admin-token-{port}"
    return Path(tempfile.gettempdir()) / f"pd-router-{os.getuid()}" / f"admin-token-{port}"


def _private_dir(directory: Path) -> None:
    """Create ``directory`` (0700) or check an existing one is this user's and closed to others."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise OSError(f"{directory} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise OSError(f"{directory} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); make it 0700")


def write_new_token(path: Path) -> str:
    """Draw a random token and write it to ``path`` (mode 0600, replaced atomically); return it."""
    _private_dir(path.parent)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as file:
            file.write(token + "\n")
        os.replace(temporary, path)  # replaces a link at ``path`` itself, never follows it
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return token


def read_token(where: int | str | Path) -> str:
    """The token in a token file: ``where`` is the file, or a Router's port (its default path)."""
    path = default_token_path(where) if isinstance(where, int) else Path(where)
    return path.read_text(encoding="ascii").strip()


def admin_headers(where: int | str | Path) -> dict[str, str]:
    """``Authorization`` header for a Router's admin routes (see :func:`read_token`)."""
    return {"Authorization": f"Bearer {read_token(where)}"}


def ensure_admin_token(config: RouterConfig) -> RouterConfig:
    """``config`` with a generated admin token (its file written) when it has none and is not
    ``insecure_admin``; else ``config`` itself. Raises ``OSError`` naming the path it cannot use."""
    access = config.access
    if access.admin_token is not None or access.insecure_admin:
        return config
    path = Path(access.generated_token_file) if access.generated_token_file else default_token_path(config.port)
    token = write_new_token(path)
    return replace(config, access=replace(access, admin_token=token, generated_token_file=str(path)))


def remove_token_file(config: RouterConfig) -> None:
    """Remove the file :func:`ensure_admin_token` wrote (if it still holds this Router's token)."""
    access = config.access
    if access.generated_token_file is None or access.admin_token is None:
        return
    try:
        if read_token(access.generated_token_file) == access.admin_token:
            os.unlink(access.generated_token_file)
    except OSError:
        pass
