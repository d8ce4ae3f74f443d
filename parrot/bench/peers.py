"""Systems under the engine benchmark: the measurement protocol and the peer runners (HF transformers, llama.cpp).

Protocol (same for every system, see :func:`measure`):

    prefill  : a fresh sequence of P random tokens, time until its KV is written and its last logits exist;
               one untimed warm-up, then ``prefill_repeats`` times (fresh tokens each time: no prefix cache hit).
    decode(N): N sequences of C-token contexts are ready (their fill is untimed); then all N generate K tokens
               greedily at once: the first from the fill's last logits, then K-1 one-token forward steps.
               tok/s = N*K / wall time. One untimed 2-token warm-up run per N, then ``decode_repeats`` timed runs
               (fewer once ``budget_s`` is spent, so slow peers on a busy machine stay bounded);
               after each run the sequences are reset to their C-token contexts.

Peers fill one context and copy its KV to the other N-1 sequences (a physical copy per sequence, untimed):
decode cost does not depend on the token values, and it saves minutes of prefill on this 2-core machine.
The peers run at their fastest honest settings: HF with a manual forward loop over a DynamicCache (no
``generate`` overhead), llama.cpp with its batch API, one KV stream per sequence and one logits row per
sequence per step (as its native server does).
"""

from __future__ import annotations

import abc
import copy
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Protocol:
    prefill_tokens: int = 512
    context_tokens: int = 256
    decode_tokens: int = 32  # K generated tokens per sequence
    batches: tuple[int, ...] = (1, 16, 64)
    prefill_repeats: int = 5
    decode_repeats: int = 2
    budget_s: float = 20.0  # a measurement stops repeating once its timed runs took this long (>= 1 run)
    seed: int = 0


