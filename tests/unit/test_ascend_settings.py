"""vLLM-Ascend 0.23 settings its users carry, taken with vLLM-Ascend's meaning.

Each is set the vLLM-Ascend way (the extra-config key or the environment variable) and its effect
checked: ``qos_priority`` merged into ``ASCEND_GLOBAL_RESOURCE_CONFIG`` before the engine starts,
``tls_config`` as D's client TLS toward the metaserver (its effect: test_metaserver.py's mutual-TLS
metaserver), ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` as P's hold (a room nobody asks for is freed after
it), ``ASCEND_TRANSFER_TIMEOUT`` from ``HCCL_RDMA_*``, and the endpoint file of the physical NPU id (a
stand-in ``npu-smi`` on PATH).
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from pd_connector import worker as worker_mod
from pd_connector.ascend import env as ascend_env
from pd_connector.ascend import settings as ascend_settings
from pd_connector.ascend.env import endpoint_file, parse_npu_map, setup_local_comm_res
from pd_connector.ascend.settings import apply_transport_env, transfer_timeout_ms
from pd_connector.config import ConfigError, parse_config
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.metadata import SendJob
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.registry import register_backend
from pd_connector.worker import PDWorker
from tests.support.ascend_kv import ascend_kv
from tests.support.loopback import HOST
from tests.support.transfer_rig import BLOCK_SIZE, DTYPE, LAYERS, NUM_BLOCKS, Rig, Side

ENV_NAMES = (
    "ASCEND_GLOBAL_RESOURCE_CONFIG",
    "ASCEND_TRANSFER_TIMEOUT",
    "HCCL_RDMA_TIMEOUT",
    "HCCL_RDMA_RETRY_CNT",
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT",
    "ASCEND_LOCAL_COMM_RES",
    "ASCEND_RT_VISIBLE_DEVICES",
)
NPU_MAP_A3 = "NPU ID  Chip ID  Chip Logic ID  Chip Name\n8 0 0 Ascend\n8 1 - Mcu\n9 0 1 Ascend\n"


@pytest.fixture(autouse=True)
def clean_env() -> Iterator[None]:
    """The variables these settings read and write: unset for the test, restored after it."""
    saved = {name: os.environ.pop(name, None) for name in ENV_NAMES}
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


# ------------------------------------------------------------------ qos_priority


def test_qos_priority_of_seed_003_is_accepted() -> None:
    extra = {"qos_priority": 1, "prefill": {"dp_size": 1, "tp_size": 2}, "decode": {"dp_size": 1, "tp_size": 2}}
    assert parse_config("kv_consumer", extra).qos_priority == 1
    assert parse_config("kv_producer", {"qos_priority": 4}).qos_priority == 4
    assert parse_config("kv_producer", {}).qos_priority == 1  # vLLM-Ascend's default


def test_qos_is_merged_into_the_resource_config_keeping_its_other_keys(pd_logs: pytest.LogCaptureFixture) -> None:
    env = {"ASCEND_GLOBAL_RESOURCE_CONFIG": '{"fabric_memory.max_capacity":32,"comm_resource_config.qos":3}'}
    apply_transport_env(parse_config("kv_consumer", {"protocol": "ascend", "qos_priority": 0}), env)
    assert json.loads(env["ASCEND_GLOBAL_RESOURCE_CONFIG"]) == {
        "fabric_memory.max_capacity": 32,
        "comm_resource_config.qos": 0,  # the literal top-level key, replaced
    }
    assert "Injected comm_resource_config.qos=0" in pd_logs.text
    # Absent: created; qos_priority omitted: the default 1 replaces an existing QoS.
    fresh: dict[str, str] = {}
    apply_transport_env(parse_config("kv_producer", {"protocol": "ascend"}), fresh)
    assert json.loads(fresh["ASCEND_GLOBAL_RESOURCE_CONFIG"]) == {"comm_resource_config.qos": 1}
    nested = {"ASCEND_GLOBAL_RESOURCE_CONFIG": '{"comm_resource_config.protocol_desc":["uboe:device"]}'}
    apply_transport_env(parse_config("kv_producer", {"protocol": "ascend", "qos_priority": 2}), nested)
    assert json.loads(nested["ASCEND_GLOBAL_RESOURCE_CONFIG"]) == {
        "comm_resource_config.protocol_desc": ["uboe:device"],
        "comm_resource_config.qos": 2,
    }


def test_qos_leaves_other_transports_alone() -> None:
    env: dict[str, str] = {}
    apply_transport_env(parse_config("kv_producer", {"protocol": "tcp", "qos_priority": 3}), env)
    assert env == {}


@pytest.mark.parametrize("value", [5, -1, True, 1.5, "high", [1]])
def test_bad_qos_is_refused_by_name(value: Any) -> None:
    with pytest.raises(ConfigError, match="qos_priority"):
        parse_config("kv_producer", {"qos_priority": value})


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"qos"'])
def test_malformed_resource_config_fails_before_anything_changes(raw: str) -> None:
    os.environ["ASCEND_GLOBAL_RESOURCE_CONFIG"] = raw
    with pytest.raises(ConfigError, match="ASCEND_GLOBAL_RESOURCE_CONFIG"):
        parse_config("kv_producer", {"protocol": "ascend"})  # the server does not start
    parse_config("kv_producer", {"protocol": "tcp"})  # not read off the ascend transport
    del os.environ["ASCEND_GLOBAL_RESOURCE_CONFIG"]
    cfg = parse_config("kv_producer", {"protocol": "ascend"})
    env = {"ASCEND_GLOBAL_RESOURCE_CONFIG": raw}  # changed after the config was read: the worker checks again
    with pytest.raises(ValueError, match="ASCEND_GLOBAL_RESOURCE_CONFIG"):
        apply_transport_env(cfg, env)
    assert env == {"ASCEND_GLOBAL_RESOURCE_CONFIG": raw}  # no ASCEND_TRANSFER_TIMEOUT either


# ------------------------------------------------------------------ ASCEND_TRANSFER_TIMEOUT


@pytest.mark.parametrize(
    ("hccl", "expected_ms"),
    [
        ({}, 33064),  # 4.096 us * 2**20 * 7 = 30064.77 ms -> 30064 + 3000
        ({"HCCL_RDMA_TIMEOUT": "18", "HCCL_RDMA_RETRY_CNT": "5"}, 8368),  # 4.096 * 2**18 * 5 us = 5368.7 ms
        ({"HCCL_RDMA_TIMEOUT": "5"}, 3000),  # 917.5 us: under a ms
        ({"HCCL_RDMA_RETRY_CNT": "1"}, 7294),
    ],
)
def test_transfer_timeout_is_derived_from_hccl_rdma_as_vllm_ascend(
    hccl: dict[str, str], expected_ms: int, pd_logs: pytest.LogCaptureFixture
) -> None:
    assert transfer_timeout_ms(hccl) == expected_ms
    env = dict(hccl)
    apply_transport_env(parse_config("kv_producer", {"protocol": "ascend"}), env)
    assert env["ASCEND_TRANSFER_TIMEOUT"] == str(expected_ms)
    assert f"ASCEND_TRANSFER_TIMEOUT={expected_ms} ms" in pd_logs.text


def test_a_transfer_timeout_the_user_set_is_kept() -> None:
    env = {"ASCEND_TRANSFER_TIMEOUT": "10000", "HCCL_RDMA_TIMEOUT": "18"}
    apply_transport_env(parse_config("kv_producer", {"protocol": "ascend"}), env)
    assert env["ASCEND_TRANSFER_TIMEOUT"] == "10000"
    tcp: dict[str, str] = {}
    apply_transport_env(parse_config("kv_producer", {"protocol": "tcp"}), tcp)
    assert "ASCEND_TRANSFER_TIMEOUT" not in tcp


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"HCCL_RDMA_TIMEOUT": "twenty"}, "HCCL_RDMA_TIMEOUT"),
        ({"HCCL_RDMA_RETRY_CNT": "-1"}, "HCCL_RDMA_RETRY_CNT"),
        ({"ASCEND_TRANSFER_TIMEOUT": "soon"}, "ASCEND_TRANSFER_TIMEOUT"),
        ({"ASCEND_TRANSFER_TIMEOUT": "0"}, "ASCEND_TRANSFER_TIMEOUT"),
    ],
)
def test_bad_timeout_variables_are_named(env: dict[str, str], name: str) -> None:
    before = dict(env)
    with pytest.raises(ValueError, match=name):
        apply_transport_env(parse_config("kv_producer", {"protocol": "ascend"}), env)
    assert env == before  # nothing written


# ------------------------------------------------------------------ worker: before the engine starts


def _vllm_config() -> SimpleNamespace:
    model = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 4)
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", num_gpu_blocks=12),
        parallel_config=SimpleNamespace(data_parallel_index=0, data_parallel_rank=0, data_parallel_size=1),
        observability_config=SimpleNamespace(otlp_traces_endpoint=None),
        kv_transfer_config=SimpleNamespace(kv_port=14579),  # vLLM's default: a random ZMQ port
    )


class EngineStarted(Exception):
    """Raised by the spy backend factory: the environment the engine would start with was recorded."""


def fake_npu_smi(folder: Path, output: str) -> None:
    """An ``npu-smi`` on PATH that prints ``output`` for ``info -m`` (this machine has no NPU)."""
    script = folder / "npu-smi"
    script.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'info -m' ] || exit 2\ncat <<'EOF'\n{output}EOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_worker_sets_the_ascend_environment_before_the_engine_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: dict[str, str | None] = {}

    def spy(cfg: Any) -> Any:
        seen.update({name: os.environ.get(name) for name in ENV_NAMES})
        raise EngineStarted

    register_backend("env-spy", spy)
    monkeypatch.setattr(worker_mod, "_tp_rank_and_size", lambda: (0, 1))
    fake_npu_smi(tmp_path, NPU_MAP_A3)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "ub_endpoint_npu_8.json").write_text('{"eid": "npu8"}')
    os.environ["ASCEND_GLOBAL_RESOURCE_CONFIG"] = '{"fabric_memory.max_capacity":32}'
    os.environ["HCCL_RDMA_TIMEOUT"] = "18"
    extra = {"backend": "env-spy", "qos_priority": 3, "use_ascend_direct": True}
    cfg = parse_config("kv_consumer", {**extra, "ascend_local_comm_res_path": str(tmp_path)})
    with pytest.raises(EngineStarted):
        PDWorker(cfg, _vllm_config(), None).register_kv_caches(ascend_kv(2))  # type: ignore[arg-type]
    assert json.loads(seen["ASCEND_GLOBAL_RESOURCE_CONFIG"] or "") == {
        "fabric_memory.max_capacity": 32,
        "comm_resource_config.qos": 3,
    }
    assert seen["ASCEND_TRANSFER_TIMEOUT"] == "10516"  # 4.096 us * 2**18 * 7 = 7516.2 ms, + 3000
    # ASCEND_RT_VISIBLE_DEVICES unset, local rank 0: the first physical NPU id npu-smi lists, 8.
    assert seen["ASCEND_LOCAL_COMM_RES"] == '{"eid":"npu8"}'


# ------------------------------------------------------------------ physical NPU id


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        (NPU_MAP_A3, [8, 9]),
        ("NPU ID  Chip ID  Chip Logic ID  Chip Name\n1 0 1 Ascend\n0 0 0 Ascend\n0 1 - Mcu\n", [0, 1]),
        ("NPU ID  Slot ID  Chip ID  Chip Phy-ID  Chip Name\n4 0 0 4 Ascend 910B3\n6 0 0 6 Ascend 910B3\n", [4, 6]),
    ],
)
def test_npu_map_gives_the_physical_ids(text: str, ids: list[int]) -> None:
    assert parse_npu_map(text) == ids


def test_endpoint_file_is_of_the_physical_npu_not_the_local_rank(tmp_path: Path) -> None:
    for npu in (8, 9):
        (tmp_path / f"ub_endpoint_npu_{npu}.json").write_text(json.dumps({"npu": npu}))
    env: dict[str, str] = {}
    assert setup_local_comm_res(str(tmp_path), 1, env, npu_ids=lambda: [9, 8])
    assert json.loads(env["ASCEND_LOCAL_COMM_RES"]) == {"npu": 9}
    # ASCEND_RT_VISIBLE_DEVICES still decides when set.
    assert endpoint_file(str(tmp_path), 0, "9,8", lambda: [0, 1]) == tmp_path / "ub_endpoint_npu_9.json"
    with pytest.raises(ValueError, match=r"local rank 2 has no NPU in this node's NPU ids \[8, 9\]"):
        endpoint_file(str(tmp_path), 2, None, lambda: [8, 9])
    with pytest.raises(ValueError, match="ASCEND_RT_VISIBLE_DEVICES='a,b'"):
        endpoint_file(str(tmp_path), 0, "a,b")


def test_npu_ids_come_from_npu_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_npu_smi(tmp_path, NPU_MAP_A3)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert ascend_env.installed_npu_ids() == [8, 9]
    monkeypatch.setattr(ascend_env, "NPU_SMI", ("pd-no-such-npu-smi", "info", "-m"))
    with pytest.raises(ValueError, match="ASCEND_RT_VISIBLE_DEVICES is unset.*pd-no-such-npu-smi"):
        ascend_env.installed_npu_ids()


# ------------------------------------------------------------------ VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT


def test_abort_timeout_is_p_hold_unless_room_timeout_is_given(pd_logs: pytest.LogCaptureFixture) -> None:
    os.environ["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = "1800"  # vLLM-Ascend's PD guide, long prompts
    assert parse_config("kv_producer", {}).room_timeout_s == 1800.0
    assert "1800 s for D: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT" in pd_logs.text
    assert parse_config("kv_producer", {"room_timeout_s": 60}).room_timeout_s == 60.0
    assert "60 s for D: kv_connector_extra_config.room_timeout_s, not VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT" in (
        pd_logs.text
    )
    del os.environ["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"]
    assert parse_config("kv_producer", {}).room_timeout_s == 480.0  # vLLM-Ascend's default hold


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "inf", "nan"])
def test_bad_abort_timeout_is_named(raw: str) -> None:
    os.environ["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = raw
    with pytest.raises(ConfigError, match=f"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT={raw!r}"):
        parse_config("kv_producer", {})


def test_p_frees_a_room_nobody_asks_for_after_the_abort_timeout(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    os.environ["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = "1.5"
    extra = {"local_ip": HOST, "bootstrap_port": rig.bport, "backend": rig.engines.name, "http_timeout_s": 2.0}
    cfg = parse_config("kv_producer", extra)
    spec = RankSpec(
        tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=BLOCK_SIZE, kv_dtype=DTYPE, num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
    )  # fmt: skip
    kv = rig.engines.p_kv
    mgr = KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NUM_BLOCKS), rig.engines.p)
    p = rig.sides["prefill"] = Side(mgr, kv)  # the rig closes it
    t0 = time.monotonic()
    p.mgr.add_sends([SendJob("p-req", 6061, [1, 2], 32)])
    p.wait_sent("p-req")
    assert 1.4 <= time.monotonic() - t0 < 10
    assert p.stats().rooms_expired == 1 and p.stats().transfers_ok == 0
    assert "no decode asked for this KV within 1.5 s" in pd_logs.text


# ------------------------------------------------------------------ tls_config


def _va_tls(certfile: str, keyfile: str, ca: str, **more: Any) -> dict[str, Any]:
    """vLLM-Ascend's layer-wise connector form."""
    return {"ssl_enable": True, "ssl_certfile": certfile, "ssl_keyfile": keyfile, "ssl_ca_certs": ca, **more}


