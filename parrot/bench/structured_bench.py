"""Structured-output benchmark: what constrained decoding costs, in one run.

    python -m parrot.bench.structured_bench engine [--batches 1 16] [--context-tokens 64] [--decode-tokens 48]
                                                   [--repeats 3] [--seed 0] [--json PATH]
    python -m parrot.bench.structured_bench libs [--batches 1 16] [--rounds 5] [--json PATH]

``engine``: one in-process engine on the default model with the default settings (``max_num_seqs`` raised to the
largest batch). Decode tok/s at each batch without and with a JSON-schema constraint, best of ``--repeats``
interleaved runs; every sequence forks its own freshly filled random context (nothing shared, nothing cached).
The schema (an array of at least 1,000 ``{name, age, tags}`` objects) cannot be complete within
``--decode-tokens``, so both rows generate exactly the same number of tokens and walk keys, strings, integers
and enums: the ratio is the mask cost (fill in llguidance + apply in torch) per step, not a shorter output.

``libs``: the libraries that could do the masking, on the default model's tokenizer (xgrammar only if it is
installed; it is not a dependency): tokenizer setup, schema compile, and the mask time per token while replaying
a JSON text valid for the schema, one sequence and a batch of sequences (each library's batched call).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

from parrot.common.report import fmt_ratio, format_conditions, format_table, ratio, save_json

log = logging.getLogger(__name__)

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}}}}
SCHEMA = {"type": "array", "minItems": 1000, "items": ITEM}


def sample_json(n: int = 6) -> str:
    """A text valid as a prefix of SCHEMA (n items), for replaying through the matchers."""
    rng = random.Random(0)
    names = ["Ada Lovelace", "Alan", "Grace Hopper", "Edsger", "Barbara", "Ken Thompson"]
    items = [{"name": names[i % len(names)], "age": rng.randrange(18, 90),
              "tags": rng.sample(["red", "green", "blue"], rng.randrange(0, 3))} for i in range(n)]
    return json.dumps(items)[:-1]  # an unfinished array: more items may follow


# ---- engine ---------------------------------------------------------------------------------------------------
class EngineBench:
    def __init__(self, max_batch: int, seed: int) -> None:
        from parrot.engine.loader.builder import build_engine
        from parrot.engine.settings import EngineSettings

        self.engine = build_engine(EngineSettings(max_num_seqs=max(max_batch, EngineSettings().max_num_seqs)))
        self.rng = random.Random(seed)
        self._n = 0
        vocab = self.engine.tokenizer.vocab_size
        self._lo, self._hi = min(300, vocab // 4), vocab - 1

    def decode_tok_s(self, batch: int, context: int, tokens: int, constrained: bool) -> float:
        from parrot.common.constraints import Constraint
        from parrot.common.sampling import SamplingParams

        eng = self.engine
        self._n += 1
        parents = [f"sb-{self._n}-p{i}" for i in range(batch)]
        for f in [eng.fill([self.rng.randrange(self._lo, self._hi) for _ in range(context)], p) for p in parents]:
            f.result()
        kids = [f"sb-{self._n}-g{i}" for i in range(batch)]
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True,
                            constraint=Constraint.json_schema(SCHEMA) if constrained else None)
        t0 = time.perf_counter()
        results = [f.result() for f in [eng.generate(sp, k, p) for k, p in zip(kids, parents)]]
        secs = time.perf_counter() - t0
        for c in kids + parents:
            eng.free_context(c).result()
        if any(len(r.token_ids) != tokens for r in results):
            raise RuntimeError("a generate returned fewer tokens than asked")
        return batch * tokens / secs

    def close(self) -> None:
        self.engine.shutdown()


def run_engine(args: argparse.Namespace) -> dict:
    bench = EngineBench(max(args.batches), args.seed)
    try:
        for b in args.batches:  # warm-up: kernels, thread pools, the grammar compile, every batch shape
            for on in (False, True):
                bench.decode_tok_s(b, args.context_tokens, 4, on)
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for b in args.batches:
                for on in (False, True):
                    runs.setdefault(f"{b}:{'on' if on else 'off'}", []).append(
                        bench.decode_tok_s(b, args.context_tokens, args.decode_tokens, on))
        numerics = dict(bench.engine.numerics)
    finally:
        bench.close()
    return {"decode_tok_s": {k: max(v) for k, v in runs.items()},
            "median_decode_tok_s": {k: statistics.median(v) for k, v in runs.items()}, "numerics": numerics}


def report_engine(args: argparse.Namespace, res: dict) -> str:
    from parrot.bench.machine import describe_cpu, describe_machine

    d = res["decode_tok_s"]
    rows = [[f"batch {b}", d[f"{b}:off"], d[f"{b}:on"], fmt_ratio(ratio(d[f"{b}:on"], d[f"{b}:off"]))]
            for b in args.batches]
    conditions = {**describe_machine(), **describe_cpu(), "model": "default (SmolLM2-135M-Instruct Q4_1)",
                  "engine": "default EngineSettings (engine_numerics: the plan it runs)",
                  "context_tokens": args.context_tokens, "decode_tokens": args.decode_tokens,
                  "constraint": "JSON schema: array (minItems 1000) of {name, age, tags}; llguidance masks",
                  "repeats": f"{args.repeats} (best)", "seed": args.seed}
    return "\n\n".join([format_table(["decode", "tok/s", "tok/s JSON schema", "with / without"], rows,
                                     title="Constrained decoding overhead"), format_conditions(conditions)])


# ---- libraries --------------------------------------------------------------------------------------------------
def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bench_llguidance(tok, ids: list[int], batch: int) -> dict:
    import llguidance
    import torch

    from parrot.engine.runtime.guided import _LlgTokenizerView

    out = {}
    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_LlgTokenizerView(tok)), eos_token=list(tok.eos_token_ids))
    out["setup_ms"] = (time.perf_counter() - t0) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    template = llguidance.LLMatcher(lt, grammar, log_level=0)
    out["compile_ms"] = (time.perf_counter() - t0) * 1e3
    ex = llguidance.LLExecutor()
    matchers = [template.deep_copy() for _ in range(batch)]
    words = -(-lt.vocab_size // 32)
    bitmask = torch.zeros((batch, words), dtype=torch.int32)
    per_token = []
    for t in ids:
        per_token.append(_timed(lambda: ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                                                   bitmask.data_ptr(), words * 4, batch)))
        for m in matchers:
            if not m.consume_token(t):
                raise RuntimeError(f"llguidance refused the replayed text: {m.get_error()}")
    out["mask_ms"] = per_token
    return out


def _bench_xgrammar(tok, ids: list[int], batch: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    out = {}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok.token_to_bytes(i) for i in range(tok.vocab_size)], xgr.VocabType.RAW,
                             vocab_size=tok.vocab_size, stop_token_ids=list(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    out["setup_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    out["compile_ms"] = (time.perf_counter() - t0) * 1e3
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, tok.vocab_size)
    batched = xgr.BatchGrammarMatcher(max_threads=2) if batch > 1 else None
    per_token = []
    for t in ids:
        if batched is not None:
            per_token.append(_timed(lambda: batched.batch_fill_next_token_bitmask(matchers, bitmask)))
        else:
            per_token.append(_timed(lambda: matchers[0].fill_next_token_bitmask(bitmask, 0)))
        for m in matchers:
            if not m.accept_token(t):
                raise RuntimeError("xgrammar refused the replayed text")
    out["mask_ms"] = per_token
    return out


def run_libs(args: argparse.Namespace) -> dict:
    from parrot.engine.files.model_files import resolve_model_path
    from parrot.engine.files.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    ids = tok.encode(sample_json())
    res: dict[str, dict] = {}
    for name, fn in (("llguidance", _bench_llguidance), ("xgrammar", _bench_xgrammar)):
        for b in args.batches:
            rounds = [fn(tok, ids, b) for _ in range(args.rounds)]
            if rounds[0] is None:
                continue
            masks = sorted(x * 1e3 for r in rounds for x in r["mask_ms"])
            res[f"{name}:{b}"] = {"setup_ms": min(r["setup_ms"] for r in rounds),
                                  "compile_ms": min(r["compile_ms"] for r in rounds),
                                  "mask_mean_ms": statistics.fmean(masks),
                                  "mask_p99_ms": masks[min(len(masks) - 1, int(0.99 * len(masks)))]}
    return {"libs": res, "tokens_replayed": len(ids)}


def report_libs(args: argparse.Namespace, res: dict) -> str:
    from parrot.bench.machine import describe_cpu, describe_machine

    rows = []
    for key, r in res["libs"].items():
        name, b = key.split(":")
        rows.append([name, f"batch {b}", r["setup_ms"], r["compile_ms"], r["mask_mean_ms"], r["mask_p99_ms"]])
    conditions = {**describe_machine(), **describe_cpu(), "tokenizer": "default model (49,152 tokens)",
                  "schema": "array of {name, age, tags} (minItems 1000)",
                  "replayed": f"{res['tokens_replayed']} tokens of a valid JSON prefix", "rounds": args.rounds}
    return "\n\n".join([format_table(["library", "batch", "setup ms", "compile ms", "mask ms/token (mean)",
                                      "mask ms/token (p99)"], rows, title="Mask libraries"),
                        format_conditions(conditions)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    e.add_argument("--context-tokens", type=int, default=64)
    e.add_argument("--decode-tokens", type=int, default=48)
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", default=None)
    lb = sub.add_parser("libs")
    lb.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    lb.add_argument("--rounds", type=int, default=5)
    lb.add_argument("--json", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.mode == "engine":
        res = run_engine(args)
        print(report_engine(args, res))
    else:
        res = run_libs(args)
        print(report_libs(args, res))
    if args.json:
        save_json(args.json, {"args": vars(args), **res})


if __name__ == "__main__":
    main()
