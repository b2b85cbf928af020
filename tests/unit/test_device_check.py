"""scripts/device_check.py on CPU (no GPU here): the pipeline runs end to end and says it had no GPU.

On CPU the forward's kernels are synchronous, so both orderings must be byte-exact and no
corruption can be shown; on a CUDA GPU the script shows it (run it there by hand).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module
    spec.loader.exec_module(module)
    return module


def test_device_check_runs_on_cpu_and_says_so() -> None:
    report = load().main(["--device", "cpu", "--layers", "3", "--blocks", "8", "--work", "1"])
    assert report["gpu"] is False and "no GPU" in report["device"] and "note" in report
    assert report["ordered_byte_exact"] and not report["corruption_without_ordering"]
    runs = {(r["mode"], r["ordering"]): r for r in report["runs"]}
    assert set(runs) == {(m, o) for m in ("layer", "request") for o in ("on", "off")}
    assert all(r["layers_exact"] == 3 and r["layers_stale"] == 0 for r in runs.values())
    assert runs[("layer", "on")]["path"] == "LayerStreams"  # the real layer-wise push, where msgspec is installed


def test_device_check_without_layerwise_imports_uses_its_own_pusher(monkeypatch: pytest.MonkeyPatch) -> None:
    check = load()

    def no_msgspec(*args: object) -> None:
        raise ImportError("no msgspec on the device machine")

    monkeypatch.setattr(check, "_layer_streams", no_msgspec)
    import torch

    result = check.run_case(torch.device("cpu"), "layer", True, layers=2, blocks=6, work=1)
    assert result["path"] == "seam" and result["layers_exact"] == 2