def _metaserver_tls(cfg: Any) -> tuple[str, str, str, str]:
    return (
        cfg.metaserver_ssl_certfile,
        cfg.metaserver_ssl_keyfile,
        cfg.metaserver_ssl_keyfile_password,
        cfg.metaserver_ssl_ca_certs,
    )


def test_tls_config_is_ds_client_tls_toward_the_metaserver(cert: tuple[str, str], tmp_path: Path) -> None:
    """As vLLM-Ascend's MooncakeLayerwiseConnector: D's metaserver client presents the certificate and
    verifies with the CA (the effect: test_metaserver.py's mutual-TLS metaserver). The bootstrap server's
    TLS is not touched: it keeps its bootstrap_ssl_* keys."""
    certfile, keyfile = cert
    d = parse_config("kv_consumer", {"tls_config": _va_tls(certfile, keyfile, certfile)})
    assert _metaserver_tls(d) == (certfile, keyfile, "", certfile)
    assert (d.bootstrap_ssl_certfile, d.bootstrap_ssl_keyfile, d.bootstrap_ssl_ca_certs) == ("", "", "")
    # A key with a password (vLLM-Ascend's ssl_keyfile_password): it loads, and the password is not in the repr.
    locked = tmp_path / "locked-key.pem"
    key = serialization.load_pem_private_key(Path(keyfile).read_bytes(), None)
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw1")
        )
    )
    d = parse_config(
        "kv_consumer", {"tls_config": _va_tls(certfile, str(locked), certfile, ssl_keyfile_password="pw1")}
    )
    assert _metaserver_tls(d) == (certfile, str(locked), "pw1", certfile) and "pw1" not in repr(d)
    # The CA alone: verify the metaserver, present no certificate.
    d = parse_config("kv_consumer", {"tls_config": {"ssl_enable": True, "ssl_ca_certs": certfile}})
    assert _metaserver_tls(d) == ("", "", "", certfile)
    # The bootstrap keys and tls_config side by side: each its own.
    both = {"tls_config": _va_tls(certfile, keyfile, certfile), "bootstrap_ssl_ca_certs": certfile}
    d = parse_config("kv_consumer", both)
    assert d.bootstrap_ssl_ca_certs == certfile and d.metaserver_ssl_certfile == certfile


