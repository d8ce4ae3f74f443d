"""Engine benchmark: the builtin engine vs HF transformers vs llama.cpp on one GGUF, plus the machine's peak.

    python -m parrot.bench.engine [--systems ours,hf,llamacpp] [--quick] [--out bench_out/engine]
                                  [--cpu-path auto] [--dtype auto] [--weight-quant auto] [--act-quant auto]
                                  [--ours-variants default,act_quant=int8,cpu_path=avx2+act_quant=int8]

Every system (and the machine-peak measure) runs in its own subprocess, one after the other
(``python -m parrot.bench.engine --worker NAME ...`` prints one JSON line), so thread settings and the max
RSS (``os.wait4``'s ru_maxrss of that child) are clean. The protocol is in :mod:`parrot.bench.peers`.

Ours runs once per ``--ours-variants`` spec (worker ``ours`` for ``default``, ``ours:<spec>`` for a ``+``-joined
list of EngineSettings overrides applied on top of the ``--cpu-path / --dtype / --weight-quant / --act-quant``
flags). Each engine picks its numerics plan at start (parrot.engine.numerics); its label names the plan's CPU path
and numerics (e.g. "ours avx2 int8x2", "ours avx512_bf16 bf16/int4"), its info carries the whole plan, and the
ratio table has one block of rows per ours variant ("<ours label> / <peer>"). The conditions name the CPU model,
its family and the CPU paths it can run.

Share of peak (stated with the table):
    useful FLOPs per generated token = 2 * (matmul params incl. the output head)
                                       + 4 * layers * n_heads * head_dim * L   (QK^T and PV over L tokens)
    with L = context + K/2 (mean attended length while generating K tokens); at the largest batch, as % of the
    bf16 and the fp32 matmul peaks (torch.matmul) and of the int8 dot-product peak (a synthetic VPMADDUBSW loop,
    kernels/peak.cpp; a FLOP counts as one op, a u8 x s8 multiply-add as two);
    batch-1 bandwidth = weight bytes a decode step streams (its own format) * tok/s, as % of memory read GB/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict

from parrot.bench.peers import Protocol, Runner

log = logging.getLogger("parrot.bench.engine")

DEFAULT_HF_DTYPES = ("float32", "bfloat16")
DEFAULT_LLAMA_VARIANTS = ("file", "Q4_0", "Q8_0")  # "file" = the GGUF as given (Q4_1 by default)
# EngineSettings fields the benchmark sets itself (an ours variant may override any other field)
BENCH_SETTINGS = frozenset({"model", "num_threads", "max_num_seqs", "max_batch_tokens", "kv_cache_tokens",
                            "kv_cache_bytes", "random_model", "name"})
# ours' flags: EngineSettings field -> the driver's option
OURS_FLAGS = {"cpu_path": "--cpu-path", "dtype": "--dtype", "weight_quant": "--weight-quant",
              "act_quant": "--act-quant"}


# ---- ours variants and labels -------------------------------------------------------------------------------
def parse_variant_spec(spec: str) -> dict[str, str]:
    """One ``--ours-variants`` spec -> its EngineSettings overrides: ``default`` -> {}, ``k=v+k2=v2`` -> {k: v, k2:
    v2} (values as strings; EngineSettings converts them). Raises ValueError naming the spec."""
    from parrot.engine.settings import EngineSettings

    spec = spec.strip()
    if spec in ("", "default"):
        return {}
    out: dict[str, str] = {}
    for item in spec.split("+"):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"ours variant {spec!r}: {item!r} is not key=value")
        if key in BENCH_SETTINGS:
            raise ValueError(f"ours variant {spec!r}: {key} is set by the benchmark itself")
        if key not in EngineSettings.model_fields:
            raise ValueError(f"ours variant {spec!r}: unknown setting {key!r} (EngineSettings fields: "
                             f"{', '.join(sorted(set(EngineSettings.model_fields) - BENCH_SETTINGS))})")
        if key in out:
            raise ValueError(f"ours variant {spec!r}: {key} given twice")
        out[key] = value
    return out


def variant_worker(overrides: dict[str, str]) -> str:
    """The worker name of an ours variant: ``ours`` for the default settings, else ``ours:k=v+k2=v2``."""
    return "ours" if not overrides else "ours:" + "+".join(f"{k}={v}" for k, v in overrides.items())


def ours_settings(base: dict, overrides: dict, **bench):
    """The EngineSettings of one ours variant: the ours flags (``base``), then the variant's overrides, then the
    benchmark's own sizing (``bench``). Raises pydantic's ValidationError for a bad value."""
    from parrot.engine.settings import EngineSettings

    return EngineSettings(**{**base, **overrides, **bench})


def parse_ours_variants(text: str, base: dict) -> dict[str, dict[str, str]]:
    """``--ours-variants`` (comma-separated specs) -> {worker name: overrides}, in the given order, duplicates
    dropped. Every variant is validated with EngineSettings (on top of ``base``, the ours flags) and a forced
    ``cpu_path`` against this CPU's features. Raises ValueError naming the bad spec."""
    from pydantic import ValidationError

    from parrot.engine.cpu import CpuPath, probe_cpu

    out: dict[str, dict[str, str]] = {}
    specs = [x.strip() for x in text.split(",") if x.strip()]
    if not specs:
        raise ValueError("no ours variant given (use 'default' for the default settings)")
    for spec in specs:
        overrides = parse_variant_spec(spec)
        try:
            settings = ours_settings(base, overrides)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ())) or "settings"
            raise ValueError(f"ours variant {spec!r}: {where}: {err['msg']}") from None
        if settings.cpu_path != "auto" and settings.device == "cpu":
            missing = probe_cpu().missing(CpuPath(settings.cpu_path))
            if missing:
                raise ValueError(f"ours variant {spec!r}: cpu_path={settings.cpu_path} needs CPU features this "
                                 f"{probe_cpu().model} lacks: {', '.join(missing)}")
        out.setdefault(variant_worker(overrides), overrides)
    return out


