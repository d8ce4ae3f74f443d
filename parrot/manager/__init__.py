"""The Parrot manager (no torch): sessions, per-session DAG, graph executor, perf deduction, PrefixHash store,
global scheduling policies and the dispatcher, engine registry with failover."""

from parrot.manager.dispatcher import Dispatcher, DispatchRequest, EngineLoad, LeastLoadedPolicy, Policy
from parrot.manager.engine_registry import EngineRegistry, EngineState
from parrot.manager.manager import Manager, ManagerConfig
from parrot.manager.perf_deduction import PerfDeduction, RequestLabel, deduce
from parrot.manager.policies import POLICY_NAMES, AppCentricPolicy, CapacityConfig, FifoPolicy, make_policy
from parrot.manager.submit import PlaceholderSpec, SubmitSpec

__all__ = [
    "POLICY_NAMES", "AppCentricPolicy", "CapacityConfig", "DispatchRequest", "Dispatcher", "EngineLoad",
    "EngineRegistry", "EngineState", "FifoPolicy", "LeastLoadedPolicy", "Manager", "ManagerConfig", "PerfDeduction",
    "PlaceholderSpec", "Policy", "RequestLabel", "SubmitSpec", "deduce", "make_policy",
]