def test_tls_config_disabled_means_no_tls(cert: tuple[str, str]) -> None:
    certfile, keyfile = cert
    cfg = parse_config("kv_consumer", {"tls_config": _va_tls(certfile, keyfile, certfile, ssl_enable=False)})
    assert _metaserver_tls(cfg) == ("", "", "", "")
    assert _metaserver_tls(parse_config("kv_consumer", {"tls_config": {}})) == ("", "", "", "")
    # Both forms naming the same file agree.
    same = {"tls_config": _va_tls(certfile, keyfile, certfile), "metaserver_ssl_certfile": certfile}
    assert parse_config("kv_consumer", same).metaserver_ssl_certfile == certfile


def test_tls_config_errors_name_the_keys(cert: tuple[str, str], tmp_path: Path) -> None:
    certfile, keyfile = cert
    other = str(tmp_path / "other.pem")
    Path(other).write_text(Path(certfile).read_text())
    not_pem = str(tmp_path / "not-pem.txt")
    Path(not_pem).write_text("hello")
    cases: list[tuple[dict[str, Any], list[str]]] = [
        (
            {"tls_config": _va_tls(other, keyfile, certfile), "metaserver_ssl_certfile": certfile},
            ["tls_config.ssl_certfile is " + repr(other), "metaserver_ssl_certfile is " + repr(certfile)],
        ),
        (
            {"tls_config": _va_tls(certfile, keyfile, certfile), "metaserver_ssl_ca_certs": other},
            ["tls_config.ssl_ca_certs", "metaserver_ssl_ca_certs"],
        ),
        (
            {"tls_config": {"ssl_enable": False}, "metaserver_ssl_ca_certs": certfile},
            ["tls_config.ssl_enable is false", "metaserver_ssl_ca_certs"],
        ),
        ({"tls_config": {"ssl_enable": True, "ssl_cafile": "x"}}, ["ssl_cafile", "tls_config", "ssl_ca_certs"]),
        ({"tls_config": {"ssl_enable": "yes"}}, ["tls_config.ssl_enable"]),
        ({"tls_config": {"ssl_enable": True, "ssl_ca_certs": 5}}, ["tls_config.ssl_ca_certs"]),
        ({"tls_config": [1]}, ["tls_config", "object"]),
        ({"tls_confg": {}}, ["tls_confg", "known keys", "tls_config"]),
        # A certificate without its key, a password without a key, files that are not there or not PEM.
        ({"tls_config": {"ssl_enable": True, "ssl_certfile": certfile}}, ["metaserver_ssl_keyfile", "ssl_keyfile"]),
        ({"tls_config": {"ssl_enable": True, "ssl_keyfile_password": "pw"}}, ["metaserver_ssl_keyfile_password"]),
        ({"metaserver_ssl_ca_certs": str(tmp_path / "nope.pem")}, ["metaserver_ssl_ca_certs", "nope.pem", "readable"]),
        ({"tls_config": {"ssl_enable": True, "ssl_ca_certs": not_pem}}, ["metaserver_ssl_ca_certs", "not-pem.txt"]),
        ({"tls_config": _va_tls(certfile, not_pem, certfile)}, ["metaserver_ssl_certfile", "not-pem.txt"]),
        ({"tls_config": _va_tls(certfile, keyfile, certfile, ssl_keyfile_password=7)}, ["ssl_keyfile_password"]),
    ]
    for extra, words in cases:
        with pytest.raises(ConfigError) as info:
            parse_config("kv_consumer", extra)
        for word in words:
            assert word in str(info.value), (extra, str(info.value))


def test_settings_module_names_its_extra_keys() -> None:
    assert ascend_settings.EXTRA_KEYS == ("tls_config",)