def _short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)


def plan_label(plan: dict) -> str:
    """Short label of an ours system from its numerics plan (NumericsPlan.to_dict()): the CPU path, then the
    activation quantization on the integer-dot matmuls ("ours avx2 int8x2") or compute dtype / weight quant
    elsewhere ("ours avx512_bf16 bf16/int4"); a forced weight_quant on the integer-dot path and native kernels
    turned off on a native path are named too."""
    path = plan.get("path", "?")
    if str(plan.get("matmul", "")).startswith("qdot"):
        label = f"ours {path} {plan.get('act_quant', '?')}"
        if plan.get("weight_quant", "auto") != "auto":
            label += f" w={plan['weight_quant']}"
    else:
        label = f"ours {path} {_short_dtype(plan.get('dtype', '?'))}/{plan.get('weight_quant', '?')}"
        if path != "portable" and plan.get("native_ops") is False:
            label += " torch-kernels"
    return label


def _is_ours(worker: str) -> bool:
    return worker.partition(":")[0] == "ours"


def _ours_spec(worker: str) -> str:
    return worker.partition(":")[2] or "default"


# ---- ours -------------------------------------------------------------------------------------------------------
class OursRunner(Runner):
    """The builtin engine in-process, driven through its public fill / generate / free_context API."""

    def __init__(self, model_path: str, *, base: dict, overrides: dict, threads: int, proto: Protocol) -> None:
        """``base``: the ours flags (cpu_path, dtype, weight_quant, act_quant); ``overrides``: this variant's
        EngineSettings overrides on top of them."""
        from parrot.engine.builder import build_engine

        n = max(proto.batches)
        # peak KV use: n parents of C tokens + n children of K tokens, each rounded up to whole blocks (+1 block
        # of slack per sequence), plus one prefill context; sized tightly so the pool does not inflate max RSS
        per_seq = proto.context_tokens + proto.decode_tokens + 2 * 16
        self.overrides = dict(overrides)
        self.settings = ours_settings(
            base, overrides, model=model_path, num_threads=threads, max_num_seqs=n,
            max_batch_tokens=max(512, proto.prefill_tokens), kv_cache_tokens=n * per_seq + proto.prefill_tokens + 16,
        )
        self.engine = build_engine(self.settings)
        self._n = 0
        self._parents: list[str] = []

    def _cid(self, kind: str) -> str:
        self._n += 1
        return f"bench-{kind}-{self._n}"

    def prefill_seconds(self, tokens: list[int]) -> float:
        cid = self._cid("prefill")
        t0 = time.perf_counter()
        self.engine.fill(tokens, cid).result()
        secs = time.perf_counter() - t0
        self.engine.free_context(cid).result()
        return secs

    def prepare_decode(self, contexts: list[list[int]]) -> None:
        self._parents = [self._cid("ctx") for _ in contexts]
        futs = [self.engine.fill(toks, cid) for toks, cid in zip(contexts, self._parents)]
        for f in futs:
            f.result()

    def decode_seconds(self, batch: int, tokens: int) -> float:
        from parrot.common.sampling import SamplingParams

        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        # each child forks its own parent (no prefix shared between sequences), so the parents stay at C tokens
        kids = [self._cid("gen") for _ in range(batch)]
        t0 = time.perf_counter()
        futs = [self.engine.generate(sp, kid, parent) for kid, parent in zip(kids, self._parents)]
        results = [f.result() for f in futs]
        secs = time.perf_counter() - t0
        for kid in kids:
            self.engine.free_context(kid).result()
        short = [len(r.token_ids) for r in results if len(r.token_ids) != tokens]
        if short:
            raise RuntimeError(f"ours generated {short} tokens instead of {tokens} (ignore_eos)")
        return secs

    def decode_weight_bytes(self) -> int:
        """Per FastLinear: the quantized weight a one-row decode step streams when it has one (the native int4
        form, codes and scales in one tensor, or torch's int4 / int8 weight + scales), else its dense weight; per
        QDotLinear (integer-dot paths): its packed codes + scales (or the dense weight with native kernels off)."""
        from parrot.engine.layers.linear import FastLinear
        from parrot.engine.layers.qdot import QDotLinear

        total = 0
        for mod in self.engine.runner.model.modules():
            if isinstance(mod, QDotLinear):
                total += mod.packed.nbytes if mod.qdot is not None else mod.dense_weight().nbytes
            elif isinstance(mod, FastLinear):
                dense = mod.out_features * mod.in_features * mod.dtype.itemsize  # dense or packed, same bytes
                if mod.int4 is not None:
                    total += mod.int4_weight.nbytes
                elif mod.qweight is not None:
                    total += mod.qweight.nbytes + mod.scales.nbytes
                else:
                    total += dense
        return total

    def numerics(self) -> dict:
        """The engine's numerics plan as it runs (NumericsPlan.to_dict())."""
        plan = getattr(self.engine, "numerics", None)
        return dict(plan) if plan else dict(self.engine.status().extra.get("numerics", {}))

    def info(self) -> dict:
        import torch

        s = self.settings
        return {"variant": variant_worker(self.overrides).partition(":")[2] or "default",
                "settings": {k: getattr(s, k) for k in (*OURS_FLAGS, "kv_dtype", "attention_kernel")},
                "numerics": self.numerics(), "threads": s.num_threads,
                "max_num_seqs": s.max_num_seqs, "max_batch_tokens": s.max_batch_tokens,
                "kv_cache_tokens": s.kv_cache_tokens, "torch": torch.__version__,
                "attention_kernel": "native" if self.engine.runner.decode_kernel is not None else "torch",
                "preemptions": self.engine.status().num_preempted_total}

    def close(self) -> None:
        self.engine.shutdown()


