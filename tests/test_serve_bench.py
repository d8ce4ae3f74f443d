"""parrot.bench.serve_bench: the pure parts (summary, ratios, table, /proc parsing) and one tiny run of `ours`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parrot.bench import serve_bench as sb

SIZES = sb.Sizes(prompt_tokens=512, job_seqs=16, job_prompt_tokens=240, job_tokens=64)

STATUS = """Name:\tllama-server
State:\tS (sleeping)
Pid:\t4242
VmPeak:\t 2345678 kB
VmSize:\t 2345000 kB
VmHWM:\t  812344 kB
VmRSS:\t  800000 kB
Threads:\t3
"""


def _run(system: str, repeat: int, ready: float, prompt_s: float, job_s: float, rss: float,
         busy: tuple[float, float] | None = None) -> sb.Run:
    return sb.Run(system, repeat, ok=True, ready_s=ready, quiet=sb.Timings(prompt_s, job_s),
                  busy=sb.Timings(*busy) if busy else None, peak_rss_mib=rss)


def test_vm_hwm_parsing():
    assert sb.vm_hwm_kib(STATUS) == 812344
    assert sb.vm_hwm_kib("Name:\tzombie\nState:\tZ (zombie)\n") == 0


def test_descendants_finds_own_child_and_its_peak_rss():
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"  # the interpreter runs (a fresh fork has no memory yet)
        assert child.pid in sb.descendants(os.getpid())
        assert sb.peak_rss_mib(os.getpid()) >= sb.peak_rss_mib(child.pid) > 1
    finally:
        child.kill()
        child.wait()
    assert child.pid not in sb.descendants(os.getpid())


def test_summary_medians_and_busy_shares():
    runs = [_run("ours", 0, 4.0, 2.0, 8.0, 500.0, busy=(4.0, 16.0)),
            _run("ours", 1, 6.0, 1.0, 16.0, 700.0, busy=(2.0, 32.0)),
            _run("ours", 2, 5.0, 4.0, 4.0, 600.0, busy=(8.0, 8.0)),
            sb.Run("ours", 3, error="RuntimeError: boom")]
    s = sb.summarize(runs, SIZES)
    assert s["ok"] and s["repeats"] == 3 and s["error"] == "RuntimeError: boom"
    assert s["ready_s"] == 5.0 and s["peak_rss_mib"] == 600.0
    assert s["prompt_tok_s"] == 256.0  # median of 512/2, 512/1, 512/4
    assert s["job_tok_s"] == 128.0  # median of 1024/8, 1024/16, 1024/4
    assert s["busy_prompt_tok_s"] == 128.0 and s["busy_job_tok_s"] == 64.0
    assert s["busy_prompt_share"] == 0.5 and s["busy_job_share"] == 0.5


def test_failed_system_is_reported_and_ratios_skip_it():
    ours = sb.summarize([_run("ours", 0, 2.0, 1.0, 4.0, 300.0)], SIZES)
    llama = sb.summarize([sb.Run("llamacpp", 0, error="FileNotFoundError: llama-server missing")], SIZES)
    assert not llama["ok"] and llama["prompt_tok_s"] is None
    assert all(v is None for v in sb.ratios(ours, llama).values())
    table = sb.render({"ours": ours, "llamacpp": llama}, {"llamacpp": sb.ratios(ours, llama)}, {"cpu": "X"},
                      busy=False)
    assert "llama.cpp server failed: FileNotFoundError: llama-server missing" in table
    assert "busy" not in table.splitlines()[1]


def test_ratio_math_and_table():
    ours = sb.summarize([_run("ours", 0, 6.0, 2.0, 8.0, 600.0, busy=(4.0, 16.0))], SIZES)
    llama = sb.summarize([_run("llamacpp", 0, 2.0, 1.0, 4.0, 300.0, busy=(1.0, 8.0))], SIZES)
    r = sb.ratios(ours, llama)
    assert r["ready_s"] == 3.0 and r["peak_rss_mib"] == 2.0
    assert r["prompt_tok_s"] == 0.5 and r["job_tok_s"] == 0.5
    assert r["busy_prompt_share"] == 0.5 and r["busy_job_share"] == 1.0
    lines = sb.render({"ours": ours, "llamacpp": llama}, {"llamacpp": r}, {"cpu": "AMD EPYC", "threads": 2},
                      busy=True).splitlines()
    assert lines[0] == "conditions: cpu=AMD EPYC, threads=2"
    header, rows = lines[1], lines[3:]
    assert "prompt share" in header and "16-seq share" in header and "peak RSS MiB" in header
    assert rows[0].split()[3:] == ["6.00", "256.0", "128.0", "128.0", "64.0", "50%", "50%", "600"]
    assert rows[1].startswith("llama.cpp server") and rows[1].split()[-1] == "300"
    assert rows[2].startswith("ours / llama.cpp") and "3.00x" in rows[2] and "0.50x" in rows[2]


def test_systems_flag_is_checked():
    with pytest.raises(SystemExit):
        sb.parse_args(["--systems", "ours,sglang"])
    with pytest.raises(SystemExit):  # vLLM runs from its own environment, on an HF dir
        sb.parse_args(["--systems", "ours,vllm"])
    args = sb.parse_args(["--systems", "ours,vllm", "--vllm-python", "/v/bin/python", "--vllm-model", "/m"])
    cmd, env = sb.server_cmd("vllm", "/x.gguf", 8000, 2, 8192, 16, args)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"] and "/m" in cmd
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert sb.server_cmd("ours", "/x.gguf", 8000, 2, 8192, 16, args)[1] is None


@pytest.mark.model
def test_ours_end_to_end_tiny(default_model_path, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = sb.main(["--model", default_model_path, "--systems", "ours", "--threads", "1", "--ctx", "256",
                  "--prompt-tokens", "32", "--job-seqs", "2", "--job-prompt-tokens", "16", "--job-tokens", "4",
                  "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    run = data["runs"][0]
    assert run["ok"] and run["ready_s"] > 0 and run["quiet"]["prompt_s"] > 0 and run["quiet"]["job_s"] > 0
    assert run["peak_rss_mib"] > 50 and run["busy"] is None
    assert data["conditions"]["kv_tokens"] == 256 and data["conditions"]["model_type"] == "Q4_1"
    assert "--kv-cache-tokens 256" in run["info"]["cmd"]
    assert "ours (parrot serve)" in capsys.readouterr().out
