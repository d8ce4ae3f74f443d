"""The `parrot` command: serve (manager + engines), engine (one engine process), run (an app).

Flags are generated from the settings objects (EngineSettings, ServerSettings, EngineServerSettings), so a
flag, its PARROT_* environment variable and the settings field are one thing.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import secrets
import sys
import types
import typing

from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings


# idle keep-alive of the server's connections: longer than clients' idle pools (httpx 5 s, aiohttp 15 s), so a
# client never sends on a connection the server is closing at that moment (a dropped call under load)
KEEP_ALIVE_S = 75


def _add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings], skip: set[str] = frozenset()) -> None:
    group = parser.add_argument_group(cls.__name__)
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:  # shared field (e.g. host): one flag feeds both objects
            continue
        ann = field.annotation
        hidden = isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("hidden")
        help_text = argparse.SUPPRESS if hidden else field.description
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), ann)
        args = typing.get_args(ann)
        if ann is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            continue
        choices = None
        if typing.get_origin(ann) is typing.Literal:
            choices = list(args)
        group.add_argument(flag, dest=name, default=None, choices=choices, help=help_text, metavar=name.upper()
                           if choices is None else None)


def _settings_from(cls: type[BaseSettings], ns: argparse.Namespace, skip: set[str] = frozenset()):
    given = {k: getattr(ns, k) for k in cls.model_fields if k not in skip and getattr(ns, k, None) is not None}
    try:
        return cls(**given)
    except ValidationError as e:
        first = e.errors()[0]
        if not first["loc"]:  # a check across fields: its message names them
            raise SystemExit(f"parrot: invalid settings: {first['msg']}")
        raise SystemExit(f"parrot: invalid --{'-'.join(str(x) for x in first['loc']).replace('_', '-')}: {first['msg']}")


def _cmd_engine(ns: argparse.Namespace) -> None:
    from parrot.drain import serve
    from parrot.engine.loader.builder import build_local_engine_client
    from parrot.engine.server.app import EngineServerSettings, create_engine_app
    from parrot.engine.settings import EngineSettings

    server = _settings_from(EngineServerSettings, ns)
    if server.manager_url:
        try:
            server.advertised_url()  # an engine bound to 0.0.0.0 must say where the manager reaches it
        except ValueError as e:
            raise SystemExit(f"parrot: {e}") from None
    engine = _settings_from(EngineSettings, ns, skip={"name"} if ns.name is None else set())
    client = build_local_engine_client(engine)
    app = create_engine_app(client, server)
    serve(app, host=server.host, port=server.port, drain=app.state.drain, log_level="warning",
          timeout_keep_alive=KEEP_ALIVE_S)


def _engine_flags(ns: argparse.Namespace, skip: set[str]) -> list[str]:
    """The EngineSettings flags given on this command line, re-serialized for `parrot engine` children."""
    from parrot.engine.settings import EngineSettings

    out: list[str] = []
    for name in EngineSettings.model_fields:
        value = getattr(ns, name, None)
        if name in skip or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _backend_engines(specs: list[str]) -> list:
    """``--backend [kind=]URL`` values as engine clients (kinds detected now); a bad spec or an unreachable
    server to detect ends the start with the reason."""
    if not specs:
        return []
    from parrot.backends import BackendSettings, resolve_backends
    from parrot.common.errors import ParrotError

    try:
        return resolve_backends(specs, BackendSettings())
    except ParrotError as e:
        raise SystemExit(f"parrot: --backend: {e}") from None


def _ready_announcer(url: str):
    """An engine listener that prints one "ready" line when the first engine is alive (before that,
    /v1/models answers 503 not_ready)."""
    announced = False

    def on_state(entry) -> None:
        nonlocal announced
        if entry.healthy and not announced:
            announced = True
            print(f"parrot: ready: {entry.name} serves {entry.info.name} at {url}/v1", flush=True)

    return on_state


def _cmd_serve(ns: argparse.Namespace) -> None:
    from parrot.api.app import create_app
    from parrot.api.settings import ServerSettings
    from parrot.drain import serve
    from parrot.engine.settings import EngineSettings

    server = _settings_from(ServerSettings, ns)
    engine = _settings_from(EngineSettings, ns, skip={"name", "port", "host"})
    if server.state_dir is not None:  # a state dir that cannot be used fails here, before any model loads
        from parrot.manager.journal import open_journal

        open_journal(server.state_dir).close()
    backends = _backend_engines(server.backends)
    if server.engines == 0 and not backends and server.local_engine:  # no --engines / --backend / --no-local-engine
        from parrot.engine.loader.builder import build_local_engine_client

        client = build_local_engine_client(engine)
        url = f"http://{server.host}:{server.port}"
        app = create_app(server, [client], engine_listeners=[_ready_announcer(url)])
        print(f"parrot: serving {client.name} on http://{server.host}:{server.port} (policy {server.policy}; "
              "OpenAPI at /docs)", flush=True)
        serve(app, host=server.host, port=server.port, drain=app.state.drain, log_level="warning",
              timeout_keep_alive=KEEP_ALIVE_S)
        return

    from parrot.engine.server.procs import free_port, start_engines, stop_all

    # the children register from 127.0.0.1 (inside the default --engine-networks)
    port = server.port or free_port(server.host)
    manager_url = f"http://127.0.0.1:{port}"
    if server.engine_secret is None and server.engines == 0 and not server.local_engine and not backends:
        raise SystemExit("parrot: --no-local-engine serves engines that register: give it --engine-secret "
                         "(PARROT_ENGINE_SECRET), the same as the engines' PARROT_ENGINE_SERVER_MANAGER_SECRET")
    if server.engine_secret is None:  # our own children only: a fresh secret, handed over in their environment
        server = server.model_copy(update={"engine_secret": SecretStr(secrets.token_urlsafe(32))})
    procs = start_engines(server.engines, manager_url, secret=server.engine_secret.get_secret_value(),
                          engine_args=_engine_flags(ns, {"name", "port", "host"}))
    try:
        app = create_app(server, backends, engine_listeners=[_ready_announcer(f"http://{server.host}:{port}")])
        print(f"parrot: serving on http://{server.host}:{port} with {server.engines} engine process(es) "
              f"{', '.join(f'{p.name}={p.url} (pid {p.pid})' for p in procs)}"
              f"{''.join(f'; backend {b.name}={b.url}' for b in backends)}; policy {server.policy}", flush=True)
        serve(app, host=server.host, port=port, drain=app.state.drain, log_level="warning",
              timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        stop_all(procs)


def _cmd_run(ns: argparse.Namespace) -> None:
    if ns.url:
        os.environ["PARROT_URL"] = ns.url
    sys.argv = [ns.script, *ns.args]
    # as `python script.py` does: the script's directory first on the path (examples import their siblings)
    sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    runpy.run_path(ns.script, run_name="__main__")


def _cmd_profile(ns: argparse.Namespace) -> None:
    from parrot.engine.settings import EngineSettings
    from parrot.sim.cost_model import MODELS_DIR, load_model
    from parrot.sim.profile import QUICK_PLAN, ProfilePlan, format_fit, profile_engine

    model, samples = profile_engine(_settings_from(EngineSettings, ns), QUICK_PLAN if ns.quick else ProfilePlan())
    out = ns.out or str(MODELS_DIR / "this-machine.json")
    model.save(out)
    print(format_fit(model, samples))
    print(f"fit: {model.source['fit_relative_error']}; saved {out} ({load_model(out).name})")


def build_parser() -> argparse.ArgumentParser:
    """The ``parrot`` argument parser (every subcommand; flags from the settings objects, e.g. ``parrot serve
    --engine-policy lamps`` from EngineSettings.engine_policy, handed to the builtin engine
    in the server and, re-serialized, to each ``parrot engine`` child)."""
    from parrot.api.settings import ServerSettings
    from parrot.engine.server.app import EngineServerSettings
    from parrot.engine.settings import EngineSettings

    parser = argparse.ArgumentParser(prog="parrot", description="Parrot: an LLM service for applications")
    parser.add_argument("--log-level", default=os.environ.get("PARROT_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("PARROT_LOG_FORMAT", "text"),
                        help="log lines as text or one JSON object each; both carry request and session ids")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="manager + API + builtin engine(s) on the default model (--engines N for N "
                       "engine processes)")
    p.add_argument("--backend", dest="backends", action="append", default=None, metavar="[KIND=]URL",
                   help="an external OpenAI-compatible server as an engine (repeatable; KIND openai, vllm, sglang or "
                   "llamacpp, detected when not given); without --engines, no builtin engine starts")
    _add_settings_flags(p, ServerSettings, skip={"backends"})
    _add_settings_flags(p, EngineSettings, skip={"name"})
    p.set_defaults(fn=_cmd_serve, name=None)

    p = sub.add_parser("engine", help="one builtin engine as its own HTTP process")
    _add_settings_flags(p, EngineServerSettings)
    _add_settings_flags(p, EngineSettings)
    p.set_defaults(fn=_cmd_engine)

    p = sub.add_parser("run", help="run an app script against a Parrot server (PARROT_URL)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.add_argument("--url", default=None, help="server URL (default: $PARROT_URL or http://127.0.0.1:8000)")
    p.set_defaults(fn=_cmd_run)

    p = sub.add_parser("profile", help="measure the builtin engine and fit the simulator's cost model "
                       "(parrot/sim/cost_models/this-machine.json)")
    p.add_argument("--out", default=None, help="output JSON (default: parrot/sim/cost_models/this-machine.json)")
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke test, not a usable fit)")
    _add_settings_flags(p, EngineSettings)
    p.set_defaults(fn=_cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    from parrot.common.log_context import configure_logging

    configure_logging(ns.log_level, ns.log_format)  # request / session ids on every record (parrot.common.log_context)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine call/heartbeat otherwise
    from parrot.common.errors import ModelNotFound
    from parrot.engine.runtime.numerics import PathUnavailable
    from parrot.manager.journal import JournalError

    try:
        ns.fn(ns)
    except (ModelNotFound, PathUnavailable, JournalError) as e:  # a start that cannot work: say why, no traceback
        raise SystemExit(f"parrot: {e}") from None


if __name__ == "__main__":
    main()
