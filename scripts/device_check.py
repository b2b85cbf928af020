"""Device check: P's KV push and the connector's transfer path on an accelerator (CPU without one). torch only.

    python scripts/device_check.py [--layers 24] [--blocks 64] [--work 16] [--sweep small|big|off]   # one JSON

It needs torch, and Mooncake for the cases that use it (they are reported skipped, with the reason,
when ``mooncake.engine`` does not import); never vLLM (``pd_connector.vllm_lines.bases`` stands in for its
two metadata base classes). On a GPU machine (torch, Mooncake's CUDA build
``mooncake-transfer-engine-cuda13``, msgspec, pyzmq, fastapi, uvicorn): ``python scripts/device_check.py
--sweep big``. The JSON:

- ``runs`` (scripts/device_check_ordering.py): does P's push wait for an asynchronous device? Layer and
  request mode, the ordering on (``device_sync.TorchDeviceSync``) and off (``NO_DEVICE``), the bytes
  moved by torch copies on their own stream and by the project's Mooncake backend; ``layers_stale``
  counts the layers D got before the forward wrote them. On a GPU: ordering on, every layer exact;
  off, stale layers (``corruption_without_ordering``). On CPU kernels are synchronous: both exact.
- ``cases`` (scripts/device_check_transfer.py): ``ordering_mooncake`` (whether those Mooncake runs ran),
  ``mooncake_connector`` (P -> D through the connector's transfer path, KV on the device, byte-exact)
  and ``d2rh_host_to_device`` (P pushes into D's host pool, then ``host_kv.D2RHWorker`` copies it to
  the device: both byte-exact). Each has ``status`` ok / failed (with ``error``) / skipped (with ``reason``).
- ``sweep``: ``benchmarks/transfer.py``'s measurement for 16 / 32 / 128-token blocks, KV in host memory
  and (on a GPU) in device memory; ``ratio`` = raw_s / connector_s, the connector's throughput as a share
  of one raw Mooncake write of the same bytes. ``--sweep small`` (default: a 256 KiB transfer, seconds on
  CPU) or ``big`` (benchmarks/transfer.py's default, 512 MiB a transfer).
- ``own_cost`` (unless ``--sweep off``): ``benchmarks/transfer.py --backend null`` for the 4096-token,
  32-layer request in 16-token blocks: the connector's own CPU per entry (``cpu_us_per_entry``) and per
  transfer (``cpu_ms_per_transfer``) on this machine, no byte moved.
- ``ok``: every claim held (ordered runs exact, no case failed, every byte check exact, ratios > 0 and,
  on a GPU, corruption shown without the ordering); the exit status is 0 exactly then.

Taken on CPU only so far (tests/unit/test_device_check.py runs it in CI); its GPU numbers are still to
be taken with this version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the device_check_* helpers
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # pd_connector, benchmarks

from device_check_ordering import run_case  # noqa: E402
from device_check_transfer import d2rh_copy, mooncake_connector, mooncake_missing, sweep  # noqa: E402

from benchmarks.transfer import DEFAULT_SHAPE  # noqa: E402
from pd_connector.vllm_lines.bases import VLLM_BASES  # noqa: E402

ORDERING_BACKENDS = ("torch", "mooncake")


def _vllm() -> str:
    if not VLLM_BASES:
        return "not importable (vLLM's KV-connector metadata classes): pd_connector.vllm_lines.bases stands in for them"
    import vllm

    return f"vLLM {getattr(vllm, '__version__', '?')} (imported by pd_connector.vllm_lines.bases; not needed)"


def _ordering_run(device: torch.device, mode: str, ordered: bool, args: argparse.Namespace, backend: str) -> dict:
    """One ordering case; one that raised carries the error (and counts as no layer exact)."""
    try:
        return run_case(device, mode, ordered, args.layers, args.blocks, args.work, backend)
    except Exception as exc:  # noqa: BLE001 - the report names the failure instead of dying
        return {"mode": mode, "backend": backend, "ordering": "on" if ordered else "off", "layers": args.layers,
                "layers_exact": 0, "layers_stale": args.layers, "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip


def own_cost(rounds: int) -> dict[str, Any]:
    """The connector's own CPU per transfer and per entry (``benchmarks/transfer.py --backend null``: the
    whole transfer path, no byte moved) for benchmarks/transfer.py's 4096-token, 32-layer request in
    16-token blocks; ``status`` failed with the error when it raised."""
    try:
        from benchmarks.transfer_null import measure_null

        return {"status": "ok", **measure_null(**DEFAULT_SHAPE, block_size=16, rounds=rounds)}
    except Exception as exc:  # noqa: BLE001 - the report names the failure
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}


def _claims_hold(report: dict[str, Any]) -> bool:
    """Every byte check exact, no case failed, every ratio positive (and, on a GPU, corruption shown)."""
    cases = list(report["cases"].values())
    exact = all(c.get(k, True) is True for c in cases for k in ("byte_exact", "staged_byte_exact", "untouched_intact"))
    loaded = all(c.get("loaded_reported", True) is True for c in cases)
    rows = report["sweep"]["rows"]
    sweep_ok = report["sweep"]["status"] != "failed" and all(
        r.get("byte_exact") is True and isinstance(r.get("ratio"), float | int) and r["ratio"] > 0 for r in rows
    )
    return bool(
        report["ordered_byte_exact"]
        and not any("error" in r for r in report["runs"])
        and (report["corruption_without_ordering"] or not report["gpu"])
        and all(c["status"] != "failed" for c in cases)
        and exact
        and loaded
        and sweep_ok
        and report["own_cost"]["status"] != "failed"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="KV layers of the ordering and transfer cases")
    ap.add_argument("--blocks", type=int, default=64, help="KV blocks a layer (half of them are pushed)")
    ap.add_argument("--work", type=int, default=16, help="chained 4096x4096 matmuls before each layer's KV write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ordering-backends", default=",".join(ORDERING_BACKENDS), help="comma list: torch, mooncake")
    ap.add_argument("--sweep", choices=("small", "big", "off"), default="small", help="the transfer-path sweep's size")
    ap.add_argument("--sweep-rounds", type=int, help="timed rounds per sweep point (default 3, big: 5)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.type == "cuda"
    backends = [b.strip() for b in args.ordering_backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(ORDERING_BACKENDS))
    if unknown:
        ap.error(f"--ordering-backends: unknown {unknown}; choose from {ORDERING_BACKENDS}")
    no_mooncake = mooncake_missing()
    t0 = time.perf_counter()
    skip = no_mooncake if "mooncake" in backends else f"--ordering-backends {args.ordering_backends}"
    if skip is not None and "mooncake" in backends:
        backends.remove("mooncake")
    ordering = {"status": "ok"} if skip is None else {"status": "skipped", "reason": skip}
    cases: dict[str, dict[str, Any]] = {"ordering_mooncake": {"name": "ordering_mooncake", **ordering}}
    runs = [
        _ordering_run(device, mode, ordered, args, backend)
        for backend in backends
        for mode in ("layer", "request")
        for ordered in (True, False)
    ]
    cases["mooncake_connector"] = mooncake_connector(device, args.layers, args.blocks)
    cases["d2rh_host_to_device"] = d2rh_copy(device, args.layers, args.blocks)
    if args.sweep == "off":
        swept: dict[str, Any] = {"status": "skipped", "reason": "--sweep off", "rows": []}
        cost: dict[str, Any] = {"status": "skipped", "reason": "--sweep off"}
    else:
        swept = sweep(device, args.sweep, args.sweep_rounds or (5 if args.sweep == "big" else 3))
        cost = own_cost(args.sweep_rounds or 5)
    report: dict[str, Any] = {
        "gpu": gpu,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu (no GPU: CPU kernels are synchronous)",
        "torch": torch.__version__,
        "vllm": _vllm(),
        "mooncake": no_mooncake or "importable",
        "ordered_byte_exact": all(r["layers_stale"] == 0 for r in runs if r["ordering"] == "on"),
        "corruption_without_ordering": any(
            r["layers_stale"] > 0 for r in runs if r["ordering"] == "off" and "error" not in r
        ),
        "runs": runs,
        "cases": cases,
        "sweep": swept,
        "own_cost": cost,
    }
    report["ok"] = _claims_hold(report)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if not gpu:
        report["note"] = "no GPU: everything ran on CPU tensors; corruption without ordering needs an async device"
    return report


if __name__ == "__main__":
    out = main()
    print(json.dumps(out, indent=2))
    sys.exit(0 if out["ok"] else 1)
