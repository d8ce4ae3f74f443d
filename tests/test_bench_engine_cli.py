"""The engine benchmark's pure parts: --ours-variants parsing, plan labels, ratio / share-of-peak tables on
synthetic results (no benchmark runs), and the int8 peak op when the kernel library is built."""

import json
from types import SimpleNamespace

import pytest

from parrot.bench import engine_bench as bench
from parrot.bench import engine_report as report
from parrot.bench import ours_variants as variants
from parrot.engine.runtime.cpu import CpuInfo, CpuPath
from parrot.engine.runtime.numerics import make_plan

AVX2_CPU = CpuInfo(arch="x86_64", model="Test EPYC", flags=frozenset({"avx", "avx2", "fma", "f16c"}))
BF16_CPU = CpuInfo(arch="x86_64", model="Test Zen 4",
                   flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}))
BASE = {"cpu_path": "auto", "dtype": "auto", "weight_quant": "auto", "act_quant": "auto"}


@pytest.fixture
def avx2_cpu(monkeypatch):
    import parrot.engine.runtime.cpu as cpu

    monkeypatch.setattr(cpu, "probe_cpu", lambda: AVX2_CPU)
    return AVX2_CPU


# ---- --ours-variants -----------------------------------------------------------------------------------------
def test_ours_variants_parse_to_worker_names_and_settings(avx2_cpu):
    got = variants.parse_ours_variants("default, act_quant=int8 ,cpu_path=avx2+act_quant=int8,default", BASE)
    assert list(got) == ["ours", "ours:act_quant=int8", "ours:cpu_path=avx2+act_quant=int8"]
    assert got["ours"] == {} and got["ours:cpu_path=avx2+act_quant=int8"] == {"cpu_path": "avx2", "act_quant": "int8"}
    # the worker gets its overrides back from its name, and they apply on top of the ours flags
    for worker, overrides in got.items():
        assert variants.parse_variant_spec(worker.partition(":")[2]) == overrides
        assert variants.variant_worker(overrides) == worker
    s = variants.ours_settings({**BASE, "dtype": "float32"}, got["ours:cpu_path=avx2+act_quant=int8"], num_threads=2)
    assert (s.cpu_path, s.act_quant, s.dtype, s.weight_quant, s.num_threads) == ("avx2", "int8", "float32", "auto", 2)
    # values are converted by EngineSettings (ints, bools)
    assert variants.parse_ours_variants("block_size=32+enable_prefix_cache=false", BASE) == {
        "ours:block_size=32+enable_prefix_cache=false": {"block_size": "32", "enable_prefix_cache": "false"}}


@pytest.mark.parametrize("spec, why", [
    ("foo=1", "unknown setting 'foo'"),
    ("act_quant=int9", "act_quant"),
    ("act_quant", "not key=value"),
    ("act_quant=int8+act_quant=int8x2", "given twice"),
    ("num_threads=4", "set by the benchmark"),
    ("cpu_path=amx", "amx_tile"),  # this (fake) CPU cannot run the forced path
    ("block_size=0", "block_size"),
])
def test_invalid_ours_variant_fails_naming_the_spec(avx2_cpu, spec, why):
    with pytest.raises(ValueError, match=why) as e:
        variants.parse_ours_variants(f"default,{spec}", BASE)
    assert repr(spec) in str(e.value)


