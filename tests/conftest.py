"""Shared fixtures. Kept torch-free so tests of the torch-free core do not pay the torch import."""

from __future__ import annotations

import os
import tempfile

import pytest

from parrot.common.errors import ModelNotFound
from parrot.engine.files.config import ModelConfig

# engines the tests build (in-process and in subprocesses, which inherit the environment) keep their packed-weight
# caches in a temporary dir of this run, not in the user's ~/.cache
os.environ.setdefault("PARROT_ENGINE_PACK_CACHE_DIR", tempfile.mkdtemp(prefix="parrot-test-packed-"))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default SmolLM2 GGUF; skips the test (with the install hint) if the wheel is missing."""
    from parrot.engine.files.model_files import default_model_path as find_default

    try:
        return find_default()
    except ModelNotFound as exc:
        pytest.skip(f"default model missing: {exc}")


@pytest.fixture
def tiny_config() -> ModelConfig:
    """A tiny LLaMA (2 layers, GQA 4:2, untied head) for shape and round-trip tests with random weights."""
    return ModelConfig(
        name="tiny-llama", arch="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
    )


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module single-threaded: on the shared 2-core box two intra-op threads stall on each other under
    load (5-10x slower). Opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def native_kernel():
    """The native paged-decode op (parrot.engine.kernels), built if missing. Skips only on a machine without a
    C++ compiler; with one, a failed build fails the test."""
    import shutil

    from parrot.engine.kernels import load_kernels

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler: the engine runs the pure-torch attention path here")
    return load_kernels(build_if_missing=True).paged_decode
