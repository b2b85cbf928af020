"""The admin token a Router generates when none is configured (proxy/access/admin_token.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest

from proxy.access.admin_token import default_token_path, ensure_admin_token, read_token, write_new_token
from proxy.router_config import AccessConfig, Backend, RouterConfig
from tests.support.router_rig import Backends, RouterFactory, admin_headers, start_router, wait_until

_CONFIG = RouterConfig((Backend("prefill", "127.0.0.1", 1, 2),), (Backend("decode", "127.0.0.1", 3),), port=8123)


def test_a_written_token_is_private_and_random(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "admin-token"
    first = write_new_token(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert read_token(path) == first and len(first) >= 40
    assert write_new_token(path) != first  # replaced, never reused
    assert sorted(p.name for p in path.parent.iterdir()) == ["admin-token"]  # no temporary left


def test_a_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(OSError, match="open to other users"):
        write_new_token(shared / "admin-token")


def test_a_link_at_the_path_is_replaced_not_followed(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (directory / "admin-token").symlink_to(target)
    write_new_token(directory / "admin-token")
    assert target.read_text() == "keep" and not (directory / "admin-token").is_symlink()


def test_default_path_is_per_user_and_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_token_path(8123) == tmp_path / "pd-router" / "admin-token-8123"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_token_path(8123).parent.name == f"pd-router-{os.getuid()}"


def test_only_a_config_without_token_nor_insecure_admin_gets_one(tmp_path: Path) -> None:
    configured = RouterConfig(_CONFIG.prefillers, _CONFIG.decoders, access=AccessConfig(admin_token="t"))
    assert ensure_admin_token(configured) is configured
    insecure = RouterConfig(_CONFIG.prefillers, _CONFIG.decoders, access=AccessConfig(insecure_admin=True))
    assert ensure_admin_token(insecure) is insecure
    target = tmp_path / "p" / "token"
    asked = RouterConfig(_CONFIG.prefillers, _CONFIG.decoders, access=AccessConfig(generated_token_file=str(target)))
    generated = ensure_admin_token(asked)
    assert generated.access.admin_token == read_token(target)
    assert generated.access.generated_token_file == str(target)


def test_a_router_without_token_generates_one_and_refuses_loopback_callers_without_it(
    backends: Backends, router_factory: RouterFactory
) -> None:
    router = router_factory(backends.ok_p, backends.ok_d)
    path = default_token_path(router.proc.port)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert str(path) in router.proc.log_text()
    url = f"{router.url}/instances"
    refused = httpx.get(url, timeout=10, trust_env=False)  # from 127.0.0.1
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url, headers={"Authorization": "Bearer guess"}, timeout=10, trust_env=False).status_code == 401
    assert httpx.get(url, headers=admin_headers(router), timeout=10, trust_env=False).status_code == 200


def test_the_token_file_goes_with_the_router_and_insecure_admin_makes_none(
    backends: Backends, proc_dir: Path, tmp_path: Path
) -> None:
    chosen = tmp_path / "mine" / "token"
    router = start_router(proc_dir, [backends.ok_p], [backends.ok_d], "--generated-admin-token-file", str(chosen))
    try:
        headers = {"Authorization": f"Bearer {read_token(chosen)}"}
        assert httpx.get(f"{router.url}/instances", headers=headers, timeout=10, trust_env=False).status_code == 200
    finally:
        router.proc.stop()
    wait_until(lambda: not chosen.exists(), 5)
    router = start_router(proc_dir, [backends.ok_p], [backends.ok_d], "--insecure-admin")
    try:
        assert not default_token_path(router.proc.port).exists()
        assert httpx.get(f"{router.url}/instances", timeout=10, trust_env=False).status_code == 200
        assert "--insecure-admin" in router.proc.log_text()
    finally:
        router.proc.stop()
