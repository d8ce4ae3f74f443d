"""PARROT_ENGINE_SHARED_PREFIX_ATTENTION=auto: the start-up probe times both decode-attention paths for real."""

import pytest
import torch

from parrot.engine.runtime import shared_prefix_choice as C
from parrot.engine.settings import EngineSettings

SHAPES = dict(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, kv_dtype=torch.float32,
              block_size=16, scale=32 ** -0.5, decode_kernel=None)


def test_on_and_off_skip_the_probe(monkeypatch):
    def fail(**_):
        raise AssertionError("probed")

    monkeypatch.setattr(C, "probe", fail)
    assert C.choose("on", "e", **SHAPES) is True
    assert C.choose("off", "e", **SHAPES) is False


def test_auto_follows_the_measured_times(monkeypatch):
    monkeypatch.setattr(C, "probe", lambda **_: C.Probe(plain_s=1.0, shared_s=0.5))
    assert C.choose("auto", "e", **SHAPES) is True
    monkeypatch.setattr(C, "probe", lambda **_: C.Probe(plain_s=1.0, shared_s=0.95))  # within the margin: off
    assert C.choose("auto", "e", **SHAPES) is False


def test_probe_times_both_paths():
    p = C.probe(**SHAPES)
    assert p.plain_s > 0 and p.shared_s > 0
    assert "rows sharing" in p.describe()


@pytest.mark.parametrize("native", [False, True])
def test_both_descriptions_of_the_probe_group_attend_alike(native):
    """The plain group (whole tables) and the shared-prefix group (prefix + own blocks) describe the same rows:
    the two paths the probe times compute the same attention, so it compares like with like."""
    kernel = None
    if native:
        from parrot.engine.kernels import load_kernels

        ops = load_kernels()
        if ops is None:
            pytest.skip("native kernels not built")
        kernel = ops.paged_decode
    shapes = {k: v for k, v in SHAPES.items() if k != "decode_kernel"}
    prob = C.problem(**shapes)
    plain, shared = prob.attend(prob.plain, kernel), prob.attend(prob.shared, kernel)
    assert plain.shape == (C.ROWS, 4 * 32)
    torch.testing.assert_close(shared, plain, rtol=1e-4, atol=1e-4)
    other = C.problem(**shapes, seed=1)
    assert not torch.allclose(other.attend(other.plain, kernel), plain)  # the inputs matter


@pytest.mark.parametrize("value, expected", [(True, "on"), (False, "off"), ("false", "off"), ("TRUE", "on"),
                                             ("auto", "auto"), ("off", "off")])
def test_setting_accepts_booleans_as_on_off(value, expected):
    assert EngineSettings(shared_prefix_attention=value).shared_prefix_attention == expected


def test_setting_rejects_other_values():
    with pytest.raises(ValueError, match="shared_prefix_attention"):
        EngineSettings(shared_prefix_attention="sometimes")
