"""Every file of this repository that the docs and the README name exists.

docs/*.md and README.md name modules, scripts and tests by path (``pd_connector/transfer/loads.py``), by a
path inside a package (``transfer/loads.py``) or by file name (``loads.py``), and other files by their path from
the repository root (``benchmarks/results/...json``). Each must be a file of the repository: a full path, or the
end of one. Files a command writes (``trace.png``) are named without a folder and not checked. Files of other projects that
the docs name on purpose (vLLM-Ascend's example proxies, vLLM's sources) are listed in ``FOREIGN``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
#: Trees whose files the docs may name by a path suffix.
TREES = ("pd_connector", "proxy", "launch", "tests", "benchmarks", "scripts", "examples", "docs", ".ci")
#: Files of other projects, named in the docs on purpose.
FOREIGN = {
    "load_balance_proxy_server_example.py",
    "load_balance_proxy_layerwise_server_example.py",
    "sitecustomize.py",
}
#: A file name: word characters, dots, dashes and slashes, ending in one of these extensions.
_NAME = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh|md|json|png))\b")


def _files() -> list[str]:
    out = []
    for tree in TREES:
        root = REPO / tree
        if root.is_dir():
            out += [p.relative_to(REPO).as_posix() for p in root.rglob("*") if p.is_file()]
    return out


def _names(text: str) -> set[str]:
    text = text.replace("[_body]", "")  # first_token[_body].py names first_token.py and first_token_body.py
    names = {m.group(1) for m in _NAME.finditer(text)}
    return {n for n in names if n.endswith((".py", ".sh")) or n.split("/", 1)[0] in TREES and "/" in n}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_file_exists(doc: Path) -> None:
    files = _files()
    missing = []
    for name in sorted(_names(doc.read_text())):
        base = name.rsplit("/", 1)[-1]
        if base in FOREIGN or name.startswith(("http", "www.")):
            continue
        if (REPO / name).exists() or (doc.parent / name).exists():
            continue
        if any(f.endswith("/" + name) for f in files):
            continue
        missing.append(name)
    assert not missing, f"{doc.relative_to(REPO)} names files that do not exist: {missing}"


def test_names_are_found() -> None:
    text = "`pd_connector/transfer/loads.py`, `request/loop.py`, first_token[_body].py, docs/a.md; not http://x.py, out.png"
    assert _names(text) == {"pd_connector/transfer/loads.py", "request/loop.py", "first_token.py", "docs/a.md"}
