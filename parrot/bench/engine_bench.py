"""Engine benchmark: the builtin engine vs HF transformers vs llama.cpp on one GGUF, plus the machine's peak.

    python -m parrot.bench.engine_bench [--systems ours,hf,llamacpp] [--quick] [--out bench_out/engine]
                                  [--cpu-path auto] [--dtype auto] [--weight-quant auto] [--act-quant auto]
                                  [--ours-variants default,act_quant=int8,cpu_path=avx2+act_quant=int8]

Every system (and the machine-peak measure) runs in its own subprocess, one after the other
(``python -m parrot.bench.engine_bench --worker NAME ...`` prints one JSON line), so thread settings and the max
RSS (``os.wait4``'s ru_maxrss of that child) are clean. The protocol is in :mod:`parrot.bench.peers`.

Ours runs once per ``--ours-variants`` spec (worker ``ours`` for ``default``, ``ours:<spec>`` for a ``+``-joined
list of EngineSettings overrides applied on top of the ``--cpu-path / --dtype / --weight-quant / --act-quant``
flags). Each engine picks its numerics plan at start (parrot.engine.runtime.numerics); its label names the plan's CPU path
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

from parrot.bench.engine_report import combine_peaks, render, unique_labels
from parrot.bench.ours_variants import (OURS_FLAGS, _ours_spec, ours_settings, parse_ours_variants,
                                        parse_variant_spec, plan_label, variant_worker)
from parrot.bench.peers import Protocol, Runner

log = logging.getLogger("parrot.bench.engine_bench")

DEFAULT_HF_DTYPES = ("float32", "bfloat16")
DEFAULT_LLAMA_VARIANTS = ("file", "Q4_0", "Q8_0")  # "file" = the GGUF as given (Q4_1 by default)
# ---- ours -------------------------------------------------------------------------------------------------------
class OursRunner(Runner):
    """The builtin engine in-process, driven through its public fill / generate / free_context API."""

    def __init__(self, model_path: str, *, base: dict, overrides: dict, threads: int, proto: Protocol) -> None:
        """``base``: the ours flags (cpu_path, dtype, weight_quant, act_quant); ``overrides``: this variant's
        EngineSettings overrides on top of them."""
        from parrot.engine.loader.builder import build_engine

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
        """Per matmul, the weight a one-row decode step streams (Linear.decode_bytes: the quantized form where the
        layer's path has one -- native int4, torch's int4 / int8 + scales, qdot codes + scales -- else the dense
        weight, packed or not)."""
        return sum(lin.decode_bytes() for lin in self.engine.runner.model.linears())

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
        import parrot.engine.loader.builder  # noqa: F401  (torch + the engine)
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
    from parrot.engine.files.config import read_model_config

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
    cmd = [sys.executable, "-m", "parrot.bench.engine_bench", "--worker", worker, "--model", args.model,
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


def run_subprocess(cmd: list[str], timeout: float, threads: int,
                   tree: str | None = None) -> tuple[dict | None, float, str]:
    """Run one worker (stderr passes through); returns (its JSON result or None, its max RSS in MiB from
    ``os.wait4``, error text). A worker past ``timeout`` seconds is killed. ``tree``: a checkout of the project
    (with its kernels built) whose code the worker runs instead of this one's."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    if tree is not None:  # `python -m` puts the working directory first on the path: run from the tree
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, env=env, text=True, cwd=tree)
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
    if kind.startswith("ours@"):  # another checkout's code (e.g. the last release): named by its directory
        return f"ours@{os.path.basename(kind.partition('@')[2].rstrip('/'))}"
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
            workers += [f"ours@{tree}" for tree in args.ours_trees]
        elif system == "hf":
            workers += [f"hf:{d}" for d in args.hf_dtypes]
        elif system == "llamacpp":
            if not llama_cpp_available():
                print("llama.cpp: not installed (run: bash scripts/install-llamacpp.sh)", flush=True)
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
    from parrot.engine.runtime.cpu import probe_cpu

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
        base_worker, _, tree = worker.partition("@")  # ours@TREE: the default ours, run from another checkout
        cmd = _worker_cmd(args, base_worker, **extra)
        cmd[cmd.index("--model") + 1] = model
        if tree and not os.path.exists(os.path.join(tree, "parrot", "bench", "engine_bench.py")):
            cmd[cmd.index("parrot.bench.engine_bench")] = "parrot.bench.engine"  # a checkout from before the rename
        res, max_rss, err = run_subprocess(cmd, args.worker_timeout, args.threads, tree or None)
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


def _choices(field: str) -> list[str]:
    """The allowed values of a Literal EngineSettings field."""
    import typing

    from parrot.engine.settings import EngineSettings

    return list(typing.get_args(EngineSettings.model_fields[field].annotation))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parrot.bench.engine_bench", description=__doc__.split("\n")[0])
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
    p.add_argument("--ours-trees", type=csv, default=[],
                   help="other checkouts of this project (kernels built) whose default engine runs too, labelled "
                        "ours@<dir>: e.g. the code before a change, in the same run")
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
    from parrot.engine.files.model_files import resolve_model_path

    args.model = os.path.abspath(resolve_model_path(args.model))
    if args.worker:
        try:
            result = run_worker(args)
        except Exception as e:  # reported to the driver as a failed system, which the table shows
            log.exception("worker %s failed", args.worker)
            result = {"system": args.worker, "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)
        return 0 if result.get("ok") else 1
    from parrot.engine.files.config import read_model_config

    data = run_all(args)
    print(render(data, read_model_config(args.model), args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
