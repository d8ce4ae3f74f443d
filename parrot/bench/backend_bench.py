"""Parrot over llama.cpp's server vs the request-centric baseline talking to that same server, in one run.

    python -m parrot.bench.backend_bench [--apps chain map_reduce] [--chunks 8] [--output-len 25] \\
        [--threads 2] [--slots 8] [--latency-ms 200 300] [--repeats 1] [--out docs/results/backends]

One `llama-server` (scripts/install-llama-server.sh) runs the default GGUF. The same app (chain or map-reduce
summary, parrot.bench.apps) runs twice per repeat, order alternating:

* parrot:   the app's steps submitted at once to `parrot serve --backend <llama-server>` (one emulated round
            trip; the manager runs dependent steps server-side and sends each to llama.cpp's ``/completion`` as
            token ids, forks sharing their prefix in llama.cpp's slot cache);
* baseline: parrot.workloads.baseline_client renders each step on the client and calls llama.cpp's own
            ``/v1/completions`` directly, one emulated round trip per call (paper §8.1).

Outputs have fixed lengths (``ignore_eos``, greedy), prompts carry a per-run tag so no run is served from another's
cache. Prints the table and its conditions (CPU, llama.cpp build, slots, threads, date) and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import httpx

from parrot.backends.llama_server import binary_path, llama_server, running
from parrot.engine.server.procs import free_port
from parrot.bench.app_bench import measure, print_table
from parrot.frontend.client import connect
from parrot.workloads.apps import APPS, DEFAULT_DOCUMENT

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama-server", default=str(binary_path()), help="binary (default: $PARROT_LLAMA_SERVER or "
                   ".venv/llama.cpp/bin/llama-server)")
    p.add_argument("--gguf", default=None, help="model file (default: the default SmolLM2 GGUF)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=8, help="llama-server parallel slots (-np)")
    p.add_argument("--ctx", type=int, default=16384, help="llama-server KV cache tokens, shared by the slots")
    p.add_argument("--apps", nargs="+", default=list(APPS), choices=list(APPS))
    p.add_argument("--chunks", nargs="+", type=int, default=[8])
    p.add_argument("--output-len", nargs="+", type=int, default=[25])
    p.add_argument("--chunk-words", type=int, default=100)
    p.add_argument("--latency-ms", nargs=2, type=float, default=[200.0, 300.0], metavar=("LOW", "HIGH"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--document", default=str(DEFAULT_DOCUMENT))
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "backends"))
    args = p.parse_args(argv)
    if min(args.chunks) < 1 or min(args.output_len) < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--chunks, --output-len and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    from parrot.bench.machine import describe_cpu
    from parrot.engine.files.model_files import resolve_model_path

    if not Path(args.llama_server).exists():
        raise SystemExit(f"backend_bench: {args.llama_server} missing: run `bash scripts/install-llama-server.sh`")
    gguf = resolve_model_path(args.gguf)
    pport = free_port()
    parrot_url = f"http://127.0.0.1:{pport}"
    started = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    with llama_server(gguf, binary=Path(args.llama_server), ctx=args.ctx, slots=args.slots,
                      threads=args.threads) as (llama_url, _):
        parrot_cmd = [sys.executable, "-m", "parrot.cli", "--log-level", "WARNING", "serve", "--port", str(pport),
                      "--backend", f"llamacpp={llama_url}"]
        with running(parrot_cmd, parrot_url, "parrot serve"):
            props = httpx.get(f"{llama_url}/props", timeout=10).json()
            session = connect(parrot_url, make_default=False)
            try:
                args.api_key, args.model = None, None  # the baseline asks llama-server's /v1/models for its model
                rows = measure(args, session, llama_url)
            finally:
                session.close()
    conditions = {
        "date_utc": started, "parrot": f"parrot serve --backend llamacpp={llama_url} (adapter -> /completion)",
        "baseline": "baseline client -> llama-server /v1/completions", "llama_build": props.get("build_info"),
        "llama_slots": args.slots, "llama_ctx": args.ctx, "threads": args.threads, "model": Path(gguf).name,
        "latency_ms": tuple(args.latency_ms), "chunk_words": args.chunk_words, "repeats": args.repeats,
        "warmup": args.warmup, "seed": args.seed, **{k: v for k, v in describe_cpu().items() if k.startswith("cpu")}}
    print_table(rows, conditions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"backend_bench-{started}.json"
    path.write_text(json.dumps({"conditions": conditions, "rows": rows,
                                "args": {k: v for k, v in vars(args).items() if k != "api_key"}}, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
