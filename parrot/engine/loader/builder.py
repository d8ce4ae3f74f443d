"""Build a builtin engine from EngineSettings: load the model and tokenizer, size the KV pool, start the loop."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

import torch

from parrot.engine.files.config import ModelConfig
from parrot.engine.runtime.cpu import CpuPath, probe_cpu
from parrot.engine.runtime.engine_loop import EngineThread, LLMEngine
from parrot.engine.kv_cache.block_pool import BlockPool
from parrot.engine.kv_cache.host_store import HostStore
from parrot.engine.layers.linear import MatmulKernels
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.engine.files.model_files import resolve_model_path
from parrot.engine.runtime.numerics import KernelSupport, NumericsPlan, choose_path, make_plan
from parrot.engine.runtime.runner import ModelRunner
from parrot.engine.runtime.sampler import Sampler
from parrot.engine.scheduler.scheduler import Scheduler
from parrot.engine.scheduler.policies import EnginePolicyConfig, make_engine_policy
from parrot.engine.runtime import shared_prefix_choice
from parrot.engine.runtime import threads
from parrot.engine.settings import EngineSettings

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# EngineSettings.random_model="tiny" (tests only: engine processes that start in a second and compute fast).
# The head is untied: a random tied head would just echo the last input token.
TINY_RANDOM_CONFIG = ModelConfig(
    name="tiny-random-llama", arch="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
)


def build_engine(settings: EngineSettings, *, model=None, tokenizer=None) -> LLMEngine:
    """Load (or take) the model + tokenizer and start an LLMEngine. ``model``/``tokenizer`` are for tests (a given
    model keeps the matmul paths it was built with).

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
    native = _native_ops(settings)
    cpus = threads.binding(settings.bind_threads, torch.get_num_threads())
    if cpus is not None and native is not None and settings.device == "cpu":
        threads.bind(native, cpus)
    plan = numerics_plan(settings, native)
    log.info("engine %s: %s", settings.name, plan.describe())
    dtype = _DTYPES[plan.dtype]
    kernels = MatmulKernels.for_plan(plan, settings.device, dtype)
    if model is None and settings.random_model == "tiny":
        from parrot.engine.models.assembly import build_random_model
        from parrot.engine.files.tokenizer import load_tokenizer

        # float weights: dense on the bf16 / torch paths, Q8_0 on the fp32 paths' quantized matmul (the "auto" rule)
        model = build_random_model(TINY_RANDOM_CONFIG, dtype=dtype, device=settings.device, seed=settings.seed,
                                   weight_quant=plan.weight_quant, kernels=kernels)
        tokenizer = load_tokenizer(resolve_model_path(None))
    saving: threading.Thread | None = None
    if model is None:
        from parrot.engine.loader.pack_cache import default_dir
        from parrot.engine.models.assembly import load_model
        from parrot.engine.files.tokenizer import load_tokenizer

        path = resolve_model_path(settings.model)
        cache_dir = (settings.pack_cache_dir or str(default_dir())) if settings.pack_cache else None
        model = load_model(path, dtype=dtype, device=settings.device, weight_quant=plan.weight_quant,
                           kernels=kernels, pack_cache_dir=cache_dir, save_cache=False)
        if model.pack_cache is not None:  # written while the engine starts serving (the next start maps it)
            saving = threading.Thread(target=model.pack_cache.save, name="pack-cache-save", daemon=True)
            saving.start()
        tokenizer = load_tokenizer(path)
        model_name = os.path.basename(path.rstrip("/"))
    else:
        model_name = model.config.name
    cfg = model.config
    max_len = min(settings.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    bs = settings.block_size
    kv_dtype = _DTYPES[plan.kv_dtype]
    block_bytes = ModelRunner.kv_bytes_per_block(cfg, bs, torch.tensor([], dtype=kv_dtype).element_size())
    if settings.kv_cache_tokens is not None:
        num_blocks = -(-settings.kv_cache_tokens // bs)
    else:
        num_blocks = max(1, settings.kv_cache_bytes // block_bytes)
    host_slots = settings.swap_space_bytes // block_bytes
    pool = BlockPool(num_blocks, bs, enable_prefix_cache=settings.enable_prefix_cache)
    sampler = Sampler(tokenizer.eos_token_ids, base_seed=settings.seed)
    ops = native if plan.native_ops else None
    if model.use_fused_ops(ops):  # None keeps / restores the torch path
        log.info("engine %s: native fused norm / SwiGLU ops in use", settings.name)
    linears = model.linears()
    for path, count in Counter(lin.path.describe() for lin in linears).items():
        log.info("engine %s: %d of %d linear layers on %s", settings.name, count, len(linears), path)
    # the native causal prefill for the model's dtype (bf16: AVX512-BF16, fp32: AVX2), whole 32-wide head-dim panels
    prefill_here = ops is not None and cfg.head_dim % 32 == 0 and (
        ops.prefill_attention_available() if model.dtype == torch.bfloat16
        else model.dtype == torch.float32 and ops.prefill_attention_fp32_available())
    prefill = ops.causal_prefill if prefill_here else None
    decode_kernel = None if ops is None else ops.paged_decode
    shared = shared_prefix_choice.choose(
        settings.shared_prefix_attention, settings.name, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=model.dtype, kv_dtype=kv_dtype, block_size=bs, scale=cfg.attention_scale,
        decode_kernel=decode_kernel)
    runner = ModelRunner(model, num_blocks, bs, sampler, shared_prefix_attention=shared,
                         decode_kernel=decode_kernel, prefill_kernel=prefill,
                         kv_dtype=kv_dtype, host_blocks=host_slots)
    policy = make_engine_policy(settings.engine_policy, EnginePolicyConfig(priority_groups=settings.priority_groups))
    scheduler = Scheduler(pool, settings.max_num_seqs, settings.max_batch_tokens, policy=policy,
                          host=HostStore(host_slots) if host_slots else None)
    engine = LLMEngine(name=settings.name, model_name=model_name, runner=runner, pool=pool, scheduler=scheduler,
                       tokenizer=tokenizer, max_model_len=max_len, thread=thread, numerics=plan.to_dict())
    engine.tool_pause_ttl_s = settings.tool_pause_ttl_s
    if saving is not None:
        engine.finish_before_shutdown(saving)
    log.info("engine %s: model %s, KV pool %d blocks x %d tokens (%s), window %d, host swap space %d blocks, "
             "engine policy %s", settings.name, model_name, num_blocks, bs, plan.kv_dtype, max_len, host_slots,
             settings.engine_policy)
    return engine


def plan_for(settings: EngineSettings) -> NumericsPlan:
    """The numerics plan an engine built from ``settings`` takes on this machine (nothing is loaded but the
    kernel library)."""
    return numerics_plan(settings, _native_ops(settings))


def numerics_plan(settings: EngineSettings, native) -> NumericsPlan:
    """The engine's numerics plan (parrot.engine.runtime.numerics) from the settings, this CPU and the kernel library
    ``native`` (None: not built or turned off). Raises ValueError (PathUnavailable) for a forced path that cannot
    run here."""
    cpu = probe_cpu()
    if settings.device != "cpu":  # CUDA: torch's kernels in the requested dtype (bf16 by default)
        dtype = settings.dtype if settings.dtype != "auto" else "bfloat16"
        return NumericsPlan(path=CpuPath.PORTABLE, cpu_model=cpu.model, cpu_family=f"{settings.device}", dtype=dtype,
                            kv_dtype=settings.kv_dtype if settings.kv_dtype != "auto" else dtype,
                            weight_quant=settings.weight_quant if settings.weight_quant != "auto" else "none",
                            matmul="torch", native_ops=False)
    if native is not None:
        support: KernelSupport | None = KernelSupport(built=True, vnni_backends=tuple(native.vnni_backends()),
                                                      qmm_variants=tuple(native.qmm_variants()))
    elif settings.attention_kernel == "torch" or settings.cpu_path == "auto":
        support = None  # kernels off or not built: the CPU's path, its dtypes on torch's kernels
    else:
        support = KernelSupport()  # a forced path without the library: choose_path says why it cannot run
    path = choose_path(settings.cpu_path, cpu, support)
    return make_plan(path, cpu, dtype=settings.dtype, kv_dtype=settings.kv_dtype, weight_quant=settings.weight_quant,
                     act_quant=settings.act_quant, native=native is not None,
                     qmm_variants=support.qmm_variants if support is not None else ())


def _native_ops(settings: EngineSettings):
    """The native kernels (``torch.ops.parrot_kernels``: the paged-decode op, the fused norm / SwiGLU ops) per
    ``settings.attention_kernel``, or None for the pure-torch path."""
    from parrot.engine.kernels import LOAD_ERRORS, kernels_if_built, load_kernels

    if settings.attention_kernel == "torch":
        return None
    if settings.device != "cpu":
        if settings.attention_kernel == "native":
            raise ValueError(f"attention_kernel='native' is a CPU kernel; device is {settings.device!r}")
        return None
    if settings.attention_kernel == "native":  # forced: build if missing, and a failure is the caller's error
        try:
            return load_kernels(build_if_missing=True)
        except LOAD_ERRORS as e:
            raise ValueError(f"attention_kernel='native' is not available: {e}") from e
    ops = kernels_if_built(instead="using the torch path")
    if ops is None:
        log.info("native kernels not built (python -m parrot.engine.kernels); using the torch path")
    return ops


def build_local_engine_client(settings: EngineSettings | None = None, **kw) -> LocalEngineClient:
    return LocalEngineClient(build_engine(settings or EngineSettings(), **kw))
