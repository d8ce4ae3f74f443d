"""Build a builtin engine from EngineSettings: load the model and tokenizer, size the KV pool, start the loop."""

from __future__ import annotations

import logging
import os

import torch

from parrot.engine.config import ModelConfig
from parrot.engine.engine import EngineThread, LLMEngine
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.local_client import LocalEngineClient
from parrot.engine.model_files import resolve_model_path
from parrot.engine.runner import ModelRunner
from parrot.engine.sampler import Sampler
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.settings import EngineSettings

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# EngineSettings.random_model="tiny" (tests only: engine processes that start in a second and compute fast).
# The head is untied: a random tied head would just echo the last input token.
TINY_RANDOM_CONFIG = ModelConfig(
    name="tiny-random-llama", arch="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
)


def build_engine(settings: EngineSettings, *, model=None, tokenizer=None) -> LLMEngine:
    """Load (or take) the model + tokenizer and start an LLMEngine. ``model``/``tokenizer`` are for tests.

    Everything torch runs on the engine's own thread, which then runs its loop (engine.EngineThread says why)."""
    thread = EngineThread(f"parrot-engine-{settings.name}")
    try:
        engine = thread.call(lambda: _assemble(settings, model, tokenizer, thread))
    except BaseException:
        thread.stop()
        raise
    engine.start()
    return engine


def _assemble(settings: EngineSettings, model, tokenizer, thread: EngineThread) -> LLMEngine:
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    if model is None and settings.random_model == "tiny":
        from parrot.engine.models.llama import build_random_model
        from parrot.engine.tokenizer import load_tokenizer

        model = build_random_model(TINY_RANDOM_CONFIG, dtype=_DTYPES[settings.dtype], device=settings.device,
                                   seed=settings.seed)
        tokenizer = load_tokenizer(resolve_model_path(None))
    if model is None:
        from parrot.engine.models.llama import load_model
        from parrot.engine.tokenizer import load_tokenizer

        path = resolve_model_path(settings.model)
        model = load_model(path, dtype=_DTYPES[settings.dtype], device=settings.device,
                           weight_quant=settings.resolved_weight_quant)
        tokenizer = load_tokenizer(path)
        model_name = os.path.basename(path.rstrip("/"))
    else:
        model_name = model.config.name
    cfg = model.config
    max_len = min(settings.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    bs = settings.block_size
    if settings.kv_cache_tokens is not None:
        num_blocks = -(-settings.kv_cache_tokens // bs)
    else:
        elem = torch.tensor([], dtype=_DTYPES[settings.dtype]).element_size()
        num_blocks = max(1, settings.kv_cache_bytes // ModelRunner.kv_bytes_per_block(cfg, bs, elem))
    pool = BlockPool(num_blocks, bs, enable_prefix_cache=settings.enable_prefix_cache)
    sampler = Sampler(tokenizer.eos_token_ids, base_seed=settings.seed)
    native = _native_ops(settings)
    if model.use_fused_ops(native):  # None (or a float32 model) keeps / restores the torch path
        log.info("engine %s: native fused norm / SwiGLU ops in use", settings.name)
    linears = model.use_native(native is not None)
    vnni = [m.vnni for m in linears if m.vnni is not None]
    if vnni:
        log.info("engine %s: native %s matmul for up to %d rows in %d of %d linear layers", settings.name,
                 vnni[0].backend, vnni[0].max_rows, len(vnni), len(linears))
    int4 = [m.int4 for m in linears if m.int4 is not None]
    if int4:
        log.info("engine %s: native int4 matmul for up to %d rows in %d of %d linear layers", settings.name,
                 int4[0].max_rows, len(int4), len(linears))
    # the native causal prefill: AVX512-BF16 and whole 32-wide head-dim panels (PagedAttention: bf16 models only)
    prefill = (native.causal_prefill if native is not None and native.prefill_attention_available()
               and cfg.head_dim % 32 == 0 else None)
    runner = ModelRunner(model, num_blocks, bs, sampler, shared_prefix_attention=settings.shared_prefix_attention,
                         decode_kernel=None if native is None else native.paged_decode, prefill_kernel=prefill)
    scheduler = Scheduler(pool, settings.max_num_seqs, settings.max_batch_tokens)
    engine = LLMEngine(name=settings.name, model_name=model_name, runner=runner, pool=pool, scheduler=scheduler,
                       tokenizer=tokenizer, max_model_len=max_len, thread=thread)
    log.info("engine %s: model %s, %s, KV pool %d blocks x %d tokens, window %d", settings.name, model_name,
             settings.dtype, num_blocks, bs, max_len)
    return engine


def _native_ops(settings: EngineSettings):
    """The native kernels (``torch.ops.parrot_kernels``: the paged-decode op, the fused norm / SwiGLU ops) per
    ``settings.attention_kernel``, or None for the pure-torch path."""
    from parrot.engine.kernels import KernelBuildError, load_kernels

    if settings.attention_kernel == "torch":
        return None
    if settings.device != "cpu":
        if settings.attention_kernel == "native":
            raise ValueError(f"attention_kernel='native' is a CPU kernel; device is {settings.device!r}")
        return None
    try:
        ops = load_kernels(build_if_missing=settings.attention_kernel == "native")
    except (KernelBuildError, OSError, RuntimeError) as e:
        if settings.attention_kernel == "native":
            raise ValueError(f"attention_kernel='native' is not available: {e}") from e
        log.warning("native kernels failed to load, using the torch path: %s", e)
        return None
    if ops is None:
        log.info("native kernels not built (python -m parrot.engine.kernels); using the torch path")
    return ops


def build_local_engine_client(settings: EngineSettings | None = None, **kw) -> LocalEngineClient:
    return LocalEngineClient(build_engine(settings or EngineSettings(), **kw))
