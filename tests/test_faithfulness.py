"""parrot.bench.faithfulness: the metrics on synthetic logits (hand-computed), the text, and an end-to-end run on a
tiny random GGUF (only where llama_cpp is installed; CI has no llama.cpp)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from parrot.bench import faithfulness as fa

LN2 = math.log(2.0)


def _synthetic() -> tuple[np.ndarray, np.ndarray]:
    """Two positions over a 3-token vocabulary, as logits with arbitrary offsets (log-softmax removes them):
    position 0: llama.cpp p = (1/2, 1/4, 1/4), ours (1/4, 1/2, 1/4) -> argmaxes differ;
    position 1: both the same distribution (ours shifted by +10)."""
    ref = np.array([np.log([0.5, 0.25, 0.25]) + 3.0, [1.0, 2.0, 3.0]], dtype=np.float32)
    ours = np.array([np.log([0.25, 0.5, 0.25]) - 7.0, [11.0, 12.0, 13.0]], dtype=np.float32)
    return ref, ours


def test_log_softmax_is_normalized_and_shift_free():
    x = np.array([[1.0, 2.0, 3.0], [1001.0, 1002.0, 1003.0]])
    lp = fa.log_softmax(x)
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0)
    np.testing.assert_allclose(lp[0], lp[1])
    np.testing.assert_allclose(lp[0, 2], -math.log(1 + math.exp(-1) + math.exp(-2)))


def test_position_metrics_by_hand():
    ref, ours = _synthetic()
    per = fa.position_metrics(ref, ours)
    assert per["agree"].tolist() == [False, True]
    # llama.cpp's top-1 at position 0 is token 0: |log 1/4 - log 1/2| = ln 2
    np.testing.assert_allclose(per["lp_diff"], [LN2, 0.0], atol=1e-6)
    # KL(p || q) = 1/2 ln(2) + 1/4 ln(1/2) + 1/4 ln(1) = ln(2) / 4
    np.testing.assert_allclose(per["kl"], [LN2 / 4, 0.0], atol=1e-6)
    s = fa.summarize(per)
    assert s["positions"] == 2 and s["top1_agreement"] == 0.5
    assert s["top1_logprob_absdiff_mean"] == pytest.approx(LN2 / 2, abs=1e-6)
    assert s["top1_logprob_absdiff_max"] == pytest.approx(LN2, abs=1e-6)
    assert s["kl_mean"] == pytest.approx(LN2 / 8, abs=1e-6) and s["kl_max"] == pytest.approx(LN2 / 4, abs=1e-6)


def test_kl_is_not_symmetric_and_uses_llama_cpp_as_reference():
    # p = (0.9, 0.1) vs q = (0.5, 0.5): KL(p||q) = 0.9 ln 1.8 + 0.1 ln 0.2; KL(q||p) differs
    p, q = np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]])
    kl_pq = 0.9 * math.log(1.8) + 0.1 * math.log(0.2)
    assert fa.position_metrics(p, q)["kl"][0] == pytest.approx(kl_pq)
    assert fa.position_metrics(q, p)["kl"][0] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0))


def test_compare_in_chunks_equals_whole():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((37, 50)).astype(np.float32) * 3
    ours = ref + rng.standard_normal((37, 50)).astype(np.float32) * 0.1
    whole = fa.summarize(fa.position_metrics(ref, ours))
    for rows in (1, 8, 64):
        got = fa.compare(ref, ours, rows=rows)
        assert got["positions"] == 37 and got["top1_agreement"] == whole["top1_agreement"]
        for k in ("top1_logprob_absdiff_mean", "top1_logprob_absdiff_max", "kl_mean", "kl_max"):
            assert got[k] == pytest.approx(whole[k], rel=1e-9)
    identical = fa.compare(ref, ref)
    assert identical["top1_agreement"] == 1.0 and identical["kl_max"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        fa.position_metrics(ref, ours[:, :10])


class _Tok:
    def __init__(self, add_bos: bool) -> None:
        self.add_bos, self.bos_token_id = add_bos, 7

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_text_ids_cut_and_bos():
    assert fa.text_ids(_Tok(False), 3, "aa b ccc dddd") == [2, 1, 3]
    assert fa.text_ids(_Tok(True), 3, "aa b ccc dddd") == [7, 2, 1]
    with pytest.raises(ValueError, match="fewer than"):
        fa.text_ids(_Tok(False), 10, "aa b")


def test_the_text_is_long_enough(default_model_path):
    from parrot.engine.files.tokenizer import load_tokenizer

    text = fa.load_text()
    assert text.startswith("In Congress, July 4, 1776.") and "sacred Honor." in text
    assert len(fa.text_ids(load_tokenizer(default_model_path), 600)) == 600


def test_end_to_end_on_a_tiny_file(tmp_path, default_model_path):
    pytest.importorskip("llama_cpp")
    from parrot.bench.model_zoo import SHAPES, write_random_gguf

    path = str(tmp_path / "tiny.F16.gguf")
    write_random_gguf(SHAPES["tiny"], path, fmt="F16")
    out = tmp_path / "faith.json"
    lines: list[str] = []
    rc = fa.main(["--models", path, "--tokens", "48", "--json", str(out), "--threads", "1", "--noise-floor"],
                 log_fn=lines.append)
    data = json.loads(out.read_text())
    f = data["files"][0]
    assert rc == 0 and f["ok"], f
    m = f["metrics"]
    assert m["positions"] == 47 and m["top1_agreement"] >= 0.8 and m["kl_mean"] < 0.01
    assert f["tensor_types"] == {"F16": 16, "F32": 5} and f["file_type"] == "F16"
    assert f["ours"]["info"]["capture_check_max_abs_diff"] < 1e-3
    nf = f["noise_floor"]  # llama.cpp on the F32 twin of an F16 file: the same function up to F16 activations
    assert nf["llamacpp_vs_twin"]["positions"] == 47 and nf["llamacpp_vs_twin"]["kl_mean"] < 0.01
    assert nf["ours_vs_twin"]["top1_agreement"] >= 0.8
    c = data["conditions"]
    assert c["cpu"] and c["llama_cpp_python"] and c["ours_plan"]["path"] and c["threads"] == 1
    assert "| tiny.F16.gguf | F16 |" in lines[0] and "dequantized F32 twin" in lines[0]
