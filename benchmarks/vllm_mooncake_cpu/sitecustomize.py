"""Runtime patches that let vLLM's in-tree MooncakeConnector run on vLLM's CPU build (benchmark only).

`benchmarks/serving.py` puts this directory first on PYTHONPATH of the vLLM-Mooncake P and D
processes (and only theirs), so Python imports this module at start-up. Nothing is patched until
vLLM imports `mooncake_connector`; then each entry of `PATCHES` is applied to that module. The
list is what the benchmark reports as `vllm_mooncake.patches`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

#: What is patched and why, one line each (also printed in the benchmark's JSON).
PATCHES = [
    "torch.accelerator.current_device_index() returns 0 when no accelerator is present "
    "(MooncakeConnectorWorker.__init__ asks for the current device; on CPU torch raises "
    "'Cannot access accelerator device when none is available')",
]


def _patch(module: ModuleType) -> None:
    torch = module.torch
    original = torch.accelerator.current_device_index

    def current_device_index() -> int:
        try:
            return original()
        except RuntimeError:
            return 0

    torch.accelerator.current_device_index = current_device_index


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
