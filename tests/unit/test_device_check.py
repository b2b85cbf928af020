"""scripts/device_check.py on CPU (no GPU here): every case runs end to end and its JSON says what held.

On CPU the forward's kernels are synchronous, so both orderings must be byte-exact and no
corruption can be shown; on a CUDA GPU the script shows it (run it there with the device kit).
The script must also run where vLLM is not installed (the GPU machine has only torch): one test runs
it in a subprocess in which ``import vllm`` fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.py"
SMALL = ["--device", "cpu", "--layers", "3", "--blocks", "8", "--work", "1"]
CASES = {"ordering_mooncake", "mooncake_connector", "d2rh_host_to_device"}
BYTE_CLAIMS = ("byte_exact", "staged_byte_exact", "untouched_intact", "loaded_reported")


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module
    spec.loader.exec_module(module)
    return module


def mooncake_present() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def check_report(report: dict[str, Any], layers: int, mooncake: bool, full: bool = True) -> None:
    """What every CPU report must say: each case present, its claims true, skips with a reason.
    ``full``: the ordering cases through Mooncake and the sweep were asked for (else torch only, no sweep)."""
    json.dumps(report)  # one JSON object
    assert report["gpu"] is False and "no GPU" in report["device"] and "note" in report
    assert report["ordered_byte_exact"] and not report["corruption_without_ordering"]
    backends = ("torch", "mooncake") if mooncake and full else ("torch",)
    runs = {(r["backend"], r["mode"], r["ordering"]): r for r in report["runs"]}
    assert set(runs) == {(b, m, o) for b in backends for m in ("layer", "request") for o in ("on", "off")}
    assert all(r["layers_exact"] == layers and r["layers_stale"] == 0 for r in runs.values())
    assert runs[("torch", "layer", "on")]["path"] == "LayerStreams"  # the real layer-wise push (msgspec installed)

    cases = report["cases"]
    assert set(cases) == CASES
    for name, case in cases.items():
        assert case["name"] == name and case["status"] in ("ok", "skipped"), case
        if case["status"] == "skipped":
            assert case["reason"].strip(), case
    assert (cases["mooncake_connector"]["status"] == "ok") is mooncake
    assert (cases["ordering_mooncake"]["status"] == "ok") is (mooncake and full)
    moved = [cases["d2rh_host_to_device"], *([cases["mooncake_connector"]] if mooncake else [])]
    for case in moved:
        assert case["kv_memory"] == "cpu" and case["layers"] == layers and case["bytes"] > 0
        assert {"byte_exact", "untouched_intact"} <= set(case), case
    for claim in BYTE_CLAIMS:
        assert all(case[claim] is True for case in moved if claim in case), claim
    d2rh = cases["d2rh_host_to_device"]
    assert d2rh["staging_backend"] == ("mooncake" if mooncake else "device_copy")
    assert {"staged_byte_exact", "loaded_reported"} <= set(d2rh)

    swept = report["sweep"]
    if not full:
        assert swept["status"] == "skipped" and swept["reason"] == "--sweep off"
    elif not mooncake:
        assert swept["status"] == "skipped" and swept["reason"].strip() and swept["rows"] == []
    else:
        assert "raw_s_median / connector_s_median" in swept["ratio"] and swept["status"] == "ok"
        assert [(r["kv_memory"], r["block_size"]) for r in swept["rows"]] == [("host", b) for b in (16, 32, 128)]
        for row in swept["rows"]:
            assert row["byte_exact"] is True and "error" not in row, row
            assert isinstance(row["ratio"], float) and row["ratio"] > 0, row
            assert row["connector_gbps"] > 0 and row["raw_gbps"] > 0 and row["bytes"] > 0
    assert report["ok"] is True


def test_device_check_runs_every_case_on_cpu() -> None:
    report = load().main(SMALL)
    check_report(report, layers=3, mooncake=mooncake_present())


def test_device_check_without_mooncake_skips_its_cases_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    check = load()
    transfer = sys.modules["device_check_transfer"]
    for module in (check, transfer):
        monkeypatch.setattr(module, "mooncake_missing", lambda: "mooncake is not importable (test)")
    report = check.main(["--device", "cpu", "--layers", "2", "--blocks", "6", "--work", "1"])
    check_report(report, layers=2, mooncake=False)
    assert report["mooncake"] == "mooncake is not importable (test)"
    assert report["cases"]["mooncake_connector"]["reason"] == report["mooncake"]


def test_device_check_without_layerwise_imports_uses_its_own_pusher(monkeypatch: pytest.MonkeyPatch) -> None:
    load()
    ordering = sys.modules["device_check_ordering"]

    def no_msgspec(*args: object) -> None:
        raise ImportError("no msgspec on the device machine")

    monkeypatch.setattr(ordering, "_layer_streams", no_msgspec)
    result = ordering.run_case(torch.device("cpu"), "layer", True, layers=2, blocks=6, work=1)
    assert result["path"] == "seam" and result["layers_exact"] == 2


def test_device_check_runs_where_vllm_cannot_be_imported(tmp_path: Path) -> None:
    """The GPU machine has torch and no vLLM: nothing the script imports may need it."""
    blocker = tmp_path / "vllm"
    blocker.mkdir()
    (blocker / "__init__.py").write_text('raise ImportError("vllm is not installed on this machine (test)")\n')
    paths = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    argv = [sys.executable, str(SCRIPT), *SMALL, "--ordering-backends", "torch", "--sweep", "off"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)  # stdout is the one JSON object
    assert report["vllm"].startswith("not importable"), report["vllm"]
    check_report(report, layers=3, mooncake=mooncake_present(), full=False)
