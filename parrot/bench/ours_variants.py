"""Ours' variants in the engine benchmark (``--ours-variants``): parsing and validating the specs, the worker
names, and the short label of an ours system from the numerics plan its engine reports (parrot.bench.engine_bench)."""

from __future__ import annotations

# EngineSettings fields the benchmark sets itself (an ours variant may override any other field)
BENCH_SETTINGS = frozenset({"model", "num_threads", "max_num_seqs", "max_batch_tokens", "kv_cache_tokens",
                            "kv_cache_bytes", "random_model", "name"})
# ours' flags: EngineSettings field -> the driver's option
OURS_FLAGS = {"cpu_path": "--cpu-path", "dtype": "--dtype", "weight_quant": "--weight-quant",
              "act_quant": "--act-quant"}


# ---- ours variants and labels -------------------------------------------------------------------------------
def parse_variant_spec(spec: str) -> dict[str, str]:
    """One ``--ours-variants`` spec -> its EngineSettings overrides: ``default`` -> {}, ``k=v+k2=v2`` -> {k: v, k2:
    v2} (values as strings; EngineSettings converts them). Raises ValueError naming the spec."""
    from parrot.engine.settings import EngineSettings

    spec = spec.strip()
    if spec in ("", "default"):
        return {}
    out: dict[str, str] = {}
    for item in spec.split("+"):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"ours variant {spec!r}: {item!r} is not key=value")
        if key in BENCH_SETTINGS:
            raise ValueError(f"ours variant {spec!r}: {key} is set by the benchmark itself")
        if key not in EngineSettings.model_fields:
            raise ValueError(f"ours variant {spec!r}: unknown setting {key!r} (EngineSettings fields: "
                             f"{', '.join(sorted(set(EngineSettings.model_fields) - BENCH_SETTINGS))})")
        if key in out:
            raise ValueError(f"ours variant {spec!r}: {key} given twice")
        out[key] = value
    return out


def variant_worker(overrides: dict[str, str]) -> str:
    """The worker name of an ours variant: ``ours`` for the default settings, else ``ours:k=v+k2=v2``."""
    return "ours" if not overrides else "ours:" + "+".join(f"{k}={v}" for k, v in overrides.items())


def ours_settings(base: dict, overrides: dict, **bench):
    """The EngineSettings of one ours variant: the ours flags (``base``), then the variant's overrides, then the
    benchmark's own sizing (``bench``). Raises pydantic's ValidationError for a bad value."""
    from parrot.engine.settings import EngineSettings

    return EngineSettings(**{**base, **overrides, **bench})


def parse_ours_variants(text: str, base: dict) -> dict[str, dict[str, str]]:
    """``--ours-variants`` (comma-separated specs) -> {worker name: overrides}, in the given order, duplicates
    dropped. Every variant is validated with EngineSettings (on top of ``base``, the ours flags) and a forced
    ``cpu_path`` against this CPU's features. Raises ValueError naming the bad spec."""
    from pydantic import ValidationError

    from parrot.engine.runtime.cpu import CpuPath, probe_cpu

    out: dict[str, dict[str, str]] = {}
    specs = [x.strip() for x in text.split(",") if x.strip()]
    if not specs:
        raise ValueError("no ours variant given (use 'default' for the default settings)")
    for spec in specs:
        overrides = parse_variant_spec(spec)
        try:
            settings = ours_settings(base, overrides)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ())) or "settings"
            raise ValueError(f"ours variant {spec!r}: {where}: {err['msg']}") from None
        if settings.cpu_path != "auto" and settings.device == "cpu":
            missing = probe_cpu().missing(CpuPath(settings.cpu_path))
            if missing:
                raise ValueError(f"ours variant {spec!r}: cpu_path={settings.cpu_path} needs CPU features this "
                                 f"{probe_cpu().model} lacks: {', '.join(missing)}")
        out.setdefault(variant_worker(overrides), overrides)
    return out


def _short_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)


def plan_label(plan: dict) -> str:
    """Short label of an ours system from its numerics plan (NumericsPlan.to_dict()): the CPU path, the compute
    dtype, then the activation rule of the quantized matmuls ("ours avx2 fp32/auto", "ours avx512_bf16 bf16/int8")
    or the weight quant where none runs ("ours avx512_bf16 bf16/none"); a forced weight_quant on the quantized
    matmul and native kernels turned off on a native path are named too."""
    path = plan.get("path", "?")
    if plan.get("qmm"):
        label = f"ours {path} {_short_dtype(plan.get('dtype', '?'))}/{plan.get('act_quant', '?')}"
        if plan.get("weight_quant", "auto") != "auto":
            label += f" w={plan['weight_quant']}"
    else:
        label = f"ours {path} {_short_dtype(plan.get('dtype', '?'))}/{plan.get('weight_quant', '?')}"
        if path != "portable" and plan.get("native_ops") is False:
            label += " torch-kernels"
    return label


def _is_ours(worker: str) -> bool:
    return worker.partition(":")[0] == "ours"


def _ours_spec(worker: str) -> str:
    return worker.partition(":")[2] or "default"
