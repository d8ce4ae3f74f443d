"""`parrot profile` end to end on the tiny random model: measure the builtin engine, fit, time the client's calls
through the real server, write a loadable file."""

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
    # the client's per-call cost outside the engine, measured against the in-process server on the same engine
    assert 0 < model.api_call_s < 1.0 and 0 <= model.api_completion_s < 1.0
    assert "Parrot API calls" in model.source["api_call_s"]
    # tool-pause swaps: the runner's measured copy rate and the model's KV bytes per token time them
    assert model.swap_bytes_per_s > 0 and model.kv_bytes_per_token > 0 and "GB/s" in model.source["swap_bytes_per_s"]
    assert model.swap_s(4) == 4 * model.block_size * model.kv_bytes_per_token / model.swap_bytes_per_s > 0
