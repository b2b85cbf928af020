"""examples/grafana/pd-dashboard.json: valid JSON whose queries name only metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pd_connector.metrics import METRIC_NAMES

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "pd-dashboard.json"
ROUTER_METRICS = Path(__file__).resolve().parents[1] / "proxy" / "router_metrics.py"


def test_dashboard_queries_use_real_metric_names() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 8 and exprs
    used = {m for e in exprs for m in re.findall(r"(vllm:pd_kv_\w+|pd_router_\w+)", e)}
    router = set(re.findall(r'"(pd_router_\w+)"', ROUTER_METRICS.read_text()))
    suffixes = ("_total", "_bucket", "_sum", "_count")
    known = {n + s for n in router | set(METRIC_NAMES.values()) for s in ("", *suffixes)}
    assert used <= known, used - known
    assert {m for m in used if m.startswith("vllm:")} >= {METRIC_NAMES["bytes_sent"] + "_total"}
