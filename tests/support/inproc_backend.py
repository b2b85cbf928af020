"""An in-process TransferBackend for tests: the ``device_copy`` backend with host copies only.

``pd_connector.transfer.device_copy`` already is an in-process backend (a process-global table of
descriptors; entries outside either side's registered memory refused). The tests want host memory
copied with ``ctypes.memmove`` whatever this process has loaded, and the name ``inproc``:
``register_inproc()`` makes it the ``backend: "inproc"``.
"""

from __future__ import annotations

import ctypes

from pd_connector.config import DisaggConfig
from pd_connector.transfer.device_copy import DeviceCopyBackend
from pd_connector.transfer.registry import register_backend

NAME = "inproc"


class InprocBackend(DeviceCopyBackend):
    def __init__(self) -> None:
        super().__init__(copy=ctypes.memmove)


def _factory(cfg: DisaggConfig) -> InprocBackend:
    return InprocBackend()


def register_inproc() -> None:
    register_backend(NAME, _factory)
