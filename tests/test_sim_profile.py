"""`parrot profile` end to end on the tiny random model: measure the builtin engine, fit, write a loadable file."""

from __future__ import annotations

from parrot.engine.settings import EngineSettings
from parrot.sim.cost_model import load_model
from parrot.sim.profile import QUICK_PLAN, format_fit, profile_engine


def test_profile_fits_a_usable_cost_model(tmp_path):
    settings = EngineSettings(random_model="tiny", num_threads=1, kv_cache_tokens=4096)
    model, samples = profile_engine(settings, QUICK_PLAN)
    assert len(samples) == 4 + 2  # prefill sizes x contexts + decode batches x contexts
    assert model.kv_cache_tokens == 4096 and model.max_batch_tokens == settings.max_batch_tokens
    assert "fit_relative_error" in model.source and "machine" in model.source and "load_average" in model.source
    path = tmp_path / "this-machine.json"
    model.save(path)
    loaded = load_model(path)
    assert loaded == model
    assert loaded.prefill_s(256) >= loaded.prefill_s(32) > 0  # non-negative coefficients: monotone
    assert loaded.decode_s(4, 256) >= loaded.decode_s(1, 64) > 0
    assert "measured ms" in format_fit(model, samples)
