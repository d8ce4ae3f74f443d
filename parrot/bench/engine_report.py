"""The engine benchmark's summary (parrot.bench.engine_bench): ratios of every ours variant to every peer, share of the
machine's measured peaks, the printed tables and the saved JSON / PNG."""

from __future__ import annotations

import os

from parrot.bench.ours_variants import _is_ours, _ours_spec

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
    from parrot.common.report import ratio

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
    from parrot.common.report import fmt_num, fmt_ratio, format_conditions, format_table, save_bar_panels, save_json

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
