"""Native CPU kernels (C++ torch ops), built once on the machine that runs them.

``python -m parrot.engine.kernels`` compiles every ``*.cpp`` here (one op family per file, all registered in the
``torch.ops.parrot_kernels`` namespace) with the system C++ compiler against the installed torch
(``scripts/setup.sh`` runs it) into one library in ``_build/`` next to this file, or in
``$XDG_CACHE_HOME/parrot/kernels`` when the package directory is read-only. The library name carries a hash
of the sources, the torch version and the flags, so a stale build is never loaded.

The library links torch's own OpenMP runtime, so its ``at::parallel_for`` shares the intra-op thread pool with
the rest of the model (a second OpenMP runtime would make two sets of threads spin against each other).

Nothing here is required: without a compiler (or with ``attention_kernel="torch"``) the engine uses pure torch
(gather + SDPA for attention, oneDNN for the matmuls), which computes the same results.
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

_DIR = Path(__file__).parent
_CXXFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20", "-fPIC", "-shared", "-w")
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded (the message says why)."""


# what building or loading the library may raise: a failed compile, a missing / unreadable file, a library torch
# refuses (built against another torch, an unknown CPU instruction)
LOAD_ERRORS = (KernelBuildError, OSError, RuntimeError)


def _torch_dirs() -> tuple[Path, list[Path]]:
    import torch

    root = Path(torch.__file__).parent
    return root / "lib", [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]


def sources() -> list[Path]:
    """The C++ sources compiled into the library (sorted, so the hash is stable)."""
    return sorted(_DIR.glob("*.cpp"))


def headers() -> list[Path]:
    """The headers those sources include (part of the hash: a changed header means a new library)."""
    return sorted(_DIR.glob("*.h"))


def library_path() -> Path:
    """Where the compiled library for this source + torch + flags lives (it may not exist yet)."""
    import torch

    digest = hashlib.sha1(torch.__version__.encode() + " ".join(_CXXFLAGS).encode())
    for src in (*sources(), *headers()):
        digest.update(src.name.encode() + src.read_bytes())
    name = f"parrot_kernels-{digest.hexdigest()[:12]}.so"
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
    objs: list[str] = []
    try:
        # one compiler process per source, run side by side, then one link
        procs = []
        for src in sources():
            fd, obj = tempfile.mkstemp(suffix=".o", dir=out.parent)
            os.close(fd)
            objs.append(obj)
            cmd = [cxx, *_CXXFLAGS, "-c", *(f"-I{p}" for p in includes), str(src), "-o", obj]
            procs.append((src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        for src, proc in procs:
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise KernelBuildError(f"compiling {src.name} failed:\n{err[-4000:]}")
        link = [cxx, *_CXXFLAGS, *objs, f"-L{lib_dir}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib_dir}", "-o", tmp]
        proc = subprocess.run(link, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise KernelBuildError(f"linking {out.name} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        for f in (tmp, *objs):
            if os.path.exists(f):
                os.unlink(f)
    log.info("built %s", out)
    return out


def load_kernels(*, build_if_missing: bool = False):
    """The ``torch.ops.parrot_kernels`` namespace, or None when the library is not built (and
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
    return torch.ops.parrot_kernels


def kernels_if_built(op: str | None = None, *, instead: str):
    """The one load-and-fall-back probe the engine's layers share: the ``torch.ops.parrot_kernels`` namespace when
    the library is already built, loads and (if ``op`` is given) has that op; None otherwise, never raising. A
    library that exists but fails to load is logged as a warning ending in ``instead`` (what runs in its place)."""
    try:
        ops = load_kernels(build_if_missing=False)
    except LOAD_ERRORS as e:
        log.warning("native kernels failed to load (%s); %s", e, instead)
        return None
    if ops is None or (op is not None and not hasattr(ops, op)):
        return None
    return ops


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force="--force" in sys.argv[1:])
        load_kernels()
    except LOAD_ERRORS as e:
        log.warning("native kernels not available (the engine falls back to pure torch): %s", e)
        return 0 if "--strict" not in sys.argv[1:] else 1
    log.info("native kernels ready: %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
