"""Print the requirements of the installed `vllm` that a CPU venv can take (one per line).

Used by scripts/setup.sh for .venv-vllm023: vLLM 0.23.0 (vLLM-Ascend 0.23's line) is installed
with --no-deps on the CPU torch of this machine; this lists the rest of its requirements, markers
evaluated, minus the CUDA torch stack and GPU kernels it pins (they have no CPU build here, and
PDConnector's tests need none of them).
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

#: vLLM 0.23's CUDA build: its torch family and GPU kernel packages.
SKIP = re.compile(
    r"^(torch|torchaudio|torchvision|flashinfer.*|apache-tvm-ffi|tilelang|nvidia-.*|fastsafetensors"
    r"|quack-kernels|tokenspeed-mla|humming-kernels|numba|zentorch)$",
    re.IGNORECASE,
)


def cpu_requirements(dist: str = "vllm") -> list[str]:
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if SKIP.match(req.name):
            continue
        out.append(str(req).split(";")[0].strip())
    return out


if __name__ == "__main__":
    print("\n".join(cpu_requirements(*sys.argv[1:])))