def test_invalid_ours_variant_is_an_argparse_error(avx2_cpu, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--systems", "ours", "--ours-variants", "default,act_quant=int9"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--ours-variants" in err and "'act_quant=int9'" in err


def test_plan_workers_and_worker_command_carry_the_variants(avx2_cpu):
    args = SimpleNamespace(systems=["ours"], ours_workers=variants.parse_ours_variants("default,act_quant=int8", BASE),
                           model="/m.gguf", threads=2, **{**BASE, "cpu_path": "avx2"}, prefill_tokens=32,
                           context_tokens=16, decode_tokens=4, prefill_repeats=1, decode_repeats=1, budget=1.0,
                           batches=[1, 2], llama_buffers="plain", quick=True, ours_trees=["/src/prev"])
    assert bench.plan_workers(args, "Q4_1") == ["ours", "ours:act_quant=int8", "ours@/src/prev"]
    assert bench._label("ours@/src/prev", "Q4_1") == "ours@prev"  # another checkout's code, by its directory
    cmd = bench._worker_cmd(args, "ours:act_quant=int8")
    assert cmd[cmd.index("--worker") + 1] == "ours:act_quant=int8"
    assert cmd[cmd.index("--cpu-path") + 1] == "avx2" and cmd[cmd.index("--act-quant") + 1] == "auto"
    assert "--dtype" in cmd and "--weight-quant" in cmd and "--quick" in cmd


# ---- labels ------------------------------------------------------------------------------------------------------
def test_label_comes_from_the_plan():
    def label(cpu, path, **kw):
        return variants.plan_label(make_plan(path, cpu, **kw).to_dict())

    assert label(AVX2_CPU, CpuPath.AVX2) == "ours avx2 fp32/auto"
    assert label(AVX2_CPU, CpuPath.AVX2, act_quant="int8") == "ours avx2 fp32/int8"
    assert label(AVX2_CPU, CpuPath.AVX2, weight_quant="int8") == "ours avx2 fp32/auto w=int8"
    assert label(AVX2_CPU, CpuPath.AVX2, native=False) == "ours avx2 fp32/none torch-kernels"
    assert label(AVX2_CPU, CpuPath.PORTABLE) == "ours portable fp32/none"
    assert label(BF16_CPU, CpuPath.AVX512_BF16) == "ours avx512_bf16 bf16/auto"
    assert label(BF16_CPU, CpuPath.AVX512_BF16, weight_quant="none") == "ours avx512_bf16 bf16/none"
    assert label(BF16_CPU, CpuPath.AVX512_BF16, dtype="float32") == "ours avx512_bf16 fp32/auto"
    # before the worker reported its plan (or when it failed): the variant spec
    assert bench._label("ours", "Q4_1") == "ours [default]"
    assert bench._label("ours:act_quant=int8", "Q4_1", {"ok": False}) == "ours [act_quant=int8]"
    plan = make_plan(CpuPath.AVX2, AVX2_CPU, act_quant="int8").to_dict()
    assert bench._label("ours:act_quant=int8", "Q4_1", {"info": {"numerics": plan}}) == "ours avx2 fp32/int8"
    assert bench._label("llamacpp:file", "Q4_1") == "llama.cpp Q4_1"


def test_same_plan_labels_get_their_spec():
    systems = {"ours": {"label": "ours avx2 int8x2"}, "ours:kv_dtype=float32": {"label": "ours avx2 int8x2"},
               "ours:act_quant=int8": {"label": "ours avx2 int8"}, "llamacpp:file": {"label": "llama.cpp Q4_1"}}
    report.unique_labels(systems)
    assert [r["label"] for r in systems.values()] == [
        "ours avx2 int8x2 [default]", "ours avx2 int8x2 [kv_dtype=float32]", "ours avx2 int8", "llama.cpp Q4_1"]


# ---- summary and tables on synthetic results ----------------------------------------------------------------
CFG = SimpleNamespace(hidden_size=576, q_size=576, kv_size=192, intermediate_size=1536, num_layers=30,
                      vocab_size=49152, num_heads=9, head_dim=64)


def _system(worker, label, prefill, b1, b2, *, wbytes=100_000_000, info=None):
    def st(x):
        return {"best": x, "median": 0.9 * x, "samples": [x]}

    return {"system": worker, "ok": True, "label": label, "prefill_tok_s": st(prefill),
            "decode_tok_s": {"1": st(b1), "2": st(b2)}, "weight_bytes_per_token": wbytes, "info": info or {},
            "max_rss_mib": 500.0}


def _data():
    plan = make_plan(CpuPath.AVX2, AVX2_CPU).to_dict()
    plan8 = make_plan(CpuPath.AVX2, AVX2_CPU, act_quant="int8").to_dict()
    systems = {
        "ours": _system("ours", "ours avx2 int8x2", 1000.0, 100.0, 180.0,
                        info={"variant": "default", "numerics": plan, "threads": 2}),
        "ours:act_quant=int8": _system("ours:act_quant=int8", "ours avx2 int8", 1500.0, 120.0, 240.0,
                                       info={"variant": "act_quant=int8", "numerics": plan8, "threads": 2}),
        "llamacpp:file": _system("llamacpp:file", "llama.cpp Q4_1", 500.0, 50.0, 60.0, info={"quant": "Q4_1"}),
        "llamacpp:Q4_0": _system("llamacpp:Q4_0", "llama.cpp Q4_0", 400.0, 80.0, 40.0, info={"quant": "Q4_0"}),
    }
    machine = {"system": "machine", "threads": 2, "bf16_matmul_gflops": 100.0, "fp32_matmul_gflops": 200.0,
               "int8_dot_gops": 400.0, "mem_read_gbs": 20.0,
               "readings": [{k: 1.0 for k in report.PEAK_KEYS}, {k: 2.0 for k in report.PEAK_KEYS}]}
    conditions = {"cpu": "Test EPYC", "cpu_family": AVX2_CPU.family, "cpu_paths": "avx2, portable", "threads": 2,
                  "model": "m.gguf", "date": "2026-11-25 12:00 UTC", "ours": "cpu_path=auto ..."}
    protocol = {"prefill_tokens": 32, "context_tokens": 16, "decode_tokens": 4, "batches": [1, 2]}
    return {"conditions": conditions, "protocol": protocol, "machine": machine, "systems": systems}


def test_summarize_one_ratio_block_per_ours_variant_and_peak_shares():
    data = _data()
    report.summarize(data, CFG)
    r = data["ratios"]
    assert list(r) == ["ours avx2 int8x2", "ours avx2 int8"]
    for block in r.values():
        assert list(block) == ["llama.cpp Q4_1", "llama.cpp Q4_0", "llama.cpp best quant"]
    assert r["ours avx2 int8x2"]["llama.cpp Q4_1"] == {"prefill": 2.0, "decode_b1": 2.0, "decode_b2": 3.0}
    assert r["ours avx2 int8"]["llama.cpp Q4_0"]["decode_b2"] == 6.0
    best = r["ours avx2 int8"]["llama.cpp best quant"]
    assert best["prefill"] == {"ratio": 3.0, "peer": "llama.cpp Q4_1"}
    assert best["decode_b1"] == {"ratio": 1.5, "peer": "llama.cpp Q4_0"}
    assert best["decode_b2"] == {"ratio": 4.0, "peer": "llama.cpp Q4_1"}
    fpt = report.flops_per_token(CFG, 16 + 4 / 2)
    s = data["share_of_peak"]["ours avx2 int8"]
    assert s["b2_gflops"] == pytest.approx(fpt * 240.0 / 1e9)
    assert s["pct_bf16_peak"] == pytest.approx(s["b2_gflops"] / 100.0)
    assert s["pct_fp32_peak"] == pytest.approx(s["b2_gflops"] / 200.0)
    assert s["pct_int8_peak"] == pytest.approx(s["b2_gflops"] / 400.0)
    assert s["pct_mem_bw"] == pytest.approx(100_000_000 * 120.0 / 1e9 / 20.0)
    assert set(data["share_of_peak"]) == {r["label"] for r in data["systems"].values()}
    assert "VPMADDUBSW" in data["formulas"]["peaks"]


def test_summarize_without_int8_peak_or_peers():
    data = _data()
    data["machine"]["int8_dot_gops"] = None
    data["systems"] = {w: r for w, r in data["systems"].items() if w.startswith("ours")}
    report.summarize(data, CFG)
    assert data["ratios"] == {"ours avx2 int8x2": {}, "ours avx2 int8": {}}
    assert all(s["pct_int8_peak"] is None and s["pct_fp32_peak"] is not None for s in data["share_of_peak"].values())


def test_render_tables_name_cpu_path_and_peaks(tmp_path):
    data = _data()
    text = report.render(data, CFG, str(tmp_path))
    lines = text.splitlines()
    assert lines[0] == f"== Engine benchmark on Test EPYC [{AVX2_CPU.family}] =="
    for row in ("ours avx2 int8x2 / llama.cpp Q4_1", "ours avx2 int8x2 / llama.cpp Q4_0",
                "ours avx2 int8x2 / llama.cpp best quant", "ours avx2 int8 / llama.cpp Q4_1",
                "ours avx2 int8 / llama.cpp best quant"):
        assert sum(line.startswith(row + " ") for line in lines) == 1, row
    head = next(line for line in lines if line.startswith("system") and "% int8 peak" in line)
    assert head.split() == ["system", "b2", "GFLOP/s", "%", "bf16", "peak", "%", "fp32", "peak", "%", "int8", "peak",
                            "weights", "MB/tok", "b1", "GB/s", "%", "mem", "BW"]
    assert "int8 dot 400 GOPS" in text and "VPMADDUBSW" in text
    # per-system info: the plan without the CPU (the conditions name it)
    info = next(line for line in lines if line.startswith("ours avx2 int8 ") and "numerics={" in line)
    assert "path=avx2" in info and "act_quant=int8 " in info and "cpu_model" not in info
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert saved["systems"]["ours"]["info"]["numerics"]["cpu_family"] == AVX2_CPU.family
    assert saved["conditions"]["cpu_family"] == AVX2_CPU.family and "ratios" in saved
    assert (tmp_path / "engine.png").read_bytes()[:4] == b"\x89PNG"


# ---- machine peak ---------------------------------------------------------------------------------------------
def test_combine_peaks_with_int8_missing_in_one_reading():
    a = {"bf16_matmul_gflops": 1.0, "fp32_matmul_gflops": 2.0, "mem_read_gbs": 3.0, "int8_dot_gops": None}
    b = {"bf16_matmul_gflops": 2.0, "fp32_matmul_gflops": 1.0, "mem_read_gbs": 1.0, "int8_dot_gops": 50.0}
    got = report.combine_peaks(a, b)
    assert [got[k] for k in report.PEAK_KEYS] == [2.0, 2.0, 50.0, 3.0]
    assert got["readings"][0]["int8_dot_gops"] is None
    assert report.combine_peaks({**a, "int8_dot_gops": None}, a)["int8_dot_gops"] is None


def test_int8_dot_gops_is_none_or_positive():
    from parrot.bench.machine import int8_dot_gops
    from parrot.engine.kernels import load_kernels

    g = int8_dot_gops(0.05, repeats=1)
    ops = load_kernels()
    if ops is None or not hasattr(ops, "int8_dot_peak_gops"):
        assert g is None
    else:
        assert g is not None and 1.0 < g < 1e6
        with pytest.raises(RuntimeError, match="seconds"):
            ops.int8_dot_peak_gops(0.0)
    with pytest.raises(ValueError):
        int8_dot_gops(0)