class Runner(abc.ABC):
    """One system under the protocol. Implementations own their model and threads; ``close`` frees them."""

    @abc.abstractmethod
    def prefill_seconds(self, tokens: list[int]) -> float:
        """Compute a fresh sequence of ``tokens``; seconds until its KV and last logits exist. Leaves no state."""

    @abc.abstractmethod
    def prepare_decode(self, contexts: list[list[int]]) -> None:
        """Untimed: make ``len(contexts)`` sequences hold these contexts (peers may copy contexts[0]'s KV)."""

    @abc.abstractmethod
    def decode_seconds(self, batch: int, tokens: int) -> float:
        """Generate ``tokens`` tokens greedily for each of the first ``batch`` prepared sequences, all at once;
        wall seconds. Afterwards the sequences hold their prepared contexts again."""

    @abc.abstractmethod
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step streams from memory (all matmul weights incl. the output head)."""

    @abc.abstractmethod
    def info(self) -> dict:
        """Conditions of this system (dtype / quantization, threads, library versions)."""

    def close(self) -> None:
        """Free the model (default: nothing beyond garbage collection)."""


def random_tokens(rng, n: int, vocab_size: int) -> list[int]:
    """``n`` random ids from the middle of the vocabulary (clear of special/control tokens at the low end)."""
    lo = min(1000, vocab_size // 4)
    return [rng.randrange(lo, vocab_size) for _ in range(n)]


def _stats(samples: list[float]) -> dict:
    return {"best": max(samples), "median": statistics.median(samples), "samples": samples}


def measure(runner: Runner, proto: Protocol, vocab_size: int, log: Callable[[str], None]) -> dict:
    """Run the protocol; returns {"prefill_tok_s": stats, "decode_tok_s": {str(N): stats}} (tok/s values)."""
    import random

    rng = random.Random(proto.seed)
    runner.prefill_seconds(random_tokens(rng, proto.prefill_tokens, vocab_size))  # warm-up
    pre: list[float] = []
    spent = 0.0
    while len(pre) < proto.prefill_repeats and (not pre or spent < proto.budget_s):
        secs = runner.prefill_seconds(random_tokens(rng, proto.prefill_tokens, vocab_size))
        pre.append(proto.prefill_tokens / secs)
        spent += secs
    log(f"prefill {proto.prefill_tokens}: best {max(pre):.1f} tok/s")
    contexts = [random_tokens(rng, proto.context_tokens, vocab_size) for _ in range(max(proto.batches))]
    t0 = time.perf_counter()
    runner.prepare_decode(contexts)
    log(f"decode contexts ready ({len(contexts)} x {proto.context_tokens} tokens, {time.perf_counter() - t0:.1f} s)")
    dec = {}
    for n in proto.batches:
        runner.decode_seconds(n, 2)  # warm-up
        k, rates, spent = proto.decode_tokens, [], 0.0
        while len(rates) < proto.decode_repeats and (not rates or spent < proto.budget_s):
            secs = runner.decode_seconds(n, k)
            rates.append(n * k / secs)
            spent += secs
        dec[str(n)] = _stats(rates)
        log(f"decode batch {n}: best {max(rates):.1f} tok/s")
    return {"prefill_tok_s": _stats(pre), "decode_tok_s": dec}


def gguf_decode_weight_bytes(path: str) -> int:
    """Bytes of all tensors a decode step reads in full: everything but an untied token embedding (gathered)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path, "r").tensors}
    total = sum(tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        total -= tensors["token_embd.weight"]
    return total


def gguf_file_type(path: str) -> str:
    """The GGUF's ``general.file_type`` as a short name ('Q4_1', 'F16', ...), or 'unknown'."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path, "r").fields.get("general.file_type")
    if field is None:
        return "unknown"
    try:
        return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except ValueError:
        return "unknown"


# ---- HF transformers -----------------------------------------------------------------------------------------
def hf_load(gguf_path: str, dtype: str, hf_dir: str | None = None):
    """transformers' model of the GGUF (dequantized by transformers to ``dtype``), or of ``hf_dir`` when given
    (a :func:`hf_convert` cache of the same weights: transformers' GGUF loader takes ~30 s here)."""
    import torch
    from transformers import AutoModelForCausalLM

    if hf_dir is not None:
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=getattr(torch, dtype)
    ).eval()


def hf_convert(gguf_path: str, dtype: str, out_dir: str) -> None:
    """Load the GGUF with transformers once and save its (dequantized) weights + config as an HF safetensors dir
    in ``out_dir``, written atomically. transformers refuses ``save_pretrained`` on a GGUF-loaded model (it
    carries a gguf quantization_config although its weights are plain tensors), so we write the files."""
    import shutil

    from safetensors.torch import save_file

    model = hf_load(gguf_path, dtype)
    tmp = out_dir.rstrip("/") + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: re-created from the embedding at load
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


class HFRunner(Runner):
    """transformers' LlamaForCausalLM of the GGUF's weights (see :func:`hf_load`), eager PyTorch on CPU."""

    def __init__(self, gguf_path: str, dtype: str, threads: int, hf_dir: str | None = None) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.dtype, self.threads = dtype, threads
        self.versions = {"transformers": transformers.__version__, "torch": torch.__version__}
        self.source = "gguf" if hf_dir is None else "safetensors cache of the gguf"
        self.model = hf_load(gguf_path, dtype, hf_dir)
        self._cache = None
        self._first = None

    def _forward(self, ids, cache, keep: int = 1):
        return self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)

    def prefill_seconds(self, tokens: list[int]) -> float:
        from transformers import DynamicCache

        ids = self.torch.tensor([tokens])
        with self.torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            t0 = time.perf_counter()
            self._forward(ids, cache)
            return time.perf_counter() - t0

    def prepare_decode(self, contexts: list[list[int]]) -> None:
        from transformers import DynamicCache

        with self.torch.inference_mode():
            self._cache = DynamicCache(config=self.model.config)
            out = self._forward(self.torch.tensor([contexts[0]]), self._cache)
            self._first = out.logits[:, -1, :].argmax(-1)  # [1]

    def decode_seconds(self, batch: int, tokens: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            cache = copy.deepcopy(self._cache)
            if batch > 1:
                cache.batch_repeat_interleave(batch)  # physical per-sequence copies
            t0 = time.perf_counter()
            tok = self._first.view(1, 1).expand(batch, 1).contiguous()
            for _ in range(tokens - 1):
                logits = self._forward(tok, cache).logits
                tok = logits[:, -1, :].argmax(-1, keepdim=True)
            return time.perf_counter() - t0

    def decode_weight_bytes(self) -> int:
        """Linear layers' weights + the output head (tied or not); the embedding gather is not streamed."""
        seen: set[int] = set()
        total = 0
        for mod in self.model.modules():
            if isinstance(mod, self.torch.nn.Linear) and id(mod.weight) not in seen:
                seen.add(id(mod.weight))
                total += mod.weight.numel() * mod.weight.element_size()
        return total

    def info(self) -> dict:
        return {"dtype": self.dtype, "threads": self.threads, "attn": self.model.config._attn_implementation,
                "loaded_from": self.source, **self.versions}


# ---- llama.cpp (llama-cpp-python low-level API) ------------------------------------------------------------
# llama.cpp's quantizer output formats (LLAMA_FTYPE_MOSTLY_<name>) that need no importance matrix
LLAMA_QUANTS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
                "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def _quiet_llama_logs(lc):
    """Route llama.cpp's log to stderr at WARN and above only; returns the callback (keep it referenced)."""

    @lc.llama_log_callback
    def cb(level, text, _user):
        if level in (3, 4) and text:  # GGML_LOG_LEVEL_WARN, _ERROR (not CONT = 5: the loader's progress dots)
            sys.stderr.write(text.decode("utf-8", "replace"))

    lc.llama_log_set(cb, ctypes.c_void_p(0))
    return cb


def llama_quantize(src: str, dst: str, quant: str, threads: int) -> None:
    """Requantize GGUF ``src`` into ``dst`` as ``quant`` (one of LLAMA_QUANTS) with llama.cpp's quantizer."""
    import llama_cpp as lc

    if quant not in LLAMA_QUANTS:
        raise ValueError(f"quant must be one of {LLAMA_QUANTS}, got {quant!r}")
    _cb = _quiet_llama_logs(lc)
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = threads
    params.allow_requantize = True
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = dst + ".part"
    rc = lc.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src!r} -> {quant}) failed with code {rc}")
    os.replace(tmp, dst)
    del _cb