# ---- workers (run in a subprocess each) ---------------------------------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _make_runner(args, proto: Protocol) -> Runner:
    from parrot.bench import peers

    kind, _, variant = args.worker.partition(":")
    if kind == "ours":
        return OursRunner(args.model, base=_ours_base(args), overrides=parse_variant_spec(variant),
                          threads=args.threads, proto=proto)
    if kind == "hf":
        return peers.HFRunner(args.model, variant, args.threads, hf_dir=args.hf_dir)
    if kind == "llamacpp":
        seq_ctx = -(-max(proto.prefill_tokens, proto.context_tokens + proto.decode_tokens + 1) // 256) * 256
        return peers.LlamaCppRunner(args.model, args.threads, max(proto.batches), seq_ctx,
                                    n_batch=max(512, proto.prefill_tokens), buffers=args.llama_buffers)
    raise ValueError(f"unknown worker {args.worker!r}")


def run_worker(args) -> dict:
    """Body of ``--worker``: measure one system (or the machine) and return its JSON-able result."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker == "machine":
        from parrot.bench.machine import measure_peak

        # --quick: n = 1024 (on a CPU without bf16 dot products torch's bf16 matmul runs ~1 GFLOP/s: 1536 took
        # ~8 s per run there, 2048 ~19 s)
        n, mib, reps, int8_s = (1024, 512, 3, 0.25) if args.quick else (2048, 1024, 5, 1.0)
        peak = measure_peak(args.threads, matmul_n=n, mem_mib=mib, repeats=reps, int8_seconds=int8_s)
        return {"system": "machine", "ok": True, **peak.to_dict()}
    kind, _, variant = args.worker.partition(":")
    # import each system's libraries before the "after_import" RSS sample, so it is the same baseline for all
    if kind in ("hf", "hfconvert"):
        import transformers

        transformers.utils.logging.set_verbosity_error()
    elif kind == "ours":
        import parrot.engine.builder  # noqa: F401  (torch + the engine)
    elif kind in ("llamacpp", "quantize"):
        import llama_cpp  # noqa: F401
    if kind in ("quantize", "hfconvert"):  # one-time preparation of a peer's model file, in its own process
        from parrot.bench.peers import hf_convert, llama_quantize

        if kind == "quantize":
            llama_quantize(args.model, args.prep_out, variant, args.threads)
        else:
            hf_convert(args.model, variant, args.prep_out)
        return {"system": args.worker, "ok": True, "path": args.prep_out}
    from parrot.bench.peers import measure
    from parrot.engine.config import read_model_config

    proto = _protocol(args)
    vocab = read_model_config(args.model).vocab_size
    t0 = time.perf_counter()
    rss_import = _rss_mib()
    runner = _make_runner(args, proto)
    rss_loaded = _rss_mib()
    log.info("%s loaded in %.1f s (RSS %.0f MiB)", args.worker, time.perf_counter() - t0, rss_loaded)
    try:
        res = measure(runner, proto, vocab, lambda m: log.info("%s: %s", args.worker, m))
        out = {"system": args.worker, "ok": True, **res, "weight_bytes_per_token": runner.decode_weight_bytes(),
               "info": runner.info()}
    finally:
        runner.close()
    out["rss_mib"] = {"after_import": rss_import, "after_load": rss_loaded, "max": _max_rss_mib()}
    out["wall_s"] = time.perf_counter() - t0
    return out


def _protocol(args) -> Protocol:
    return Protocol(prefill_tokens=args.prefill_tokens, context_tokens=args.context_tokens,
                    decode_tokens=args.decode_tokens, batches=tuple(args.batches),
                    prefill_repeats=2 if args.quick else args.prefill_repeats,
                    decode_repeats=1 if args.quick else args.decode_repeats, budget_s=args.budget)


# ---- driver ---------------------------------------------------------------------------------------------------
def _worker_cmd(args, worker: str, **extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "parrot.bench.engine", "--worker", worker, "--model", args.model,
           "--threads", str(args.threads), *(x for k, flag in OURS_FLAGS.items() for x in (flag, getattr(args, k))),
           "--prefill-tokens", str(args.prefill_tokens), "--context-tokens", str(args.context_tokens),
           "--decode-tokens", str(args.decode_tokens), "--prefill-repeats", str(args.prefill_repeats),
           "--decode-repeats", str(args.decode_repeats), "--budget", str(args.budget),
           "--batches", ",".join(map(str, args.batches)), "--llama-buffers", args.llama_buffers]
    if args.quick:
        cmd.append("--quick")
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    return cmd


def run_subprocess(cmd: list[str], timeout: float, threads: int) -> tuple[dict | None, float, str]:
    """Run one worker (stderr passes through); returns (its JSON result or None, its max RSS in MiB from
    ``os.wait4``, error text). A worker past ``timeout`` seconds is killed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, env=env, text=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    timed_out = reader.is_alive()
    if timed_out:
        proc.kill()
        reader.join(10)
    _, status, usage = os.wait4(proc.pid, 0)  # per-child rusage (RUSAGE_CHILDREN would be a running max)
    proc.returncode = os.waitstatus_to_exitcode(status)
    max_rss = usage.ru_maxrss / 1024
    if timed_out:
        return None, max_rss, f"timed out after {timeout:.0f} s"
    for line in reversed("".join(chunks).splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), max_rss, ""
            except json.JSONDecodeError:
                continue
    return None, max_rss, f"exit code {proc.returncode}, no result line"


def _ours_base(args) -> dict:
    """The ours flags as EngineSettings values (every ours variant starts from them)."""
    return {k: getattr(args, k) for k in OURS_FLAGS}


def _label(worker: str, file_type: str, res: dict | None = None) -> str:
    """A system's label; an ours system's comes from the numerics plan its engine reported (before that, or when
    it failed, from its variant spec)."""
    kind, _, variant = worker.partition(":")
    if kind == "ours":
        plan = ((res or {}).get("info") or {}).get("numerics")
        return plan_label(plan) if plan else f"ours [{variant or 'default'}]"
    if kind == "hf":
        return f"HF {'fp32' if variant == 'float32' else 'bf16'}"
    return f"llama.cpp {file_type if variant == 'file' else variant}"


def plan_workers(args, file_type: str) -> list[str]:
    """Worker names in run order; llama.cpp variants that duplicate the file's own type are dropped."""
    from parrot.bench.peers import llama_cpp_available

    workers: list[str] = []
    for system in args.systems:
        if system == "ours":
            workers += list(args.ours_workers)
        elif system == "hf":
            workers += [f"hf:{d}" for d in args.hf_dtypes]
        elif system == "llamacpp":
            if not llama_cpp_available():
                print("llama.cpp: not installed (run /work/shared/tools/install-llamacpp.sh)", flush=True)
                continue
            variants = [v for v in args.llama_variants if v == "file" or v != file_type]
            workers += [f"llamacpp:{v}" for v in dict.fromkeys(variants)]
        else:
            raise SystemExit(f"unknown system {system!r}; choose from ours, hf, llamacpp")
    return workers


def _quant_path(args, quant: str) -> str:
    stem = os.path.basename(args.model).removesuffix(".gguf")
    return os.path.join(args.quant_dir, f"{stem}.requant-{quant}.gguf")


def _hf_cache_path(args, dtype: str) -> str:
    stem = os.path.basename(args.model).removesuffix(".gguf")
    return os.path.join(args.quant_dir, f"{stem}.hf-{dtype}")


def _prepare(args, worker: str) -> tuple[str | None, dict]:
    """Model path and extra worker flags for ``worker``, making its one-time files first (a requantized GGUF
    for llama.cpp, a safetensors copy for HF). Returns (None, {"error": ...}) when a needed file cannot be made."""
    kind, _, variant = worker.partition(":")
    if kind == "llamacpp" and variant != "file":
        path = _quant_path(args, variant)
        if not os.path.isfile(path):
            log.info("requantizing %s -> %s (once) ...", os.path.basename(args.model), path)
            res, _, err = run_subprocess(_worker_cmd(args, f"quantize:{variant}", prep_out=path),
                                         args.worker_timeout, args.threads)
            if res is None or not os.path.isfile(path):
                return None, {"error": f"quantize: {err or res.get('error')}"}
        return path, {}
    if kind == "hf":
        path = _hf_cache_path(args, variant)
        if not os.path.isdir(path):
            log.info("saving transformers' %s load of the GGUF as safetensors -> %s (once) ...", variant, path)
            res, _, err = run_subprocess(_worker_cmd(args, f"hfconvert:{variant}", prep_out=path),
                                         args.worker_timeout, args.threads)
            if res is None or not os.path.isdir(path):
                log.warning("HF conversion failed (%s); the worker loads the GGUF itself", err or res.get("error"))
                return args.model, {}
        return args.model, {"hf_dir": path}
    return args.model, {}


def run_all(args) -> dict:
    """Machine peak, then each system in its own subprocess; returns the full JSON-able result."""
    from parrot.bench.machine import describe_machine
    from parrot.bench.peers import gguf_file_type
    from parrot.engine.cpu import probe_cpu

    file_type = gguf_file_type(args.model)
    workers = plan_workers(args, file_type)
    t_start = time.perf_counter()
    log.info("machine peak (%d threads) ...", args.threads)
    machine, _, err = run_subprocess(_worker_cmd(args, "machine"), args.worker_timeout, args.threads)
    if machine is None:
        log.error("machine peak failed: %s", err)
    systems: dict[str, dict] = {}
    for worker in workers:
        model, extra = _prepare(args, worker)
        if model is None:
            systems[worker] = {"system": worker, "ok": False, "error": extra["error"],
                               "label": _label(worker, file_type)}
            continue
        log.info("running %s ...", worker)
        cmd = _worker_cmd(args, worker, **extra)
        cmd[cmd.index("--model") + 1] = model
        res, max_rss, err = run_subprocess(cmd, args.worker_timeout, args.threads)
        if worker.startswith("llamacpp") and args.llama_buffers == "repack" and not (res or {}).get("ok"):
            log.warning("%s failed with repacked weights (%s); retrying with plain buffers", worker,
                        err or res.get("error"))
            cmd[cmd.index("--llama-buffers") + 1] = "plain"
            res, max_rss, err = run_subprocess(cmd, args.worker_timeout, args.threads)
        res = res or {"system": worker, "ok": False, "error": err}
        res["label"] = _label(worker, file_type, res)
        res["max_rss_mib"] = max_rss
        systems[worker] = res
        if not res.get("ok"):
            log.error("%s failed: %s", worker, res.get("error"))
    # the peak again after the systems: a shared machine's noise only ever lowers a measured peak, so the higher
    # of the two readings (per figure) is the better estimate, and the conservative one for "% of peak"
    log.info("machine peak again (%d threads) ...", args.threads)
    again, _, err = run_subprocess(_worker_cmd(args, "machine"), args.worker_timeout, args.threads)
    if again is None:
        log.error("machine peak (second reading) failed: %s", err)
    machine = combine_peaks(machine, again)
    unique_labels(systems)
    cpu = probe_cpu()
    conditions = {**describe_machine(), "cpu_family": cpu.family, "cpu_paths": ", ".join(p.value for p in cpu.paths()),
                  "threads": args.threads, "model": os.path.basename(args.model), "model_file_type": file_type,
                  "ours": " ".join(f"{k}={v}" for k, v in _ours_base(args).items())
                          + "; variants: " + ", ".join(_ours_spec(w) for w in args.ours_workers),
                  "quick": args.quick, "total_s": round(time.perf_counter() - t_start, 1)}
    return {"conditions": conditions, "protocol": asdict(_protocol(args)), "machine": machine, "systems": systems}


def unique_labels(systems: dict[str, dict]) -> None:
    """Two ours variants whose plans read the same (e.g. a kv_dtype override) get their spec appended."""
    counts: dict[str, int] = {}
    for r in systems.values():
        counts[r["label"]] = counts.get(r["label"], 0) + 1
    for w, r in systems.items():
        if counts[r["label"]] > 1 and _is_ours(w):
            r["label"] = f"{r['label']} [{_ours_spec(w)}]"


PEAK_KEYS = ("bf16_matmul_gflops", "fp32_matmul_gflops", "int8_dot_gops", "mem_read_gbs")


def combine_peaks(first: dict | None, second: dict | None) -> dict | None:
    """The per-figure maximum of two machine-peak readings (either may be missing, and a figure may be None or
    absent in one: then the other's counts); keeps both readings."""
    if first is None or second is None:
        return first or second
    out = dict(first)
    for key in PEAK_KEYS:
        vals = [v for v in (first.get(key), second.get(key)) if v is not None]
        out[key] = max(vals) if vals else None
    out["readings"] = [{k: first.get(k) for k in PEAK_KEYS}, {k: second.get(k) for k in PEAK_KEYS}]
    return out


# ---- summary: ratios, share of peak, tables, files ---------------------------------------------------------------
def matmul_params(cfg) -> int:
    """Weights multiplied per token: q/k/v/o + gate/up/down in every layer, plus the output head."""
    h = cfg.hidden_size
    per_layer = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def flops_per_token(cfg, attended: float) -> float:
    """Useful FLOPs of one decoded token attending ``attended`` tokens (see the module docstring)."""
    return 2.0 * matmul_params(cfg) + 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attended


def _rate(res: dict, batch: int | None, stat: str = "best") -> float | None:
    if not res.get("ok"):
        return None
    if batch is None:
        return res["prefill_tok_s"][stat]
    d = res["decode_tok_s"].get(str(batch))
    return None if d is None else d[stat]


def summarize(data: dict, cfg) -> None:
    """Add ``ratios`` ({ours label: {peer label: {metric: ours / peer}}, one block per ours variant, with a
    "llama.cpp best quant" entry per block when llama.cpp ran) and ``share_of_peak`` (per system: the largest
    batch's useful GFLOP/s as % of the bf16 / fp32 / int8 peaks, the smallest batch's GB/s as % of memory read)
    to ``data``."""
    from parrot.bench.report import ratio

    proto, systems, machine = data["protocol"], data["systems"], data["machine"] or {}
    metrics = {"prefill": None, **{f"decode_b{n}": n for n in proto["batches"]}}
    ours_all = {w: r for w, r in systems.items() if _is_ours(w)}
    peers = {w: r for w, r in systems.items() if not _is_ours(w)}
    llamas = {w: r for w, r in peers.items() if w.startswith("llamacpp") and r.get("ok")}
    ratios: dict[str, dict] = {}
    for ours in ours_all.values():
        block: dict[str, dict] = {}
        for w, r in peers.items():
            block[r["label"]] = {m: ratio(_rate(ours, b), _rate(r, b)) for m, b in metrics.items()}
        if llamas:
            best: dict[str, dict] = {}
            for m, b in metrics.items():
                w = max(llamas, key=lambda k: _rate(llamas[k], b) or 0.0)
                best[m] = {"ratio": ratio(_rate(ours, b), _rate(llamas[w], b)), "peer": llamas[w]["label"]}
            block["llama.cpp best quant"] = best
        ratios[ours["label"]] = block
    data["ratios"] = ratios
    big, small = max(proto["batches"]), min(proto["batches"])
    fpt = flops_per_token(cfg, proto["context_tokens"] + proto["decode_tokens"] / 2)
    share = {}
    for w, r in systems.items():
        tb, ts = _rate(r, big), _rate(r, small)
        gflops = None if tb is None else fpt * tb / 1e9
        wbytes = r.get("weight_bytes_per_token")
        gbs = None if ts is None or wbytes is None else wbytes * ts / 1e9
        share[r["label"]] = {
            f"b{big}_gflops": gflops, "pct_bf16_peak": ratio(gflops, machine.get("bf16_matmul_gflops")),
            "pct_fp32_peak": ratio(gflops, machine.get("fp32_matmul_gflops")),
            "pct_int8_peak": ratio(gflops, machine.get("int8_dot_gops")),
            "weight_mb_per_token": None if wbytes is None else wbytes / 1e6, f"b{small}_gbs": gbs,
            "pct_mem_bw": ratio(gbs, machine.get("mem_read_gbs")),
        }
    data["share_of_peak"] = share
    data["formulas"] = {
        "flops_per_token": f"2*{matmul_params(cfg):,} (matmul params incl. head) + 4*layers*heads*head_dim*L, "
                           f"L=context+K/2 -> {fpt / 1e6:.1f} MFLOP",
        "peaks": "% bf16 / % fp32 peak: of torch.matmul's bf16 / fp32 GFLOP/s on square matrices; % int8 peak: of "
                 "the int8 dot-product GOPS of a synthetic VPMADDUBSW loop (kernels/peak.cpp: u8 x s8 multiply-adds "
                 "on every thread, 2 ops each), the useful FLOPs above counted as ops; all at "
                 f"batch {big}",
        "bandwidth": f"weight bytes streamed per decode step (system's own format) * batch-{small} tok/s",
        "decode": "tok/s = N*K / wall time for N sequences to generate K tokens each (first from the fill's logits, "
                  "then K-1 steps); ours fills N distinct contexts, peers copy one prefilled context's KV N times",
    }


def render(data: dict, cfg, out_dir: str) -> str:
    """Tables as text; also writes ``engine.json`` and ``engine.png`` into ``out_dir``."""
    from parrot.bench.report import fmt_num, fmt_ratio, format_conditions, format_table, save_bar_panels, save_json

    summarize(data, cfg)
    proto, systems = data["protocol"], data["systems"]
    batches = proto["batches"]
    def cell(r: dict, b: int | None) -> str:
        return "-" if _rate(r, b) is None else f"{fmt_num(_rate(r, b))} ({fmt_num(_rate(r, b, 'median'))})"

    heads = ["system", f"prefill {proto['prefill_tokens']}"] + [f"decode b{n}" for n in batches] + ["max RSS MiB"]
    rows = [[r["label"], cell(r, None)] + [cell(r, n) for n in batches]
            + [r.get("max_rss_mib") if r.get("ok") else f"failed: {r.get('error', '')[:60]}"]
            for r in systems.values()]
    infos = {r["label"]: _info_text(r.get("info", {})) for r in systems.values()}
    cond = data["conditions"]
    parts = [f"== Engine benchmark on {cond.get('cpu', '?')} [{cond.get('cpu_family', '?')}] ==",
             format_conditions(cond), "protocol: " + " ".join(f"{k}={v}" for k, v in proto.items()),
             format_conditions(infos), "",
             format_table(heads, rows, title="Throughput, tok/s: best (median)"), ""]
    rrows = []
    for ours_label, block in data["ratios"].items():
        for peer, m in block.items():
            cells = []
            for key in ["prefill"] + [f"decode_b{n}" for n in batches]:
                v = m.get(key)
                cells.append(f"{fmt_ratio(v['ratio'])} ({v['peer']})" if isinstance(v, dict) else fmt_ratio(v))
            rrows.append([f"{ours_label} / {peer}"] + cells)
    parts += [format_table(["ratio"] + heads[1:-1], rrows, title="Ratios (best vs best), per ours variant")
              if rrows else "Ratios: no peer ran", ""]
    mach = data["machine"] or {}
    big, small = max(batches), min(batches)
    parts.append(f"machine peak ({mach.get('threads', '?')} threads): "
                 f"bf16 matmul {fmt_num(mach.get('bf16_matmul_gflops'))} GFLOP/s, "
                 f"fp32 matmul {fmt_num(mach.get('fp32_matmul_gflops'))} GFLOP/s, "
                 f"int8 dot {fmt_num(mach.get('int8_dot_gops'))} GOPS, "
                 f"memory read {fmt_num(mach.get('mem_read_gbs'))} GB/s"
                 + (" (the higher of two readings, before and after the systems, bf16 / fp32 / int8 / mem: "
                    + "; ".join(" / ".join(fmt_num(r.get(k)) for k in PEAK_KEYS) for r in mach["readings"]) + ")"
                    if mach.get("readings") else ""))
    srows = [[label, s[f"b{big}_gflops"], fmt_pct(s["pct_bf16_peak"]), fmt_pct(s.get("pct_fp32_peak")),
              fmt_pct(s.get("pct_int8_peak")), s["weight_mb_per_token"], s[f"b{small}_gbs"], fmt_pct(s["pct_mem_bw"])]
             for label, s in data["share_of_peak"].items()]
    parts += [format_table(["system", f"b{big} GFLOP/s", "% bf16 peak", "% fp32 peak", "% int8 peak", "weights MB/tok",
                            f"b{small} GB/s", "% mem BW"], srows, title="Share of machine peak"),
              *(f"  {k}: {v}" for k, v in data["formulas"].items()), ""]
    panels = {f"prefill {proto['prefill_tokens']}": {r["label"]: _rate(r, None) for r in systems.values()}}
    for n in batches:
        panels[f"decode batch {n}"] = {r["label"]: _rate(r, n) for r in systems.values()}
    jpath = save_json(os.path.join(out_dir, "engine.json"), data)
    ppath = save_bar_panels(os.path.join(out_dir, "engine.png"), panels, ylabel="tok/s",
                            title=f"{cond['model']} on {cond['cpu']} [{cond.get('cpu_family', '?')}], "
                                  f"{cond['threads']} threads ({cond['date']})")
    parts.append(f"saved {jpath} and {ppath}")
    return "\n".join(parts)


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _info_text(info: dict) -> str:
    """A system's info as one line of k=v; nested dicts (ours' settings and numerics plan) as k={k=v ...}, without
    the CPU model and family (the conditions name them)."""
    def val(v) -> str:
        if isinstance(v, dict):
            return "{" + " ".join(f"{k}={x}" for k, x in v.items() if k not in ("cpu_model", "cpu_family")) + "}"
        return str(v)

    return " ".join(f"{k}={val(v)}" for k, v in info.items())


def _choices(field: str) -> list[str]:
    """The allowed values of a Literal EngineSettings field."""
    import typing

    from parrot.engine.settings import EngineSettings

    return list(typing.get_args(EngineSettings.model_fields[field].annotation))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parrot.bench.engine", description=__doc__.split("\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--systems", type=csv, default=["ours", "hf", "llamacpp"], help="ours,hf,llamacpp")
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--cpu-path", default="auto", choices=_choices("cpu_path"),
                   help="ours' CPU kernel family (EngineSettings.cpu_path; auto = the fastest this CPU runs)")
    p.add_argument("--dtype", default="auto", choices=_choices("dtype"),
                   help="ours' compute dtype (auto = the CPU path's)")
    p.add_argument("--weight-quant", default="auto", choices=_choices("weight_quant"),
                   help="ours' weights (EngineSettings.weight_quant)")
    p.add_argument("--act-quant", default="auto", choices=_choices("act_quant"),
                   help="ours' integer-dot activations (EngineSettings.act_quant; avx512 / avx2 paths)")
    p.add_argument("--ours-variants", default="default",
                   help="comma-separated ours variants, each run in its own worker: 'default' or '+'-joined "
                        "EngineSettings overrides on top of the flags above, e.g. "
                        "default,act_quant=int8,cpu_path=avx2+act_quant=int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="2 prefill / 1 decode repeats, smaller machine-peak sizes (1024 matmuls, 512 MiB read, "
                        "0.25 s int8 loop runs)")
    p.add_argument("--out", default="bench_out/engine", help="dir for engine.json / engine.png")
    p.add_argument("--quant-dir", default="bench_out/models",
                   help="cache of peer model files: requantized GGUFs, HF safetensors copies")
    p.add_argument("--hf-dtypes", type=csv, default=list(DEFAULT_HF_DTYPES))
    p.add_argument("--llama-variants", type=csv, default=list(DEFAULT_LLAMA_VARIANTS),
                   help="'file' (the GGUF as given) and/or Q4_0,Q4_1,Q8_0 (requantized once)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batches", type=lambda s: [int(x) for x in csv(s)], default=[1, 16, 64])
    p.add_argument("--prefill-repeats", type=int, default=5, help="timed prefills (after one warm-up)")
    p.add_argument("--decode-repeats", type=int, default=2, help="timed decode runs per batch size")
    p.add_argument("--budget", type=float, default=20.0,
                   help="seconds of timed runs after which a measurement stops repeating (>= 1 run)")
    p.add_argument("--worker-timeout", type=float, default=600.0, help="a system's subprocess is killed after this")
    p.add_argument("--llama-buffers", default="repack", choices=["repack", "plain"],
                   help="llama.cpp weight buffers: repacked kernels where the format has one, else plain")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prep-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from parrot.bench.peers import LLAMA_QUANTS

    try:
        args.ours_workers = parse_ours_variants(args.ours_variants, _ours_base(args))
    except ValueError as e:
        p.error(f"--ours-variants: {e}")

    if min(args.batches, default=0) < 1 or args.decode_tokens < 2 or args.context_tokens < 1 or args.threads < 1:
        p.error("--batches must be >= 1, --decode-tokens >= 2, --context-tokens >= 1, --threads >= 1")
    if args.prefill_tokens < 1 or args.prefill_repeats < 1 or args.decode_repeats < 1:
        p.error("--prefill-tokens, --prefill-repeats and --decode-repeats must be >= 1")
    if set(args.hf_dtypes) - set(DEFAULT_HF_DTYPES):
        p.error(f"--hf-dtypes must be among {DEFAULT_HF_DTYPES}")
    if set(args.llama_variants) - {"file", *LLAMA_QUANTS}:
        p.error(f"--llama-variants must be among file,{','.join(LLAMA_QUANTS)}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from parrot.engine.model_files import resolve_model_path

    args.model = os.path.abspath(resolve_model_path(args.model))
    if args.worker:
        try:
            result = run_worker(args)
        except Exception as e:  # reported to the driver as a failed system, which the table shows
            log.exception("worker %s failed", args.worker)
            result = {"system": args.worker, "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)
        return 0 if result.get("ok") else 1
    from parrot.engine.config import read_model_config

    data = run_all(args)
    print(render(data, read_model_config(args.model), args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
