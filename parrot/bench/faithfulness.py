"""Faithfulness to the file: our engine's next-token distributions vs llama.cpp's on the same GGUF.

    python -m parrot.bench.faithfulness --models a.gguf,b.gguf [--tokens 512] [--json out.json] [--threads 2]
                                        [--cpu-path auto] [--dtype auto] [--weight-quant auto] [--act-quant auto]
                                        [--mode prefill|decode] [--noise-floor]

For each file, a fixed English text (the US Declaration of Independence, public domain, ``data/``) is tokenized
with OUR tokenizer of that file (a BOS first where the tokenizer adds one) and cut to ``--tokens`` ids; both
systems are teacher-forced over the same ids and every position's next-token distribution is compared (the N - 1
positions 1..N-1, each predicted from the tokens before it). Per file:

    top-1 agreement   % of positions where our argmax == llama.cpp's argmax
    |d logprob|       mean and max over positions of |our logprob - llama.cpp's logprob| of llama.cpp's top-1 token
    KL                mean over positions of KL(llama.cpp || ours) (nats; log-softmax in float64)
    tensor types      the file's tensors counted per ggml type

llama.cpp (:class:`parrot.bench.peers.LlamaCppRunner`, the engine benchmark's runner: one KV stream, batches of
``n_batch`` = 512 tokens, every row's logits read with ``llama_get_logits``; its weight buffers as in the engine
benchmark: repacked kernels where the file's matmul format has one, retried with plain buffers if that fails).

Ours runs through the engine as it serves: ``build_engine(EngineSettings(model=path, ...))`` picks the numerics
plan and matmul kernels for this CPU exactly as ``parrot serve`` does (the ``--cpu-path/--dtype/--weight-quant/
--act-quant`` flags default to ``auto``, the server's defaults; only the KV pool is sized to the text), and one Fill
of the ids with ``prompt_logprobs`` runs the scheduler's chunked prefill (``max_batch_tokens`` per step, the
server's default) through the runner. A Fill's prompt logprobs carry at most MAX_LOGPROBS (20) alternatives per
position, not the full distribution KL needs, so the worker observes the full logits rows the runner computes for
that Fill (it wraps ``compute_logits`` of the engine's model instance; nothing else changes) and cross-checks
every captured row against the Fill's own answer: the row's log-softmax at the filled token must equal the logprob
the engine returned, and its argmax the engine's top-1. That keeps the serving path (plan, kernels, chunking,
paged KV, fused ops) and gives the full distribution.

A 512-token prefill runs the large-batch matmul path only (on the avx512_bf16 / amx paths: the dense bf16 weights;
the int4 kernels serve batches of at most 8 rows). ``--mode decode`` sends one Fill per token instead, each
appended to the context; the engine recomputes the previous token to get its logits (KVManager.uncompute_tail), so
every position is a 2-row forward through the decode-sized matmul kernels (and their weight forms).

``--noise-floor`` also runs llama.cpp on each quantized file's dequantized F32 twin (every tensor dequantized with
``gguf.quants``, written to a temp dir: the exact function the file's weights define) and compares both systems
with it. llama.cpp's quantized matmuls quantize the activations too (to 8 bits: Q8_0 / Q8_1 blocks of 32, Q8_K
blocks of 256 for the K-quants; to F16 for F16 weights), so llama.cpp on a quantized file is itself some distance
from that function; this says how far, i.e. the noise floor of the ours-vs-llama.cpp numbers.

Each system runs in its own subprocess per file (``--worker``), which writes its [N - 1, vocab] float32 logits to a
temporary .npy; a worker that fails (e.g. a file our engine cannot load) is reported with its error text and the
other files still run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger("parrot.bench.faithfulness")

TEXT_FILE = os.path.join(os.path.dirname(__file__), "data", "declaration_of_independence.txt")
DEFAULT_TOKENS = 512
_ROWS = 64  # positions per metric chunk (bounded float64 memory)
MODES = ("prefill", "decode")
OURS_FLAGS = {"cpu_path": "--cpu-path", "dtype": "--dtype", "weight_quant": "--weight-quant",
              "act_quant": "--act-quant"}


# ---- the text --------------------------------------------------------------------------------------------------
def load_text(path: str = TEXT_FILE) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def text_ids(tokenizer, n: int, text: str | None = None) -> list[int]:
    """The first ``n`` token ids of the text (BOS first when the tokenizer adds one). ValueError if it is shorter."""
    ids = tokenizer.encode(load_text() if text is None else text)
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


# ---- metrics ---------------------------------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def position_metrics(ref_logits: np.ndarray, our_logits: np.ndarray) -> dict[str, np.ndarray]:
    """Per position (row) of [positions, vocab] logits, ``ref`` = llama.cpp's: ``agree`` (same argmax), ``lp_diff``
    (|our logprob - ref logprob| of ref's top-1 token), ``kl`` (KL(ref || ours) in nats)."""
    if ref_logits.shape != our_logits.shape:
        raise ValueError(f"logits shapes differ: {ref_logits.shape} vs {our_logits.shape}")
    ref, ours = log_softmax(ref_logits), log_softmax(our_logits)
    ref_top = ref.argmax(axis=-1)
    rows = np.arange(ref.shape[0])
    p = np.exp(ref)
    kl = np.where(p > 0, p * (ref - ours), 0.0).sum(axis=-1)
    return {"agree": ref_top == ours.argmax(axis=-1),
            "lp_diff": np.abs(ours[rows, ref_top] - ref[rows, ref_top]),
            "kl": np.maximum(kl, 0.0)}  # >= 0 up to rounding


def summarize(per: dict[str, np.ndarray]) -> dict[str, float | int]:
    n = int(per["agree"].shape[0])
    if n == 0:
        raise ValueError("no positions to summarize")
    return {"positions": n, "top1_agreement": float(per["agree"].mean()),
            "top1_logprob_absdiff_mean": float(per["lp_diff"].mean()),
            "top1_logprob_absdiff_max": float(per["lp_diff"].max()),
            "kl_mean": float(per["kl"].mean()), "kl_max": float(per["kl"].max())}


def compare(ref_logits: np.ndarray, our_logits: np.ndarray, rows: int = _ROWS) -> dict[str, float | int]:
    """:func:`summarize` of :func:`position_metrics`, computed ``rows`` positions at a time (works on memory maps)."""
    parts = [position_metrics(np.asarray(ref_logits[i:i + rows]), np.asarray(our_logits[i:i + rows]))
             for i in range(0, ref_logits.shape[0], rows)]
    return summarize({k: np.concatenate([p[k] for p in parts]) for k in ("agree", "lp_diff", "kl")})


# ---- workers (one subprocess per system and file) --------------------------------------------------------------
def llama_cpp_rows(path: str, ids: list[int], threads: int, buffers: str = "repack",
                   n_batch: int = 512) -> tuple[np.ndarray, dict]:
    """llama.cpp's logits rows 0..N-2 of ``ids`` (row p predicts token p + 1), teacher-forced in batches of
    ``n_batch``; and the runner's info."""
    from parrot.bench.peers import LlamaCppRunner

    runner = LlamaCppRunner(path, threads, max_seqs=1, seq_ctx=-(-len(ids) // 256) * 256, n_batch=n_batch,
                            buffers=buffers)
    try:
        out = np.empty((len(ids) - 1, runner.n_vocab), dtype=np.float32)
        for s in range(0, len(ids) - 1, n_batch):
            chunk = ids[s:s + n_batch]
            want = [s + i < len(ids) - 1 for i in range(len(chunk))]
            runner._decode([(t, s + i, 0, w) for i, (t, w) in enumerate(zip(chunk, want))])
            k = sum(want)
            out[s:s + k] = np.ctypeslib.as_array(runner.lc.llama_get_logits(runner.ctx), shape=(k, runner.n_vocab))
        return out, {**runner.info(), "n_batch": n_batch}
    finally:
        runner.close()


def ours_rows(path: str, ids: list[int], threads: int, settings: dict,
              mode: str = "prefill") -> tuple[np.ndarray, dict]:
    """Our engine's logits rows 0..N-2 of ``ids`` with prompt logprobs (module docstring), the capture cross-checked
    against the engine's answer; and the engine's info (numerics plan, matmul paths). ``mode``: "prefill" = one
    Fill of all ids (chunked prefill); "decode" = one Fill per token, each appended to the context (the engine
    recomputes the previous token to get its logits: a 2-row forward per position, decode-sized matmuls)."""
    from collections import Counter

    import torch

    from parrot.engine.loader.builder import build_engine
    from parrot.engine.settings import EngineSettings

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    block = EngineSettings().block_size
    es = EngineSettings(**{**settings, "model": path, "num_threads": threads, "max_num_seqs": 1,
                           "kv_cache_tokens": (len(ids) // block + 4) * block})
    t0 = time.perf_counter()
    engine = build_engine(es)
    load_s = time.perf_counter() - t0
    try:
        model = engine.runner.model
        captured: list[np.ndarray] = []
        inner = model.compute_logits

        def spy(hidden):
            logits = inner(hidden)
            captured.append(logits.detach().to("cpu", torch.float32).numpy().copy())
            return logits

        model.compute_logits = spy  # this instance only; the runner calls self.model.compute_logits
        t0 = time.perf_counter()
        try:
            if mode == "prefill":
                lps = list(engine.fill(list(ids), "faithfulness-0", prompt_logprobs=1).result().prompt_logprobs)
            else:
                lps = []
                for tok in ids:
                    lps += engine.fill([tok], "faithfulness-0", prompt_logprobs=1).result().prompt_logprobs
        finally:
            del model.compute_logits
        fill_s = time.perf_counter() - t0
        rows = np.concatenate(captured) if captured else np.empty((0, 0), np.float32)
        if rows.shape[0] != len(ids) - 1 or len(lps) != len(ids):
            raise RuntimeError(f"captured {rows.shape[0]} logits rows and {len(lps)} prompt logprobs for "
                               f"{len(ids)} tokens (expected {len(ids) - 1} and {len(ids)}): the runner's logits "
                               f"calls changed")
        worst = 0.0
        for p in range(1, len(ids)):
            lp = lps[p]
            row = log_softmax(rows[p - 1])
            worst = max(worst, abs(float(row[ids[p]]) - lp.chosen.logprob))
            top = int(np.argmax(rows[p - 1]))
            if lp.top and lp.top[0].token_id != top and row[lp.top[0].token_id] < row[top] - 1e-5:
                raise RuntimeError(f"position {p}: captured argmax {top} but the engine's top-1 is "
                                   f"{lp.top[0].token_id}")
        if worst > 1e-3:
            raise RuntimeError(f"captured logits disagree with the Fill's prompt logprobs (max |diff| {worst:.2e})")
        linears = model.linears()
        info = {"mode": mode, "numerics": dict(engine.numerics) if getattr(engine, "numerics", None) else {},
                "settings": {k: getattr(es, k) for k in (*OURS_FLAGS, "kv_dtype", "attention_kernel",
                                                         "max_batch_tokens", "block_size")},
                "matmul_paths": dict(Counter(lin.path.describe() for lin in linears)),
                "attention_kernel": "native" if engine.runner.decode_kernel is not None else "torch",
                "prefill_kernel": "native" if engine.runner.prefill_kernel is not None else "torch",
                "capture_check_max_abs_diff": worst, "load_s": round(load_s, 2), "fill_s": round(fill_s, 2),
                "threads": threads, "torch": torch.__version__}
        return rows, info
    finally:
        engine.shutdown()


def run_worker(args) -> dict:
    with open(args.ids_file, encoding="utf-8") as f:
        ids = json.load(f)
    t0 = time.perf_counter()
    if args.worker == "llamacpp":
        rows, info = llama_cpp_rows(args.model, ids, args.threads, buffers=args.llama_buffers)
    elif args.worker == "ours":
        rows, info = ours_rows(args.model, ids, args.threads, {k: getattr(args, k) for k in OURS_FLAGS},
                               mode=args.mode)
    else:
        raise ValueError(f"unknown worker {args.worker!r}")
    np.save(args.out_npy, rows)
    return {"ok": True, "info": info, "wall_s": round(time.perf_counter() - t0, 2)}


# ---- driver ----------------------------------------------------------------------------------------------------
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _worker_cmd(args, worker: str, model: str, ids_file: str, out_npy: str, buffers: str) -> list[str]:
    cmd = [sys.executable, "-m", "parrot.bench.faithfulness", "--worker", worker, "--models", model,
           "--ids-file", ids_file, "--out-npy", out_npy, "--threads", str(args.threads), "--llama-buffers", buffers,
           "--mode", args.mode]
    for k, flag in OURS_FLAGS.items():
        cmd += [flag, getattr(args, k)]
    return cmd


def _run(args, worker: str, model: str, ids_file: str, out_npy: str) -> dict:
    from parrot.bench.engine_bench import run_subprocess

    res, rss, err = run_subprocess(_worker_cmd(args, worker, model, ids_file, out_npy, args.llama_buffers),
                                   args.worker_timeout, args.threads)
    if worker == "llamacpp" and args.llama_buffers == "repack" and not (res or {}).get("ok"):
        log.warning("llama.cpp failed with repacked weights (%s); retrying with plain buffers",
                    err or (res or {}).get("error"))
        res, rss, err = run_subprocess(_worker_cmd(args, worker, model, ids_file, out_npy, "plain"),
                                       args.worker_timeout, args.threads)
    res = res or {"ok": False, "error": err}
    res["max_rss_mib"] = round(rss, 1)
    return res


def evaluate_file(args, path: str, tmp: str) -> dict:
    """Both systems on one file and the comparison; errors are recorded, not raised."""
    from parrot.bench.model_zoo import tensor_type_counts
    from parrot.bench.peers import gguf_file_type
    from parrot.engine.files.tokenizer import load_tokenizer

    out: dict = {"file": os.path.basename(path), "path": os.path.abspath(path),
                 "mib": round(os.path.getsize(path) / 2**20, 1), "file_type": gguf_file_type(path),
                 "tensor_types": tensor_type_counts(path), "ok": False}
    ids = text_ids(load_tokenizer(path), args.tokens)
    ids_file = os.path.join(tmp, "ids.json")
    with open(ids_file, "w", encoding="utf-8") as f:
        json.dump(ids, f)
    npys = {}
    for worker in ("llamacpp", "ours"):
        npys[worker] = os.path.join(tmp, f"{worker}.npy")
        log.info("%s: running %s ...", out["file"], worker)
        res = _run(args, worker, path, ids_file, npys[worker])
        out[worker] = res
        if not res.get("ok"):
            log.error("%s: %s failed: %s", out["file"], worker, res.get("error"))
    if out["llamacpp"].get("ok") and out["ours"].get("ok"):
        ref, ours = np.load(npys["llamacpp"], mmap_mode="r"), np.load(npys["ours"], mmap_mode="r")
        out["metrics"] = compare(ref, ours)
        out["ok"] = True
        del ref, ours
    if args.noise_floor and set(out["tensor_types"]) != {"F32"}:
        out["noise_floor"] = _noise_floor(args, path, ids_file, npys, tmp)
    for p in npys.values():
        if os.path.exists(p):
            os.remove(p)
    return out


def _noise_floor(args, path: str, ids_file: str, npys: dict[str, str], tmp: str) -> dict:
    """llama.cpp on the file's dequantized F32 twin (model_zoo.dequantize_gguf: the exact function the file's
    weights define, which llama.cpp computes in F32) against llama.cpp on the file (how far llama.cpp's own
    quantized matmuls -- activations quantized to 8 bits -- move it) and against ours."""
    from parrot.bench.model_zoo import dequantize_gguf

    twin = os.path.join(tmp, "twin.F32.gguf")
    npys["twin"] = os.path.join(tmp, "twin.npy")
    out: dict = {}
    try:
        t0 = time.perf_counter()
        dequantize_gguf(path, twin)
        out["twin_write_s"] = round(time.perf_counter() - t0, 1)
        res = _run(args, "llamacpp", twin, ids_file, npys["twin"])
        out["llamacpp_twin"] = res
        if not res.get("ok"):
            out["error"] = f"llama.cpp on the F32 twin: {res.get('error')}"
            return out
        exact = np.load(npys["twin"], mmap_mode="r")
        for worker, key in (("llamacpp", "llamacpp_vs_twin"), ("ours", "ours_vs_twin")):
            if os.path.exists(npys[worker]):
                out[key] = compare(exact, np.load(npys[worker], mmap_mode="r"))
        del exact
    except Exception as e:  # e.g. an architecture the twin writer does not know
        log.exception("%s: noise floor failed", path)
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if os.path.exists(twin):
            os.remove(twin)
    return out


def _types_text(types: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in types.items())


def render(data: dict) -> str:
    from parrot.bench.ours_variants import plan_label

    c = data["conditions"]
    lines = [f"Faithfulness to the file: ours vs llama.cpp, teacher-forced over {c['tokens']} tokens of "
             f"{c['text']} ({c['tokens'] - 1} positions each; ours in {c.get('mode', 'prefill')} mode)", "",
             f"CPU: {c['cpu']}; threads {c['threads']}; llama-cpp-python {c['llama_cpp_python']}; "
             f"ours: {c['ours_numerics']}", "",
             "| file | type | tensor types | top-1 agree | mean abs d logprob | max abs d logprob | mean KL | note |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    paths = []
    for f in data["files"]:
        m = f.get("metrics")
        if m:
            cells = [f"{100 * m['top1_agreement']:.1f} %", f"{m['top1_logprob_absdiff_mean']:.4f}",
                     f"{m['top1_logprob_absdiff_max']:.4f}", f"{m['kl_mean']:.5f}"]
            note = ""
        else:
            cells = ["-"] * 4
            errs = [f"{w}: {(f.get(w) or {}).get('error', 'not run')}" for w in ("llamacpp", "ours")
                    if not (f.get(w) or {}).get("ok")]
            note = "; ".join(errs if "error" not in f else [f["error"]]).replace("|", "/").replace("\n", " ")[:300]
        lines.append(f"| {f['file']} | {f['file_type']} | {_types_text(f['tensor_types'])} | " + " | ".join(cells)
                     + f" | {note} |")
        info = (f.get("ours") or {}).get("info") or {}
        if info.get("matmul_paths"):
            plan = info.get("numerics") or {}
            label = plan_label(plan) if plan else "?"
            paths.append(f"  {f['file']} [{label}]: "
                         + "; ".join(f"{n} x {p}" for p, n in info["matmul_paths"].items()))
    lines += ["", "d logprob: our logprob minus llama.cpp's of llama.cpp's top-1 token; KL(llama.cpp || ours) in nats."]
    floors = [f for f in data["files"] if f.get("noise_floor")]
    if floors:
        lines += ["", "Against the exact function of each file's weights (llama.cpp on its dequantized F32 twin):",
                  "", "| file | ours: top-1 agree | ours: mean KL | llama.cpp on the file: top-1 agree "
                  "| llama.cpp on the file: mean KL |", "|---|---:|---:|---:|---:|"]
        for f in floors:
            nf = f["noise_floor"]
            cells = []
            for key in ("ours_vs_twin", "llamacpp_vs_twin"):
                m = nf.get(key)
                cells += [f"{100 * m['top1_agreement']:.1f} %", f"{m['kl_mean']:.5f}"] if m else ["-", "-"]
            lines.append(f"| {f['file']} | " + " | ".join(cells) + " |"
                         + (f" {nf['error'][:200]}" if nf.get("error") else ""))
    plans = {json.dumps(((f.get("ours") or {}).get("info") or {}).get("numerics"), sort_keys=True)
             for f in data["files"] if (f.get("ours") or {}).get("ok")}
    if len(plans) > 1:
        lines.append("NOTE: ours ran with different numerics plans across files (e.g. the native kernel library was "
                     "rebuilt or went stale during the run); each file's plan is named below.")
    if paths:
        lines += ["ours' matmul paths (linear layers per path):", *paths]
    return "\n".join(lines)


def run_all(args) -> dict:
    import llama_cpp

    from parrot.engine.loader.builder import plan_for
    from parrot.engine.settings import EngineSettings

    from parrot.bench.machine import describe_machine

    plan = plan_for(EngineSettings(**{k: getattr(args, k) for k in OURS_FLAGS}, num_threads=args.threads))
    conditions = {**describe_machine(), "cpu": cpu_model_name(), "threads": args.threads, "tokens": args.tokens,
                  "text": os.path.basename(TEXT_FILE), "llama_cpp_python": llama_cpp.__version__, "mode": args.mode,
                  "llama_buffers": args.llama_buffers, "ours_numerics": plan.describe(),
                  "ours_plan": plan.to_dict(), "ours_flags": {k: getattr(args, k) for k in OURS_FLAGS}}
    files = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parrot-faithfulness-") as tmp:
        for path in args.models:
            try:
                files.append(evaluate_file(args, path, tmp))
            except Exception as e:  # e.g. a file our tokenizer cannot read: recorded, the others still run
                log.exception("%s failed", path)
                files.append({"file": os.path.basename(path), "path": os.path.abspath(path), "ok": False,
                              "file_type": "?", "tensor_types": {}, "error": f"{type(e).__name__}: {e}"})
    conditions["total_s"] = round(time.perf_counter() - t0, 1)
    return {"conditions": conditions, "files": files}


def _choices(field: str) -> list[str]:
    import typing

    from parrot.engine.settings import EngineSettings

    return list(typing.get_args(EngineSettings.model_fields[field].annotation))


def main(argv: list[str] | None = None, *, log_fn: Callable[[str], None] = print) -> int:
    p = argparse.ArgumentParser(prog="python -m parrot.bench.faithfulness", description=__doc__.split("\n")[0])
    p.add_argument("--models", required=True, help="comma-separated GGUF files")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens of the text (positions + 1)")
    p.add_argument("--json", default=None, help="write the results (with the conditions) here")
    p.add_argument("--threads", type=int, default=2)
    for field, flag in OURS_FLAGS.items():
        p.add_argument(flag, default="auto", choices=_choices(field), help=f"ours' EngineSettings.{field}")
    p.add_argument("--llama-buffers", default="repack", choices=["repack", "plain"],
                   help="llama.cpp weight buffers (parrot.bench.peers.LlamaCppRunner)")
    p.add_argument("--mode", default="prefill", choices=MODES,
                   help="ours: prefill = one Fill of the whole text (the server's chunked prefill: large-batch "
                        "matmuls); decode = one Fill per token (2-row forwards: the decode-sized matmul kernels)")
    p.add_argument("--noise-floor", action="store_true",
                   help="also run llama.cpp on each quantized file's dequantized F32 twin (written to a temp dir) "
                        "and compare both systems with it")
    p.add_argument("--worker-timeout", type=float, default=1800.0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ids-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-npy", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if args.tokens < 2 or args.threads < 1:
        p.error("--tokens must be >= 2 and --threads >= 1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.worker:
        args.model = args.models[0]
        try:
            result = run_worker(args)
        except Exception as e:  # reported to the driver, which shows it in the table
            log.exception("worker %s failed", args.worker)
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(result), flush=True)
        return 0 if result.get("ok") else 1
    from parrot.bench.peers import llama_cpp_available

    if not llama_cpp_available():
        p.error("llama.cpp is not installed (run: bash scripts/install-llamacpp.sh)")
    missing = [m for m in args.models if not os.path.isfile(m)]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    data = run_all(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    log_fn(render(data))
    return 0 if all(f.get("ok") for f in data["files"]) else 1


if __name__ == "__main__":
    sys.exit(main())
