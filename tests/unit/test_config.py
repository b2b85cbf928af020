"""config.parse_config: defaults, role mapping, coercion and errors that name the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_connector.config import DECODE, PREFILL, ConfigError, DisaggConfig, parse_config
from pd_connector.transfer import registry
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.mooncake import MooncakeOptions
from pd_connector.transfer.registry import NoOptions


def test_defaults_prefill() -> None:
    cfg = parse_config("kv_producer", None)
    assert cfg == DisaggConfig(mode=PREFILL)
    assert cfg.is_prefill and not cfg.is_decode
    assert cfg.bootstrap_host == "127.0.0.1"
    assert cfg.bootstrap_port == 18800
    assert cfg.local_ip == "127.0.0.1"
    assert cfg.backend == "mooncake"
    assert cfg.backend_options == MooncakeOptions(protocol="tcp")
    assert cfg.room_timeout_s == 480.0  # vLLM-Ascend's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT default
    assert cfg.kv_wait_timeout_s == 120.0
    assert cfg.register_retries == 60
    assert cfg.register_interval_s == 1.0
    assert cfg.max_batch_entries == 1024
    assert cfg.start_bootstrap_server is True


def test_defaults_decode_and_empty_extra() -> None:
    cfg = parse_config("kv_consumer", {})
    assert cfg.mode == DECODE
    assert cfg.is_decode and not cfg.is_prefill


@pytest.mark.parametrize("role", [None, "", "both", "producer", "KV_PRODUCER"])
def test_wrong_role(role: str | None) -> None:
    with pytest.raises(ConfigError, match="kv_role") as info:
        parse_config(role, {})
    assert repr(role) in str(info.value)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("kv_producer", {"bootstrap_port": 1234, "bootstrap_prot": 1, "zzz": 2})
    msg = str(info.value)
    assert "bootstrap_prot" in msg and "zzz" in msg
    assert "unknown" in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("bootstrap_port", 0),
        ("bootstrap_port", 65536),
        ("bootstrap_port", -1),
        ("bootstrap_port", "http"),
        ("bootstrap_port", 1.5),
        ("bootstrap_port", True),
        ("local_ip", "not-an-ip"),
        ("local_ip", "0.0.0.0"),
        ("local_ip", ""),
        ("local_ip", 127),
        ("backend", "nixl"),
        ("backend", ""),
        ("backend", 1),
        ("protocol", "udp"),
        ("protocol", "TCP"),
        ("room_timeout_s", 0),
        ("room_timeout_s", -1),
        ("room_timeout_s", "soon"),
        ("kv_wait_timeout_s", 0),
        ("kv_wait_timeout_s", [1]),
        ("register_interval_s", 0),
        ("http_timeout_s", -0.5),
        ("register_retries", 0),
        ("transfer_threads", 0),
        ("max_batch_entries", 1025),
        ("max_batch_entries", 0),
        ("start_bootstrap_server", "maybe"),
        ("start_bootstrap_server", 2),
        ("bootstrap_host", ""),
        ("bootstrap_host", 5),
        ("device_name", None),
    ],
)
def test_bad_value_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("kv_consumer", {key: value})
    assert key in str(info.value)


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"backend: unknown transfer backend 'nixl'; known backends: \[.*'mooncake'"):
        parse_config("kv_producer", {"backend": "nixl"})


def test_protocol_is_the_mooncake_transport() -> None:
    with pytest.raises(
        ConfigError, match=r"protocol \(Mooncake transport\) must be one of \('tcp', 'rdma', 'ascend'\)"
    ):
        parse_config("kv_producer", {"protocol": "udp"})


def test_max_batch_entries_upper_bound_is_inclusive() -> None:
    assert parse_config("kv_producer", {"max_batch_entries": 1024}).max_batch_entries == 1024
    assert parse_config("kv_producer", {"max_batch_entries": 1}).max_batch_entries == 1
    with pytest.raises(ConfigError, match=r"max_batch_entries must be in 1\.\.1024 \(the 'mooncake' backend's"):
        parse_config("kv_producer", {"max_batch_entries": 1025})


# ----------------------------------------------------------- backend options


def _keyless_backend(cfg: DisaggConfig) -> TransferBackend:
    raise AssertionError("not opened in these tests")


@pytest.fixture
def keyless(monkeypatch: pytest.MonkeyPatch) -> str:
    """A backend without option keys (and a 4-entry batch limit), registered for one test."""
    spec = registry.BackendSpec(open=_keyless_backend, parse=lambda raw: NoOptions(batch_limit=4))
    monkeypatch.setitem(registry._REGISTERED, "keyless", spec)
    return "keyless"


def test_the_backend_parses_its_own_keys_and_limits_batches(keyless: str) -> None:
    cfg = parse_config("kv_producer", {"backend": keyless, "max_batch_entries": 4})
    assert cfg.backend_options == NoOptions(batch_limit=4)
    with pytest.raises(ConfigError, match=r"max_batch_entries must be in 1\.\.4 \(the 'keyless' backend's"):
        parse_config("kv_producer", {"backend": keyless, "max_batch_entries": 5})


def test_another_backends_key_is_refused_by_name(keyless: str) -> None:
    with pytest.raises(
        ConfigError, match=r"use_ascend_direct is an option of the \[.*'mooncake'.*not of backend 'keyless'"
    ):
        parse_config("kv_producer", {"backend": keyless, "use_ascend_direct": True})


def test_config_imports_only_the_backend_registry_of_the_data_plane() -> None:
    """Importing config loads the backend registry (names and options), no backend, no torch, ZMQ or vLLM."""
    probe = (
        "import sys, pd_connector.config; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('pd_connector.transfer') "
        "or m.split('.')[0] in ('torch', 'zmq', 'vllm'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["pd_connector.transfer", "pd_connector.transfer.registry"]


def test_string_coercion() -> None:
    cfg = parse_config(
        "kv_producer",
        {
            "bootstrap_port": "18801",
            "room_timeout_s": "2.5",
            "kv_wait_timeout_s": "3",
            "register_retries": "4",
            "transfer_threads": "2",
            "max_batch_entries": "512",
            "start_bootstrap_server": "false",
        },
    )
    assert cfg.bootstrap_port == 18801
    assert cfg.room_timeout_s == 2.5
    assert cfg.kv_wait_timeout_s == 3.0
    assert cfg.register_retries == 4
    assert cfg.transfer_threads == 2
    assert cfg.max_batch_entries == 512
    assert cfg.start_bootstrap_server is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("false", False), ("0", False), ("No", False)],
)
def test_bool_strings(text: str, expected: bool) -> None:
    assert parse_config("kv_producer", {"start_bootstrap_server": text}).start_bootstrap_server is expected


def test_numbers_pass_as_numbers() -> None:
    cfg = parse_config(
        "kv_consumer",
        {
            "room_timeout_s": 1,
            "kv_wait_timeout_s": 0.5,
            "protocol": "rdma",
            "local_ip": "10.0.0.7",
            "device_name": "mlx5_0",
        },
    )
    assert isinstance(cfg.room_timeout_s, float) and cfg.room_timeout_s == 1.0
    assert cfg.kv_wait_timeout_s == 0.5
    assert cfg.local_ip == "10.0.0.7"
    assert cfg.backend_options == MooncakeOptions(protocol="rdma", device_name="mlx5_0")


def test_ipv6_unspecified_rejected() -> None:
    with pytest.raises(ConfigError, match="local_ip"):
        parse_config("kv_consumer", {"local_ip": "::"})


def test_config_is_frozen() -> None:
    cfg = parse_config("kv_producer", {})
    with pytest.raises(AttributeError):
        cfg.bootstrap_port = 1  # type: ignore[misc]
