"""Where vLLM-Ascend's unmodified proxy scripts are: one setting, ``PDC_VLLM_ASCEND_PEERS``.

Some tests and ``benchmarks/router.py`` run vLLM-Ascend's own example proxy
(``load_balance_proxy_server_example.py``, vllm-ascend 0.23.0.post1, unmodified) in front of
PDConnector. Those scripts are not part of this repository. ``PDC_VLLM_ASCEND_PEERS`` names the
folder holding them, or a folder holding a ``vllm-ascend-0.23.0.post1/`` folder with them;
``.ci/run`` sets it when the CI machine has them. When it is unset or wrong, :func:`example_proxy`
returns ``None`` with the reason, and the callers say so (tests skip, or fail when ``CI=true``).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "PDC_VLLM_ASCEND_PEERS"
#: The vLLM-Ascend release whose scripts are run, and its folder name inside a peers folder.
RELEASE_DIR = "vllm-ascend-0.23.0.post1"
EXAMPLE_PROXY = "load_balance_proxy_server_example.py"


def example_proxy(environ: dict[str, str] | None = None) -> tuple[Path | None, str]:
    """(path of vLLM-Ascend's example proxy, "") or (None, why it is not available)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "").strip()
    if not value:
        return None, (
            f"{ENV_VAR} is not set: set it to the folder holding vLLM-Ascend's {EXAMPLE_PROXY} "
            f"({RELEASE_DIR}, unmodified) to run the tests and benchmark targets that use it"
        )
    root = Path(value).expanduser()
    for folder in (root, root / RELEASE_DIR):
        if (folder / EXAMPLE_PROXY).is_file():
            return folder / EXAMPLE_PROXY, ""
    return None, f"{ENV_VAR}={value} holds no {EXAMPLE_PROXY} (looked in it and in its {RELEASE_DIR}/)"


def required(environ: dict[str, str] | None = None) -> bool:
    """True under CI (``CI=true``): there the scripts must be present, and their absence is a failure."""
    env = os.environ if environ is None else environ
    return env.get("CI", "").strip().lower() == "true"