# Weight layouts llama.cpp repacks into its interleaved CPU kernels on x86 AVX2/AVX-512 (CPU_REPACK buffer).
# Checked on this build: Q4_0 repacks (q4_0_8x8); Q8_0 and Q4_1 have no x86 repack (forcing one crashes the load).
_REPACKABLE = frozenset({"Q4_0", "IQ4_NL", "Q4_K"})
_MATMUL_WEIGHTS = r"^blk\.[0-9]+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$"
LLAMA_BUFFERS = ("repack", "plain")


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_repack_buffer_type(lc) -> int | None:
    """ggml's CPU_REPACK buffer type (from the CPU backend's extra buffer types), or None."""
    libdir = os.path.join(os.path.dirname(lc.__file__), "lib")
    ggml = ctypes.CDLL(os.path.join(libdir, "libggml.so"))
    base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    addr = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                                  b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return None
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)(dev)
    i = 0
    while extra[i]:
        if base.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
            return extra[i]
        i += 1
    return None


def gguf_matmul_types(path: str) -> set[str]:
    """Quantization types of the per-layer matmul weights of a GGUF ('Q4_0', ...)."""
    import re

    from gguf import GGUFReader

    pat = re.compile(_MATMUL_WEIGHTS)
    return {t.tensor_type.name for t in GGUFReader(path, "r").tensors if pat.match(t.name)}


