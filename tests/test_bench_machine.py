"""Smoke test of the machine-peak measures at tiny sizes (numbers are noisy; only sanity is asserted)."""

import pytest

from parrot.bench import machine


def test_matmul_gflops_positive_for_both_dtypes():
    for dtype in ("bfloat16", "float32"):
        g = machine.matmul_gflops(dtype, 64, repeats=2)
        assert 0.01 < g < 1e6, (dtype, g)


def test_matmul_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        machine.matmul_gflops("float16x", 8)


def test_memory_read_gbs_positive():
    g = machine.memory_read_gbs(4, repeats=2)
    assert 0.01 < g < 1e5


def test_measure_peak_reports_sizes_and_threads():
    p = machine.measure_peak(1, matmul_n=32, mem_mib=2, repeats=1)
    d = p.to_dict()
    assert d["threads"] == 1 and d["matmul_n"] == 32 and d["mem_read_mib"] == 2
    assert p.fp32_matmul_gflops > 0 and p.mem_read_gbs > 0
    # bf16 is measured only where the CPU has bf16 dot products (elsewhere torch emulates them at ~1 GFLOP/s)
    from parrot.engine.runtime.cpu import CpuPath, probe_cpu

    has_bf16 = CpuPath.AVX512_BF16 in probe_cpu().paths()
    assert (p.bf16_matmul_gflops is not None and p.bf16_matmul_gflops > 0) if has_bf16 else p.bf16_matmul_gflops is None


def test_describe_machine_has_conditions():
    d = machine.describe_machine()
    assert set(d) >= {"cpu", "cpu_count", "torch", "python", "date"}
    assert d["cpu"] and d["torch"]


def test_report_table_ratio_and_plot(tmp_path):
    from parrot.common import report

    assert report.ratio(6.0, 3.0) == 2.0 and report.ratio(1.0, None) is None and report.ratio(1.0, 0) is None
    text = report.format_table(["system", "tok/s"], [["a", 1234.5], ["bb", None]], title="T")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[3].endswith("1,234") and lines[4].endswith("-")
    with pytest.raises(ValueError, match="cells"):
        report.format_table(["a", "b"], [["only one"]])
    png = report.save_bar_panels(str(tmp_path / "p.png"), {"prefill": {"x": 2.0, "y": None}})
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_decode_flops_formula_matches_smollm2_shapes():
    from types import SimpleNamespace

    from parrot.bench.engine_report import flops_per_token, matmul_params

    cfg = SimpleNamespace(hidden_size=576, q_size=576, kv_size=192, intermediate_size=1536, num_layers=30,
                          vocab_size=49152, num_heads=9, head_dim=64)
    # per layer: q 576*576 + k,v 2*576*192 + o 576*576 + gate/up/down 3*576*1536; plus the 49152x576 head
    assert matmul_params(cfg) == 30 * 3_538_944 + 28_311_552
    assert flops_per_token(cfg, 0) == 2 * matmul_params(cfg)
    assert flops_per_token(cfg, 100) - flops_per_token(cfg, 0) == 4 * 30 * 9 * 64 * 100


def test_combine_peaks_takes_the_higher_reading_per_figure():
    from parrot.bench.engine_bench import combine_peaks

    a = {"system": "machine", "bf16_matmul_gflops": 447.0, "fp32_matmul_gflops": 130.0, "mem_read_gbs": 18.0}
    b = {"system": "machine", "bf16_matmul_gflops": 690.0, "fp32_matmul_gflops": 124.0, "mem_read_gbs": 13.1}
    got = combine_peaks(a, b)
    assert (got["bf16_matmul_gflops"], got["fp32_matmul_gflops"], got["mem_read_gbs"]) == (690.0, 130.0, 18.0)
    assert got["readings"][0]["bf16_matmul_gflops"] == 447.0 and got["readings"][1]["mem_read_gbs"] == 13.1
    assert combine_peaks(None, b) is b and combine_peaks(a, None) is a and combine_peaks(None, None) is None
