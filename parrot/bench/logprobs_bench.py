"""Logprobs benchmark: what generation logprobs and prompt logprobs cost the builtin engine, in one run.

    python -m parrot.bench.logprobs_bench [--batches 1 16] [--context-tokens 64] [--decode-tokens 32]
                                          [--prompt-tokens 512] [--top 5] [--repeats 3] [--seed 0] [--json PATH]

One in-process engine on the default model with the default engine settings (the numerics plan this CPU takes;
only ``max_num_seqs`` is raised to the largest batch). Measured, each as the best of ``--repeats`` interleaved
runs (other load only lowers a throughput; the medians are saved with ``--json``):

* decode tok/s at each batch, without and with ``logprobs=--top`` (batch x decode tokens / wall time of the
  concurrent generates; every sequence forks its own freshly filled random context, so nothing is shared);
* fill tok/s of a ``--prompt-tokens`` random prompt: plain, with ``prompt_logprobs=--top`` cold (a prompt never
  seen), and the same prompt again in a new context (its KV blocks and prompt logprobs cached).

Fresh random prompts per repeat (seeded): the prefix cache serves only the "cached" row. Ratios (with / without,
cached / cold) come from this run's numbers; the conditions name the CPU and the engine's numerics.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from parrot.common.report import fmt_ratio, format_conditions, format_table, ratio, save_json

log = logging.getLogger(__name__)


class Bench:
    """The engine under test and fresh random prompts (token ids drawn from the vocabulary's ordinary range)."""

    def __init__(self, max_batch: int, seed: int) -> None:
        from parrot.engine.loader.builder import build_engine
        from parrot.engine.settings import EngineSettings

        self.settings = EngineSettings(max_num_seqs=max(max_batch, EngineSettings().max_num_seqs))
        self.engine = build_engine(self.settings)
        self.rng = random.Random(seed)
        self._n = 0
        vocab = self.engine.tokenizer.vocab_size
        self._lo, self._hi = min(300, vocab // 4), vocab - 1  # past the special tokens

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self._lo, self._hi) for _ in range(n)]

    def cid(self, kind: str) -> str:
        self._n += 1
        return f"lpbench-{kind}-{self._n}"

    def decode_tok_s(self, batch: int, context: int, tokens: int, top: int | None) -> float:
        from parrot.common.sampling import SamplingParams

        eng = self.engine
        parents = [self.cid("ctx") for _ in range(batch)]
        for f in [eng.fill(self.prompt(context), p) for p in parents]:
            f.result()
        kids = [self.cid("gen") for _ in range(batch)]
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=top)
        t0 = time.perf_counter()
        results = [f.result() for f in [eng.generate(sp, k, p) for k, p in zip(kids, parents)]]
        secs = time.perf_counter() - t0
        for c in kids + parents:
            eng.free_context(c).result()
        if any(len(r.token_ids) != tokens or (top is not None and len(r.logprobs) != tokens) for r in results):
            raise RuntimeError("a generate returned fewer tokens or logprobs than asked (ignore_eos)")
        return batch * tokens / secs

    def fill_tok_s(self, tokens: list[int], top: int | None) -> tuple[float, int]:
        """(tok/s, tokens served from the prefix cache) of one fill into a new context."""
        cid = self.cid("fill")
        t0 = time.perf_counter()
        r = self.engine.fill(tokens, cid, prompt_logprobs=top).result()
        secs = time.perf_counter() - t0
        self.engine.free_context(cid).result()
        if top is not None and len(r.prompt_logprobs) != len(tokens):
            raise RuntimeError("a prompt-logprob fill returned fewer positions than it filled")
        return len(tokens) / secs, r.num_cached

    def close(self) -> None:
        self.engine.shutdown()


def run(args: argparse.Namespace) -> dict:
    bench = Bench(max(args.batches), args.seed)
    try:
        # warm-up: kernels, thread pool, every batch shape once
        for b in args.batches:
            bench.decode_tok_s(b, args.context_tokens, 4, args.top)
        bench.fill_tok_s(bench.prompt(args.prompt_tokens), args.top)
        decode: dict[str, list[float]] = {}
        fills: dict[str, list[float]] = {"plain": [], "logprobs cold": [], "logprobs cached": []}
        cached_tokens = []
        for _ in range(args.repeats):  # interleaved, so drift hits every row alike
            for b in args.batches:
                for top in (None, args.top):
                    key = f"{b}:{'on' if top is not None else 'off'}"
                    decode.setdefault(key, []).append(
                        bench.decode_tok_s(b, args.context_tokens, args.decode_tokens, top))
            fills["plain"].append(bench.fill_tok_s(bench.prompt(args.prompt_tokens), None)[0])
            prompt = bench.prompt(args.prompt_tokens)
            fills["logprobs cold"].append(bench.fill_tok_s(prompt, args.top)[0])
            tok_s, cached = bench.fill_tok_s(prompt, args.top)
            fills["logprobs cached"].append(tok_s)
            cached_tokens.append(cached)
        numerics = dict(bench.engine.numerics)
    finally:
        bench.close()
    return {"decode_tok_s": {k: max(v) for k, v in decode.items()},
            "fill_tok_s": {k: max(v) for k, v in fills.items()},
            "median_decode_tok_s": {k: statistics.median(v) for k, v in decode.items()},
            "median_fill_tok_s": {k: statistics.median(v) for k, v in fills.items()},
            "cached_tokens": min(cached_tokens), "numerics": numerics}


def report(args: argparse.Namespace, res: dict) -> str:
    from parrot.bench.machine import describe_cpu, describe_machine

    d, f = res["decode_tok_s"], res["fill_tok_s"]
    decode_rows = [[f"batch {b}", d[f"{b}:off"], d[f"{b}:on"], fmt_ratio(ratio(d[f"{b}:on"], d[f"{b}:off"]))]
                   for b in args.batches]
    fill_rows = [["plain fill", f["plain"], "", ""],
                 [f"prompt_logprobs={args.top}, cold", f["logprobs cold"], fmt_ratio(ratio(f["logprobs cold"],
                                                                                         f["plain"])), ""],
                 [f"prompt_logprobs={args.top}, prefix cached", f["logprobs cached"],
                  fmt_ratio(ratio(f["logprobs cached"], f["plain"])),
                  fmt_ratio(ratio(f["logprobs cached"], f["logprobs cold"]))]]
    conditions = {**describe_machine(), **describe_cpu(), "model": "default (SmolLM2-135M-Instruct Q4_1)",
                  "engine": "default EngineSettings (engine_numerics: the plan it runs)",
                  "context_tokens": args.context_tokens, "decode_tokens": args.decode_tokens,
                  "prompt_tokens": args.prompt_tokens, "cached tokens (cached fill)": res["cached_tokens"],
                  "repeats": f"{args.repeats} (best)", "seed": args.seed}
    return "\n\n".join([
        format_table(["decode", "tok/s", f"tok/s logprobs={args.top}", "with / without"], decode_rows,
                     title="Generation logprobs"),
        format_table(["fill", "tok/s", "vs plain", "vs cold"], fill_rows,
                     title=f"Prompt logprobs, {args.prompt_tokens}-token prompt"),
        format_conditions(conditions)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--top", type=int, default=5, help="alternatives per position (logprobs / prompt_logprobs)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also save the numbers and conditions here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = run(args)
    print(report(args, res))
    if args.json:
        save_json(args.json, {"args": vars(args), **res})


if __name__ == "__main__":
    main()
