"""Native CPU kernels (C++ torch ops), built once on the machine that runs them.

``python -m parrot.engine.kernels`` compiles ``paged_attention.cpp`` with the system C++ compiler against the
installed torch (``scripts/setup.sh`` runs it) into ``_build/`` next to this file, or into
``$XDG_CACHE_HOME/parrot/kernels`` when the package directory is read-only. The library name carries a hash
of the source, the torch version and the flags, so a stale build is never loaded.

The library links torch's own OpenMP runtime, so its ``at::parallel_for`` shares the intra-op thread pool with
the rest of the model (a second OpenMP runtime would make two sets of threads spin against each other).

Nothing here is required: without a compiler (or with ``attention_kernel="torch"``) the engine uses the
pure-torch gather + SDPA path, which computes the same attention.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_CXXFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20", "-fPIC", "-shared", "-w")
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded (the message says why)."""


def _torch_dirs() -> tuple[Path, list[Path]]:
    import torch

    root = Path(torch.__file__).parent
    return root / "lib", [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]


def library_path() -> Path:
    """Where the compiled library for this source + torch + flags lives (it may not exist yet)."""
    import torch

    digest = hashlib.sha1(_SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_CXXFLAGS).encode())
    name = f"paged_attention-{digest.hexdigest()[:12]}.so"
    local = Path(__file__).with_name("_build")
    if os.access(Path(__file__).parent, os.W_OK):
        return local / name
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parrot" / "kernels" / name


def build(force: bool = False) -> Path:
    """Compile the kernels if needed; returns the library path. Raises KernelBuildError."""
    out = library_path()
    if out.exists() and not force:
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (set CXX or install g++)")
    lib_dir, includes = _torch_dirs()
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile to a temp file in the same directory, then rename: concurrent builders never see half a library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_CXXFLAGS, *(f"-I{p}" for p in includes), str(_SOURCE), f"-L{lib_dir}", "-ltorch_cpu", "-lc10",
           f"-Wl,-rpath,{lib_dir}", "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling {_SOURCE.name} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", out)
    return out


def load_paged_decode(*, build_if_missing: bool = False):
    """The ``paged_decode`` op (see paged_attention.cpp), or None when the library is not built (and
    ``build_if_missing`` is False). Raises KernelBuildError when a build was asked for and failed."""
    import torch

    with _lock:
        path = library_path()
        key = str(path)
        if key not in _loaded:
            if not path.exists():
                if not build_if_missing:
                    return None
                build()
            torch.ops.load_library(key)
            _loaded[key] = True
    return torch.ops.parrot_kernels.paged_decode


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force="--force" in sys.argv[1:])
        load_paged_decode()
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("native kernels not available (the engine falls back to pure torch): %s", e)
        return 0 if "--strict" not in sys.argv[1:] else 1
    log.info("native kernels ready: %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
