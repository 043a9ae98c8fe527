"""An InferenceModel's spec, parsed into frozen dataclasses with the CRD's defaults.

The API server validates and defaults a spec against the CRD schema before the operator
sees it, so in a cluster most checks here never fire. They are repeated because the
renderers are also called with partial specs (tests, ``kubectl apply`` against a cluster
that has an older CRD), and an invalid spec must become a clear ``SpecError`` in the
resource's status rather than a broken Deployment.

The dataclass field defaults are the single Python copy of the CRD's ``default:`` values;
tests/operator/test_crd.py compares the two.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.model.pull import ModelPullError, ModelSource, parse_source

Metric = Literal["queueDepth", "inFlight"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
METRICS: tuple[str, ...] = ("queueDepth", "inFlight")
PULL_POLICIES: tuple[str, ...] = ("Always", "IfNotPresent", "Never")
CACHE_MEDIA: tuple[str, ...] = ("", "Memory")

# `kvserve serve` flags that the operator derives itself: the Pod's ports, probes, drain
# and the gateway's discovery depend on them, so spec.engine.extraArgs may not override
# them (argparse keeps the last occurrence). The CRD refuses the same list.
OPERATOR_OWNED_FLAGS: tuple[str, ...] = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--grpc-port",
    "--no-grpc",
    "--drain-timeout",
)

# The Kubernetes resource.Quantity syntax (as in controller-gen's CRDs).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A domain-qualified extended resource name such as nvidia.com/gpu.
GPU_RESOURCE_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)
_GPU_RESOURCE = re.compile(GPU_RESOURCE_PATTERN)

INT32_MAX = 2**31 - 1


class SpecError(ValueError):
    """An invalid spec; ``path`` names the field (e.g. ``spec.engine.blockSize``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class HfTokenSecret:
    name: str
    key: str = "HF_TOKEN"


@dataclass(frozen=True)
class ModelSpec:
    source: str
    served_name: str | None = None
    hf_token_secret: HfTokenSecret | None = None
    config_map: str | None = None

    @property
    def parsed_source(self) -> ModelSource:
        """The source parsed by ``kvserve model pull``'s own parser (validated by parse_spec)."""
        return parse_source(self.source)


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int | None = None
    metric: Metric = "queueDepth"
    target: float = 4.0
    scale_up_stabilization_seconds: int = 30
    scale_down_delay_seconds: int = 300


@dataclass(frozen=True)
class ResourceSpec:
    gpus: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    gpu_memory_gib: float = 80.0
    cpu: str | int | None = None
    memory: str | int | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    dtype: Dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    drain_timeout_seconds: int = 30
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelCacheSpec:
    size_limit: str | int = "100Gi"
    medium: str = ""


@dataclass(frozen=True)
class SloSpec:
    ttft_seconds: float = 2.0
    tpot_seconds: float = 0.1
    attainment: float = 0.99


@dataclass(frozen=True)
class InferenceModelSpec:
    model: ModelSpec
    replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    image: str | None = None
    image_pull_policy: str | None = None
    env: tuple[Mapping[str, Any], ...] = ()
    model_cache: ModelCacheSpec = field(default_factory=ModelCacheSpec)
    slo: SloSpec = field(default_factory=SloSpec)

    @property
    def source(self) -> ModelSource:
        return self.model.parsed_source


# ---- parsing --------------------------------------------------------------------------


def parse_spec(spec: Mapping[str, Any]) -> InferenceModelSpec:
    """Validate ``spec`` (the CR's ``.spec``) and fill in the CRD's defaults."""
    r = _Reader(spec, "spec")
    r.known(
        "model",
        "replicas",
        "autoscaling",
        "resources",
        "engine",
        "image",
        "imagePullPolicy",
        "env",
        "modelCache",
        "slo",
    )
    kw: dict[str, Any] = {"model": _parse_model(r.required_object("model"))}
    _put(kw, "replicas", r.get_int("replicas", minimum=0, maximum=INT32_MAX))
    if (a := r.get_object("autoscaling")) is not None:
        kw["autoscaling"] = _parse_autoscaling(a)
    if (res := r.get_object("resources")) is not None:
        kw["resources"] = _parse_resources(res)
    if (e := r.get_object("engine")) is not None:
        kw["engine"] = _parse_engine(e)
    _put(kw, "image", r.get_str("image", min_length=1))
    _put(kw, "image_pull_policy", r.get_enum("imagePullPolicy", PULL_POLICIES))
    if (env := r.get_list("env")) is not None:
        kw["env"] = _parse_env(env, f"{r.path}.env")
    if (mc := r.get_object("modelCache")) is not None:
        kw["model_cache"] = _parse_model_cache(mc)
    if (slo := r.get_object("slo")) is not None:
        kw["slo"] = _parse_slo(slo)
    return InferenceModelSpec(**kw)


def _parse_model(r: _Reader) -> ModelSpec:
    r.known("source", "servedName", "hfTokenSecret", "configMap")
    source = r.get_str("source", min_length=1)
    if source is None:
        raise SpecError(f"{r.path}.source", "required")
    try:
        parse_source(source)
    except ModelPullError as e:
        raise SpecError(f"{r.path}.source", str(e)) from None
    kw: dict[str, Any] = {"source": source}
    _put(kw, "served_name", r.get_str("servedName", min_length=1, max_length=256))
    if (s := r.get_object("hfTokenSecret")) is not None:
        s.known("name", "key")
        name = s.get_str("name", min_length=1)
        if name is None:
            raise SpecError(f"{s.path}.name", "required")
        secret: dict[str, Any] = {"name": name}
        _put(secret, "key", s.get_str("key", min_length=1))
        kw["hf_token_secret"] = HfTokenSecret(**secret)
    _put(kw, "config_map", r.get_str("configMap", min_length=1))
    return ModelSpec(**kw)


def _parse_autoscaling(r: _Reader) -> AutoscalingSpec:
    r.known(
        "enabled",
        "minReplicas",
        "maxReplicas",
        "metric",
        "target",
        "scaleUpStabilizationSeconds",
        "scaleDownDelaySeconds",
    )
    kw: dict[str, Any] = {}
    _put(kw, "enabled", r.get_bool("enabled"))
    _put(kw, "min_replicas", r.get_int("minReplicas", minimum=0, maximum=INT32_MAX))
    _put(kw, "max_replicas", r.get_int("maxReplicas", minimum=1, maximum=INT32_MAX))
    _put(kw, "metric", r.get_enum("metric", METRICS))
    _put(kw, "target", r.get_number("target", exclusive_minimum=0))
    _put(
        kw,
        "scale_up_stabilization_seconds",
        r.get_int("scaleUpStabilizationSeconds", minimum=0, maximum=INT32_MAX),
    )
    _put(
        kw,
        "scale_down_delay_seconds",
        r.get_int("scaleDownDelaySeconds", minimum=0, maximum=INT32_MAX),
    )
    a = AutoscalingSpec(**kw)
    if a.enabled and a.max_replicas is None:
        raise SpecError(f"{r.path}.maxReplicas", "required when autoscaling.enabled is true")
    if a.max_replicas is not None and a.min_replicas > a.max_replicas:
        raise SpecError(
            f"{r.path}.minReplicas",
            f"autoscaling.minReplicas must be <= autoscaling.maxReplicas "
            f"(got {a.min_replicas} > {a.max_replicas})",
        )
    return a


def _parse_resources(r: _Reader) -> ResourceSpec:
    r.known(
        "gpus",
        "gpuResourceName",
        "gpuMemoryGiB",
        "cpu",
        "memory",
        "nodeSelector",
        "tolerations",
        "priorityClassName",
    )
    kw: dict[str, Any] = {}
    _put(kw, "gpus", r.get_int("gpus", minimum=0, maximum=INT32_MAX))
    name = r.get_str("gpuResourceName")
    if name is not None and not _GPU_RESOURCE.fullmatch(name):
        raise SpecError(
            f"{r.path}.gpuResourceName",
            f"{name!r} is not a domain-qualified resource name such as nvidia.com/gpu",
        )
    _put(kw, "gpu_resource_name", name)
    _put(kw, "gpu_memory_gib", r.get_number("gpuMemoryGiB", exclusive_minimum=0))
    _put(kw, "cpu", r.get_quantity("cpu"))
    _put(kw, "memory", r.get_quantity("memory"))
    if (ns := r.get_object("nodeSelector")) is not None:
        selector: dict[str, str] = {}
        for key in ns.data:
            value = ns.get_str(key)
            assert value is not None
            selector[str(key)] = value
        kw["node_selector"] = selector
    if (tol := r.get_list("tolerations")) is not None:
        items: list[Mapping[str, Any]] = []
        for i, item in enumerate(tol):
            if not isinstance(item, Mapping):
                raise SpecError(f"{r.path}.tolerations[{i}]", _type_msg("an object", item))
            items.append(dict(item))
        kw["tolerations"] = tuple(items)
    _put(kw, "priority_class_name", r.get_str("priorityClassName", min_length=1))
    return ResourceSpec(**kw)


def _parse_engine(r: _Reader) -> EngineSpec:
    r.known(
        "dtype",
        "maxModelLen",
        "maxNumSeqs",
        "maxNumBatchedTokens",
        "blockSize",
        "kvCacheMemoryFraction",
        "enablePrefixCaching",
        "drainTimeoutSeconds",
        "extraArgs",
    )
    kw: dict[str, Any] = {}
    _put(kw, "dtype", r.get_enum("dtype", DTYPES))
    _put(kw, "max_model_len", r.get_int("maxModelLen", minimum=1, maximum=INT32_MAX))
    _put(kw, "max_num_seqs", r.get_int("maxNumSeqs", minimum=1, maximum=4096))
    _put(
        kw,
        "max_num_batched_tokens",
        r.get_int("maxNumBatchedTokens", minimum=1, maximum=INT32_MAX),
    )
    _put(kw, "block_size", r.get_int("blockSize", minimum=1, maximum=256))
    _put(
        kw,
        "kv_cache_memory_fraction",
        r.get_number("kvCacheMemoryFraction", exclusive_minimum=0, maximum=1),
    )
    _put(kw, "enable_prefix_caching", r.get_bool("enablePrefixCaching"))
    _put(kw, "drain_timeout_seconds", r.get_int("drainTimeoutSeconds", minimum=0, maximum=3600))
    if (args := r.get_list("extraArgs")) is not None:
        out: list[str] = []
        for i, arg in enumerate(args):
            path = f"{r.path}.extraArgs[{i}]"
            if not isinstance(arg, str):
                raise SpecError(path, _type_msg("a string", arg))
            flag = arg.partition("=")[0]
            if flag in OPERATOR_OWNED_FLAGS:
                raise SpecError(path, f"{flag} is set by the operator; use the spec fields instead")
            out.append(arg)
        kw["extra_args"] = tuple(out)
    return EngineSpec(**kw)


def _parse_env(items: Sequence[Any], path: str) -> tuple[Mapping[str, Any], ...]:
    out: list[Mapping[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise SpecError(f"{path}[{i}]", _type_msg("an object", item))
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"{path}[{i}].name", "required (a non-empty string)")
        if name in seen:
            # A list keyed by name in server-side apply: duplicates are rejected there.
            raise SpecError(f"{path}[{i}].name", f"duplicate variable {name!r}")
        seen.add(name)
        out.append(dict(item))
    return tuple(out)


def _parse_model_cache(r: _Reader) -> ModelCacheSpec:
    r.known("sizeLimit", "medium")
    kw: dict[str, Any] = {}
    _put(kw, "size_limit", r.get_quantity("sizeLimit"))
    _put(kw, "medium", r.get_enum("medium", CACHE_MEDIA))
    return ModelCacheSpec(**kw)


def _parse_slo(r: _Reader) -> SloSpec:
    r.known("ttftSeconds", "tpotSeconds", "attainment")
    kw: dict[str, Any] = {}
    _put(kw, "ttft_seconds", r.get_number("ttftSeconds", exclusive_minimum=0))
    _put(kw, "tpot_seconds", r.get_number("tpotSeconds", exclusive_minimum=0))
    _put(kw, "attainment", r.get_number("attainment", exclusive_minimum=0, maximum=1))
    return SloSpec(**kw)


# ---- helpers --------------------------------------------------------------------------


def _put(kw: dict[str, Any], key: str, value: object) -> None:
    """Pass only fields that are present, so absent ones take the dataclass default."""
    if value is not None:
        kw[key] = value


def _type_msg(expected: str, value: object) -> str:
    return f"expected {expected}, got {type(value).__name__} {value!r}"


class _Reader:
    """Typed access to one object of the spec; every error names the field's path."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise SpecError(path, _type_msg("an object", data))
        self.data: Mapping[str, Any] = data
        self.path = path

    def known(self, *keys: str) -> None:
        # The API server prunes unknown fields; here they are most likely typos in tests.
        for key in self.data:
            if key not in keys:
                raise SpecError(f"{self.path}.{key}", "unknown field")

    def _get(self, key: str, kinds: tuple[type, ...], expected: str) -> Any:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise SpecError(f"{self.path}.{key}", _type_msg(expected, value))
        return value

    def get_object(self, key: str) -> _Reader | None:
        value = self.data.get(key)
        return None if value is None else _Reader(value, f"{self.path}.{key}")

    def required_object(self, key: str) -> _Reader:
        if self.data.get(key) is None:
            raise SpecError(f"{self.path}.{key}", "required")
        return _Reader(self.data[key], f"{self.path}.{key}")

    def get_list(self, key: str) -> Sequence[Any] | None:
        value: Sequence[Any] | None = self._get(key, (list, tuple), "a list")
        return value

    def get_str(
        self, key: str, *, min_length: int = 0, max_length: int | None = None
    ) -> str | None:
        value: str | None = self._get(key, (str,), "a string")
        if value is None:
            return None
        if len(value) < min_length:
            raise SpecError(f"{self.path}.{key}", "must not be empty")
        if max_length is not None and len(value) > max_length:
            raise SpecError(f"{self.path}.{key}", f"longer than {max_length} characters")
        return value

    def get_bool(self, key: str) -> bool | None:
        value: bool | None = self._get(key, (bool,), "a boolean")
        return value

    def get_enum(self, key: str, allowed: Sequence[str]) -> str | None:
        value = self.get_str(key)
        if value is not None and value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise SpecError(f"{self.path}.{key}", f"must be one of {choices} (got {value!r})")
        return value

    def get_int(self, key: str, *, minimum: int, maximum: int) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        # JSON has one number type: 4.0 is an integer to the API server too.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.path}.{key}", _type_msg("an integer", value))
        if not minimum <= value <= maximum:
            raise SpecError(
                f"{self.path}.{key}", f"must be between {minimum} and {maximum} (got {value})"
            )
        return value

    def get_number(
        self, key: str, *, exclusive_minimum: float, maximum: float | None = None
    ) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{self.path}.{key}", _type_msg("a number", value))
        number = float(value)
        if not number > exclusive_minimum:
            raise SpecError(
                f"{self.path}.{key}", f"must be greater than {exclusive_minimum:g} (got {value})"
            )
        if maximum is not None and number > maximum:
            raise SpecError(f"{self.path}.{key}", f"must be at most {maximum:g} (got {value})")
        return number

    def get_quantity(self, key: str) -> str | int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise SpecError(f"{self.path}.{key}", _type_msg("a quantity (e.g. 64Gi)", value))
        if isinstance(value, str) and not _QUANTITY.fullmatch(value):
            raise SpecError(f"{self.path}.{key}", f"{value!r} is not a quantity (e.g. 64Gi, 500m)")
        return value
