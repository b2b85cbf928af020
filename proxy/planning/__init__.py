"""Models for choosing where a request prefills, shared by the Router and ``launch.plan``.

- ``step_model``: per-instance step time (prefill, decode, mixed) and KV push time, fitted by
  least squares and refitted online;
- ``predict``: TTFT and TPOT of one request on each path (PD, LOCAL, DELTA) from live load;
- ``prom_fit``: a best-effort fit of the step model from vLLM's ``/metrics`` histograms.
"""

from proxy.planning.predict import (
    DecoderLoad,
    PairState,
    Path,
    PathModel,
    Prediction,
    PrefillerLoad,
    RequestView,
)
from proxy.planning.step_model import DecodeSample, PrefillSample, StepModel, TransferModel, kv_bytes_per_token

__all__ = [
    "DecodeSample",
    "DecoderLoad",
    "PairState",
    "Path",
    "PathModel",
    "Prediction",
    "PrefillSample",
    "PrefillerLoad",
    "RequestView",
    "StepModel",
    "TransferModel",
    "kv_bytes_per_token",
]