class LlamaCppRunner(Runner):
    """llama.cpp through llama-cpp-python's C API: one context, ``max_seqs`` KV streams of ``seq_ctx`` cells.

    Weight buffers (``buffers``): llama.cpp's default picks its AMX buffer first on CPUs that report AMX, and its
    AMX matmul segfaults on this machine (llama.cpp issue #20824). So extra buffers are off by default
    (llama.cpp's ``--no-repack``) and ``repack`` puts the per-layer matmul weights explicitly in CPU_REPACK
    (the interleaved kernels llama.cpp picks on AVX2/AVX-512 CPUs without AMX) when their format has one;
    ``plain`` never does. ``self.buffers`` says which one ran.
    """

    def __init__(self, gguf_path: str, threads: int, max_seqs: int, seq_ctx: int, n_batch: int = 512,
                 buffers: str = "repack") -> None:
        import llama_cpp as lc

        if buffers not in LLAMA_BUFFERS:
            raise ValueError(f"buffers must be one of {LLAMA_BUFFERS}, got {buffers!r}")
        self.lc, self.path, self.threads = lc, gguf_path, threads
        self._log_cb = _quiet_llama_logs(lc)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.buffers = "plain"
        if buffers == "repack" and gguf_matmul_types(gguf_path) <= _REPACKABLE:
            repack = _cpu_repack_buffer_type(lc)
            if repack is not None:
                self._overrides = (_BuftOverride * 2)(_BuftOverride(_MATMUL_WEIGHTS.encode(), repack),
                                                      _BuftOverride(None, None))
                mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
                self.buffers = "repack"
        mp.use_extra_bufts = False  # keeps AMX out of the default choice for every tensor not overridden
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path!r}")
        cp = lc.llama_context_default_params()
        cp.n_seq_max = max_seqs
        cp.n_ctx = max_seqs * seq_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False  # one KV stream per sequence: attention reads only its own cells
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.flash_attn_type = int(cp.flash_attn_type)
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self._ctx_len = 0
        self._first = 0

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, pos, seq, want_logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")
        self.lc.llama_synchronize(self.ctx)

    def _argmax_rows(self, n: int) -> list[int]:
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def prefill_seconds(self, tokens: list[int]) -> float:
        if len(tokens) > self.n_batch:
            raise ValueError(f"prefill of {len(tokens)} tokens exceeds n_batch {self.n_batch}")
        self.lc.llama_memory_clear(self.mem, True)
        entries = [(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)]
        t0 = time.perf_counter()
        self._decode(entries)
        secs = time.perf_counter() - t0
        self.lc.llama_memory_clear(self.mem, True)
        return secs

    def prepare_decode(self, contexts: list[list[int]]) -> None:
        lc, ctx0 = self.lc, contexts[0]
        lc.llama_memory_clear(self.mem, True)
        for s in range(0, len(ctx0), self.n_batch):
            chunk = ctx0[s : s + self.n_batch]
            self._decode([(t, s + i, 0, s + i == len(ctx0) - 1) for i, t in enumerate(chunk)])
        self._first = self._argmax_rows(1)[0]
        self._ctx_len = len(ctx0)
        for seq in range(1, len(contexts)):
            lc.llama_memory_seq_cp(self.mem, 0, seq, -1, -1)  # queued; copied at the next decode
        self._decode([(self._first, self._ctx_len, s, True) for s in range(len(contexts))])
        for seq in range(len(contexts)):
            lc.llama_memory_seq_rm(self.mem, seq, self._ctx_len, -1)

    def decode_seconds(self, batch: int, tokens: int) -> float:
        pos = self._ctx_len
        t0 = time.perf_counter()
        toks = [self._first] * batch
        for step in range(tokens - 1):
            self._decode([(toks[s], pos + step, s, True) for s in range(batch)])
            toks = self._argmax_rows(batch)
        secs = time.perf_counter() - t0
        for seq in range(batch):
            self.lc.llama_memory_seq_rm(self.mem, seq, pos, -1)
        return secs

    def decode_weight_bytes(self) -> int:
        return gguf_decode_weight_bytes(self.path)

    def info(self) -> dict:
        return {"quant": gguf_file_type(self.path), "threads": self.threads, "buffers": self.buffers,
                "kv_unified": False, "flash_attn_type": self.flash_attn_type, "llama_cpp_python": self.lc.__version__,
                "file": os.path.basename(self.path)}

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)
