"""coda: fused LLaMA-block GEMM + epilogue kernels for PyTorch.

Importing this package loads ``libcoda_torch.so``, which registers the ``torch.ops.coda.*`` ops
(see docs/torch-ops.md). ``coda.ops`` wraps them, ``coda.nn`` builds a LLaMA model from them and
``coda.convert`` maps Hugging Face / TorchTitan checkpoints to and from it and
``coda.integrations.patch_hf`` runs a Hugging Face model on the ops in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__version__ = "0.1.0"

_LIB_NAME = "libcoda_torch.so"
_ENV_VAR = "CODA_TORCH_LIBRARY"


def _candidate_paths() -> list[Path]:
    pkg = Path(__file__).resolve().parent
    repo = pkg.parent.parent  # <repo>/python/coda -> <repo>, when running from the source tree
    return [
        pkg / "lib" / _LIB_NAME,  # where `pip install .` puts it
        repo / "build-torch" / "torch" / _LIB_NAME,
        repo / "build" / "torch" / _LIB_NAME,
    ]


def _already_registered() -> bool:
    # Loading a second copy of the library would fail on duplicate op registration.
    try:
        torch.ops.coda.rmsnorm_stats
    except (AttributeError, RuntimeError):
        return False
    return True


def _load_library() -> Path | None:
    if _already_registered():
        return None
    explicit = os.environ.get(_ENV_VAR)
    if explicit:
        # An explicit path that does not exist is an error rather than a silent fallback to
        # some other build.
        path = Path(explicit).resolve()  # absolute: it is reported and reused by subprocesses
        if not path.is_file():
            raise ImportError(f"coda: {_ENV_VAR}={explicit!r} is not a file")
        torch.ops.load_library(str(path))
        return path
    candidates = _candidate_paths()
    for path in candidates:
        if path.is_file():
            torch.ops.load_library(str(path))
            return path
    looked = "\n  ".join([f"${_ENV_VAR} (not set)"] + [str(p) for p in candidates])
    raise ImportError(
        f"coda: could not find {_LIB_NAME}. Looked in:\n  {looked}\n"
        f"Build it (cmake target coda_torch) or set {_ENV_VAR} to its path."
    )


library_path = _load_library()

from . import _inductor  # noqa: E402

_inductor.install()

from . import convert, integrations, nn, ops  # noqa: E402  (the ops must be registered first)

__all__ = ["ops", "nn", "convert", "integrations", "library_path", "__version__"]
