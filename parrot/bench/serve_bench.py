"""The server as a user meets it: `parrot serve` vs llama.cpp's `llama-server` on one GGUF, in one run.

    python -m parrot.bench.serve_bench [--model X.gguf] [--systems ours,llamacpp] [--threads 2] [--repeats 1]
                                       [--ctx 8192] [--busy] [--json out.json]

Each server starts fresh per repeat on 127.0.0.1 with the same GGUF, threads and KV tokens (llama.cpp ``-c CTX -np 16
--kv-unified``, ours ``--kv-cache-tokens CTX``; all else default) and is measured for: start to ready (Popen until
ours' GET /ready is 200 {"ready": true} / llama.cpp's GET /health is 200, polled every 50 ms); prompt (one
/v1/completions of a fresh random 512-token id prompt, max_tokens=1, after one untimed warm-up: 512 / s); the
16-seq job (16 concurrent /v1/completions of fresh random 240-token prompts, 64 tokens each, greedy, ignore_eos --
a vLLM extra on ours, native on llama.cpp, checked in the usage: 16 * 64 / wall s); peak RSS (max VmHWM over the
server and its descendants, just before it stops); with --busy, prompt and job again beside one process spinning a
CPU (busy / quiet = share of the quiet speed). Both servers get the same ids, from the middle of the vocabulary and
fresh per timed request (no prefix-cache hits). --repeats N alternates the systems (order rotated per repeat); the
table shows medians, the JSON every raw time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from parrot.backends.llama_server import binary_path, stop_process
from parrot.bench.ours_variants import plan_label
from parrot.bench.peers import gguf_file_type, random_tokens
from parrot.engine.server.procs import free_port

log = logging.getLogger("parrot.bench.serve_bench")
SYSTEMS = ("ours", "llamacpp", "vllm")
LABELS = {"ours": "ours (parrot serve)", "llamacpp": "llama.cpp server", "vllm": "vLLM (CPU) server"}
DEFAULT_SYSTEMS = ("ours", "llamacpp")  # vllm needs its own environment and an HF dir (--vllm-python, --vllm-model)


@dataclass(frozen=True)
class Sizes:
    prompt_tokens: int = 512
    job_seqs: int = 16
    job_prompt_tokens: int = 240
    job_tokens: int = 64


@dataclass
class Timings:
    """One condition (quiet or busy): seconds of the timed prompt and of the whole job."""
    prompt_s: float
    job_s: float


@dataclass
class Run:
    """One system, one repeat."""
    system: str
    repeat: int
    ok: bool = False
    error: str = ""
    ready_s: float | None = None
    quiet: Timings | None = None
    busy: Timings | None = None
    peak_rss_mib: float | None = None
    info: dict = field(default_factory=dict)


# ---- processes and memory -------------------------------------------------------------------------------------
def server_cmd(system: str, model: str, port: int, threads: int, ctx: int, slots: int,
               args: argparse.Namespace | None = None) -> tuple[list[str], dict | None]:
    """The command starting ``system``'s server and its environment (None: this one's)."""
    if system == "vllm":
        # vLLM's CPU build: bf16, its OpenMP threads bound to the first ``threads`` CPUs, 1 GiB of KV space
        # (VLLM_CPU_KVCACHE_SPACE is in whole GiB; 1 GiB holds more than ``ctx`` tokens of a 1-3B model)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="1")
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                "--max-model-len", str(min(ctx, 4096)), "--max-num-seqs", str(slots)], env
    return _cmd(system, model, port, threads, ctx, slots), None


def _cmd(system: str, model: str, port: int, threads: int, ctx: int, slots: int) -> list[str]:
    if system == "ours":
        return [str(Path(sys.executable).with_name("parrot")), "--log-level", "WARNING", "serve", "--model", model,
                "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(threads),
                "--kv-cache-tokens", str(ctx)]
    binary = binary_path()
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing: run `bash scripts/install-llama-server.sh`")
    return [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(ctx), "-np", str(slots), "--kv-unified", "--no-webui"]


def is_ready(system: str, url: str) -> bool:
    """Ours: /ready 200 with {"ready": true}; llama.cpp and vLLM: /health 200 (llama.cpp: 503 while it loads)."""
    try:
        r = httpx.get(f"{url}/ready" if system == "ours" else f"{url}/health", timeout=2)
    except httpx.TransportError:
        return False
    return r.status_code == 200 and (system != "ours" or r.json().get("ready") is True)


def wait_ready(system: str, url: str, proc: subprocess.Popen, t0: float, timeout_s: float) -> float:
    """Seconds from ``t0`` (just before Popen) until the server answers ready; polls every 50 ms."""
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during startup (code {proc.returncode})")
        if is_ready(system, url):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def vm_hwm_kib(status_text: str) -> int:
    """VmHWM (peak resident set, KiB) from a /proc/<pid>/status text; 0 when absent (a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children of each of its threads, /proc/<pid>/task/*/children, recursively)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(x) for x in children.read_text().split()]
                found += kids
                todo += kids
    return found


def peak_rss_mib(pid: int) -> float:
    """Max VmHWM over ``pid`` and its descendants, in MiB."""
    best = 0
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            best = max(best, vm_hwm_kib(Path(f"/proc/{p}/status").read_text()))
    return best / 1024


@contextlib.contextmanager
def busy_process() -> Iterator[None]:
    """One competing process spinning a CPU for the duration of the block."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait(10)


# ---- requests -------------------------------------------------------------------------------------------------
def complete(client: httpx.Client, url: str, model: str, ids: list[int], max_tokens: int) -> int:
    """One greedy /v1/completions of a token-id prompt with ignore_eos; returns the completion tokens."""
    r = client.post(f"{url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise RuntimeError(f"/v1/completions {r.status_code}: {r.text[:300]}")
    return int(r.json()["usage"]["completion_tokens"])


def time_prompt(client: httpx.Client, url: str, model: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    complete(client, url, model, ids, 1)
    return time.perf_counter() - t0


def time_job(client: httpx.Client, url: str, model: str, prompts: list[list[int]], tokens: int) -> float:
    """All prompts sent at once, ``tokens`` each; wall seconds of the whole job."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        got = list(pool.map(lambda ids: complete(client, url, model, ids, tokens), prompts))
        secs = time.perf_counter() - t0
    if any(n != tokens for n in got):
        raise RuntimeError(f"job generated {got} tokens instead of {tokens} each (ignore_eos not honoured?)")
    return secs


def measure(client: httpx.Client, url: str, model: str, rng: random.Random, vocab: int, sizes: Sizes) -> Timings:
    prompt = time_prompt(client, url, model, random_tokens(rng, sizes.prompt_tokens, vocab))
    job = time_job(client, url, model, [random_tokens(rng, sizes.job_prompt_tokens, vocab)
                                        for _ in range(sizes.job_seqs)], sizes.job_tokens)
    return Timings(prompt, job)


def server_info(system: str, url: str) -> dict:
    """The served model's id and what the server says of itself (ours: the model card; llama.cpp: /props)."""
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    info = {"model_id": models[0]["id"]}
    if system == "ours":
        info["numerics"] = models[0].get("numerics")
    elif system == "llamacpp":
        props = httpx.get(f"{url}/props", timeout=10).json()
        info |= {"build_info": props.get("build_info"), "n_ctx": props.get("default_generation_settings",
                                                                             {}).get("n_ctx")}
    return info


def measure_server(run: Run, url: str, args: argparse.Namespace, vocab: int, sizes: Sizes) -> None:
    """One untimed warm-up, then the quiet timings, then (with --busy) the busy ones, into ``run``."""
    rng = random.Random(args.seed + run.repeat)  # both systems of a repeat see the same ids
    model = run.info["model_id"]
    with httpx.Client(timeout=args.request_timeout, limits=httpx.Limits(max_connections=2 * sizes.job_seqs)) as c:
        time_prompt(c, url, model, random_tokens(rng, sizes.prompt_tokens, vocab))
        run.quiet = measure(c, url, model, rng, vocab, sizes)
        log.info("%s quiet: prompt %.2f s, job %.2f s", run.system, run.quiet.prompt_s, run.quiet.job_s)
        if args.busy:
            with busy_process():
                run.busy = measure(c, url, model, rng, vocab, sizes)
            log.info("%s busy: prompt %.2f s, job %.2f s", run.system, run.busy.prompt_s, run.busy.job_s)


def run_system(system: str, repeat: int, args: argparse.Namespace, vocab: int, sizes: Sizes) -> Run:
    """Start the system's server, time it to ready, measure it, read its peak RSS, stop it. Failures (binary
    missing, server exits, a bad answer) end up in ``Run.error`` with the tail of the server's output."""
    run = Run(system, repeat)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as out:
        proc = None
        try:
            cmd, env = server_cmd(system, args.model, port, args.threads, args.ctx, sizes.job_seqs, args)
            run.info["cmd"] = " ".join(cmd)
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            run.ready_s = wait_ready(system, url, proc, t0, args.ready_timeout)
            log.info("%s ready in %.2f s", system, run.ready_s)
            run.info |= server_info(system, url)
            measure_server(run, url, args, vocab, sizes)
            run.peak_rss_mib = peak_rss_mib(proc.pid)
            run.ok = True
        except (OSError, RuntimeError, httpx.HTTPError, ValueError, KeyError) as e:
            out.seek(0)
            tail = " | ".join(out.read().strip().splitlines()[-3:])
            run.error = f"{type(e).__name__}: {e}" + (f" [server: {tail}]" if tail else "")
            log.error("%s failed: %s", system, run.error)
        finally:
            if proc is not None:
                stop_process(proc)
    return run


# ---- summary and table -----------------------------------------------------------------------------------------
COLUMNS = {"ready_s": ("ready s", "{:.2f}"), "prompt_tok_s": ("prompt tok/s", "{:.1f}"),
           "job_tok_s": ("16-seq tok/s", "{:.1f}"), "busy_prompt_tok_s": ("busy prompt", "{:.1f}"),
           "busy_job_tok_s": ("busy 16-seq", "{:.1f}"), "busy_prompt_share": ("prompt share", "{:.0%}"),
           "busy_job_share": ("16-seq share", "{:.0%}"), "peak_rss_mib": ("peak RSS MiB", "{:.0f}")}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: list[Run], sizes: Sizes) -> dict:
    """Medians over a system's successful repeats; tok/s per repeat first, then the median; busy shares."""
    ok = [r for r in runs if r.ok]
    job_tokens = sizes.job_seqs * sizes.job_tokens
    s = {"ok": bool(ok), "error": next((r.error for r in runs if not r.ok), ""), "repeats": len(ok),
         "ready_s": _median([r.ready_s for r in ok]),
         "prompt_tok_s": _median([sizes.prompt_tokens / r.quiet.prompt_s for r in ok]),
         "job_tok_s": _median([job_tokens / r.quiet.job_s for r in ok]),
         "busy_prompt_tok_s": _median([sizes.prompt_tokens / r.busy.prompt_s for r in ok if r.busy]),
         "busy_job_tok_s": _median([job_tokens / r.busy.job_s for r in ok if r.busy]),
         "peak_rss_mib": _median([r.peak_rss_mib for r in ok])}
    for kind in ("prompt", "job"):
        quiet, busy = s[f"{kind}_tok_s"], s[f"busy_{kind}_tok_s"]
        s[f"busy_{kind}_share"] = busy / quiet if quiet and busy else None
    return s


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """a / b for every numeric figure both summaries have."""
    return {k: a[k] / b[k] if isinstance(a.get(k), float) and isinstance(b.get(k), float) and b[k] else None
            for k in COLUMNS}


def render(summaries: dict[str, dict], ratio: dict[str, dict], conditions: dict, busy: bool) -> str:
    """The table: a row per system, then a row ``ours / <peer>`` per entry of ``ratio`` (peer -> ratios)."""
    cols = [k for k in COLUMNS if busy or not k.startswith("busy")]
    cell = lambda k, v, fmt=None: "-" if v is None else (fmt or COLUMNS[k][1]).format(v)  # noqa: E731
    rows = [["system", *(COLUMNS[k][0] for k in cols)]]
    errors = []
    for system, s in summaries.items():
        rows.append([LABELS[system], *(cell(k, s[k]) for k in cols)])
        if not s["ok"]:
            errors.append(f"{LABELS[system]} failed: {s['error']}")
    for peer, r in ratio.items():
        rows.append([f"ours / {LABELS[peer].removesuffix(' server')}", *(cell(k, r[k], "{:.2f}x") for k in cols)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    head = ["conditions: " + ", ".join(f"{k}={v}" for k, v in conditions.items())]
    return "\n".join(head + lines + errors)


def repeat_lines(runs: list[Run]) -> list[str]:
    """Per repeat and system, the raw seconds behind the medians."""
    def secs(t: Timings | None) -> str:
        return "-" if t is None else f"prompt {t.prompt_s:.2f} s, job {t.job_s:.2f} s"

    return [f"  repeat {r.repeat + 1} {LABELS[r.system]}: " + (f"ready {r.ready_s:.2f} s; quiet {secs(r.quiet)}; "
            f"busy {secs(r.busy)}; RSS {r.peak_rss_mib:.0f} MiB" if r.ok else r.error) for r in runs]


def conditions(args: argparse.Namespace, runs: list[Run], sizes: Sizes) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    info = {r.system: r.info for r in runs if r.ok}
    return {"cpu": cpu, "threads": args.threads, "model": Path(args.model).name,
            "model_type": gguf_file_type(args.model), "kv_tokens": args.ctx, "llama_slots": sizes.job_seqs,
            "llama_build": info.get("llamacpp", {}).get("build_info"),
            "ours_numerics": ", ".join(plan_label(p) for p in (info.get("ours", {}).get("numerics") or {}).values())
                             or None,
            "sizes": f"prompt {sizes.prompt_tokens}, job {sizes.job_seqs}x({sizes.job_prompt_tokens}+"
                     f"{sizes.job_tokens})", "repeats": args.repeats, "busy": args.busy,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def vocab_size(model: str) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(model, "r").fields["tokenizer.ggml.tokens"].data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m parrot.bench.serve_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--systems", type=lambda s: [x for x in s.split(",") if x], default=list(DEFAULT_SYSTEMS),
                   help=f"among {','.join(SYSTEMS)}")
    p.add_argument("--vllm-python", default=None, help="the python of an environment with vLLM's CPU build")
    p.add_argument("--vllm-model", default=None, help="an HF dir of the same weights for vLLM (bf16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ctx", type=int, default=8192, help="KV tokens: llama.cpp -c, ours --kv-cache-tokens")
    p.add_argument("--busy", action="store_true", help="also measure with one competing CPU-bound process")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=1200.0)
    for f in Sizes.__dataclass_fields__:
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(Sizes, f), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if set(args.systems) - set(SYSTEMS) or not args.systems:
        p.error(f"--systems must be among {','.join(SYSTEMS)}")
    if "vllm" in args.systems and not (args.vllm_python and args.vllm_model):
        p.error("the vllm system needs --vllm-python and --vllm-model")
    if min(args.threads, args.repeats, args.prompt_tokens, args.job_seqs, args.job_tokens) < 1:
        p.error("--threads, --repeats and the sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from parrot.engine.files.model_files import resolve_model_path

    args.model = str(Path(resolve_model_path(args.model)).resolve())
    sizes = Sizes(args.prompt_tokens, args.job_seqs, args.job_prompt_tokens, args.job_tokens)
    vocab = vocab_size(args.model)
    runs: list[Run] = []
    for rep in range(args.repeats):
        k = rep % len(args.systems)
        for system in args.systems[k:] + args.systems[:k]:
            log.info("repeat %d: %s ...", rep + 1, system)
            runs.append(run_system(system, rep, args, vocab, sizes))
    summaries = {s: summarize([r for r in runs if r.system == s], sizes) for s in args.systems}
    ratio = {peer: ratios(summaries["ours"], summaries[peer]) for peer in summaries if peer != "ours"} \
        if "ours" in summaries else {}
    cond = conditions(args, runs, sizes)
    print(render(summaries, ratio, cond, args.busy), flush=True)
    if ratio:
        print("(ours / peer: above 1x, ours is faster in tok/s and shares, slower to ready, larger in RSS)")
    if args.repeats > 1:
        print("\n".join(repeat_lines(runs)))
    if args.json:
        Path(args.json).write_text(json.dumps({"conditions": cond, "sizes": asdict(sizes), "summaries": summaries,
                                               "ratios_ours_over": ratio,
                                               "runs": [asdict(r) for r in runs]}, indent=2))
    return 0 if all(s["ok"] for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
