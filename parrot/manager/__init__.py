"""The Parrot manager (no torch): sessions, per-session DAG, graph executor, PrefixHash store, dispatch."""

from parrot.manager.dispatcher import Dispatcher, DispatchRequest, EngineLoad, LeastLoadedPolicy, Policy
from parrot.manager.engine_registry import EngineRegistry
from parrot.manager.manager import Manager, ManagerConfig
from parrot.manager.perf import PerfCriteria
from parrot.manager.submit import PlaceholderSpec, SubmitSpec

__all__ = [
    "DispatchRequest", "Dispatcher", "EngineLoad", "EngineRegistry", "LeastLoadedPolicy", "Manager",
    "ManagerConfig", "PerfCriteria", "PlaceholderSpec", "Policy", "SubmitSpec",
]
