"""Engine arguments, validated up front with errors that name the argument."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import INT32_MAX

if TYPE_CHECKING:
    import torch

# The dtype names the engine accepts. torch is imported only where a dtype is made, so
# argument parsers and the gateway (which shares modules that import this one) can use
# the names without loading torch.
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


_SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for one of ``DTYPES``."""
    import torch

    if name not in DTYPES:
        raise KeyError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    dtype: torch.dtype = getattr(torch, _SHORT_NAMES.get(name, name))
    return dtype


QUANTIZATION_METHODS = ("int8",)  # EngineConfig.quantization (kvserve.model.quant)

# EngineConfig.kv_cache_dtype (docs/engine.md, "fp8 KV cache"), vLLM's names: auto keeps
# the KV cache in the model's dtype; fp8 is vLLM's alias of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in for one of ``KV_CACHE_DTYPES``."""
    import torch

    name = _KV_CACHE_ALIASES.get(name, name)
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return torch.float8_e4m3fn
    if name == "fp8_e5m2":
        return torch.float8_e5m2
    raise KeyError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB, capped at what max_num_seqs full requests need


def model_dir_problem(model: str) -> str | None:
    """Why ``model`` is not a checkpoint directory the engine could load, or None; a
    command checks it before it imports torch, so a mistyped path fails at once."""
    path = Path(model)
    if path.is_dir():
        return None
    what = "is a file, not a directory" if path.exists() else "does not exist"
    return (
        f"model directory {model!r} {what} (pass a local Hugging Face checkpoint directory; "
        "nothing is downloaded)"
    )


# The files of a tokenizer folder (what transformers' AutoTokenizer reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_files(folder: str | Path) -> list[str]:
    """The ``TOKENIZER_FILES`` present in ``folder``."""
    return [name for name in TOKENIZER_FILES if (Path(folder) / name).exists()]


def tokenizer_problem(tokenizer: str | None, model: str) -> str | None:
    """What is wrong with the tokenizer the engine would load (``tokenizer``, else the
    model's folder), found without the tokenizer library: none there although one was
    named, or one of its JSON files unreadable (the library's own error does not say
    which file it was reading). The library's other checks come at load."""
    from kvserve.json_input import JSONInputError, read_json_object

    folder = Path(tokenizer or model)
    present = tokenizer_files(folder)
    if not present:
        if tokenizer is None:
            return None  # served without one: token-id requests only
        return f"tokenizer {tokenizer!r}: no tokenizer there ({', '.join(TOKENIZER_FILES)})"
    for name in present:
        if name.endswith(".json"):
            try:
                read_json_object(folder / name)
            except JSONInputError as e:
                return tokenizer_load_failure(folder, present, f"{name}: {e}")
    return None


def tokenizer_load_failure(folder: str | Path, present: list[str], detail: str) -> str:
    """The error for a tokenizer folder holding ``present`` that cannot be loaded."""
    return f"{folder}: the tokenizer ({', '.join(present)}) cannot be loaded: {detail}"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens: ceil(tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class Option:
    """How one ``EngineConfig`` field appears outside Python (``kvserve.engine_options``).

    ``flag``: its ``kvserve serve`` flag (None: not a flag); a boolean's flag that starts
    with ``--no-`` turns it off. ``crd``: its name in an ``InferenceModel``'s
    ``spec.engine`` (None: not in the CRD). ``operator_owned``: the operator sets the flag
    itself (from other spec fields), so ``spec.engine.extraArgs`` may not.
    ``minimum``/``maximum`` bound a number in the CRD's schema; ``choices`` an enum.
    """

    help: str
    flag: str | None = None
    crd: str | None = None
    operator_owned: bool = False
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # choices the flag also takes, left out of the CRD
    shown_default: str | None = None  # the docs' "default" column, when not the value


def bound_problem(option: Option, value: float) -> str | None:
    """Why ``value`` lies outside ``option``'s bounds (``must be >= 1 and <= 256``), or
    None. The one rule for ``EngineConfig``, the ``kvserve serve`` flags and the CRD."""
    low, high, open_low = option.minimum, option.maximum, option.exclusive_minimum
    too_low = low is not None and (value <= low if open_low else value < low)
    if not too_low and (high is None or value <= high):
        return None
    bounds = [f"> {low:g}" if open_low else f">= {low:g}"] if low is not None else []
    bounds += [f"<= {high:g}"] if high is not None else []
    return f"must be {' and '.join(bounds)}"


def value_type(hint: Any) -> tuple[Any, bool]:
    """A field's type hint as its value type and whether None is a value of it:
    ``int | None`` is ``(int, True)``, ``dict[str, Any]`` is ``(dict, False)``."""
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    kind = next(a for a in args if a is not type(None)) if optional else hint
    return typing.get_origin(kind) or kind, optional


@functools.cache
def _value_types() -> dict[str, Any]:
    """Each ``EngineConfig`` field's value type (``value_type``)."""
    return {name: value_type(h)[0] for name, h in typing.get_type_hints(EngineConfig).items()}


def _option(default: Any, option: Option) -> Any:
    """A dataclass field with its default (written here once) and its ``Option``."""
    return field(default=default, metadata={"option": option})


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block; EngineConfig's default, shared by the tools


DEFAULT_SPECULATIVE_MAX_BATCH = 8  # measured: docs/performance.md, "Speculative decoding"
SPECULATIVE_METHODS = ("ngram", "suffix")
DEFAULT_SUFFIX_MIN_TOKEN_PROB = 0.1  # vLLM's default
DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX = 1, 5  # a missing bound's default
# "suffix" stores every n-gram up to prompt_lookup_max, so a learned token costs the sum of
# their lengths (~max²/2): the longest allowed is vLLM's default suffix tree depth (its
# suffix_decoding_max_tree_depth, which bounds match and draft together).
MAX_SUFFIX_PROMPT_LOOKUP = 24


@dataclass(frozen=True)
class SpeculativeSettings:
    """A checked ``speculative_config`` (vLLM's keys and meanings)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # "suffix" only: the least share of a context's followers the drafted token must have.
    suffix_decoding_min_token_prob: float = DEFAULT_SUFFIX_MIN_TOKEN_PROB


def speculative_settings(config: dict[str, Any] | SpeculativeSettings) -> SpeculativeSettings:
    """Check a ``speculative_config`` mapping; ValueError names the key that is wrong."""
    if isinstance(config, SpeculativeSettings):
        return config
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {config!r}")
    keys = (
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "suffix_decoding_min_token_prob",
    )
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise ValueError(
            f"speculative_config has unknown key {unknown[0]!r} (known: {', '.join(keys)})"
        )
    method = config.get("method", "ngram")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
            f"got {method!r}"
        )
    if "num_speculative_tokens" not in config:
        raise ValueError("speculative_config.num_speculative_tokens is required")

    def integer(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config.{key} must be an integer ≥ 1, got {value!r}")
        return value

    k = integer("num_speculative_tokens", config["num_speculative_tokens"])
    # Missing bounds: min 1, max 5 (or min, when min is larger).
    lo = integer("prompt_lookup_min", config.get("prompt_lookup_min", DEFAULT_PROMPT_LOOKUP_MIN))
    hi = integer(
        "prompt_lookup_max", config.get("prompt_lookup_max", max(lo, DEFAULT_PROMPT_LOOKUP_MAX))
    )
    if lo > hi:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({lo}) must be ≤ prompt_lookup_max ({hi})"
        )
    if method == "suffix" and hi > MAX_SUFFIX_PROMPT_LOOKUP:
        # Without prompt_lookup_max, it is prompt_lookup_min that is too large.
        key = "prompt_lookup_max" if "prompt_lookup_max" in config else "prompt_lookup_min"
        raise ValueError(
            f"speculative_config.{key} must be ≤ {MAX_SUFFIX_PROMPT_LOOKUP} for method "
            f'"suffix" (the history stores every n-gram up to that length), got {hi}'
        )
    prob = config.get("suffix_decoding_min_token_prob", DEFAULT_SUFFIX_MIN_TOKEN_PROB)
    if method != "suffix" and "suffix_decoding_min_token_prob" in config:
        raise ValueError(
            'speculative_config.suffix_decoding_min_token_prob is for method "suffix" only'
        )
    if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 < prob <= 1:
        raise ValueError(
            "speculative_config.suffix_decoding_min_token_prob must be a number in (0, 1], "
            f"got {prob!r}"
        )
    return SpeculativeSettings(method, k, lo, hi, float(prob))


@dataclass
class EngineConfig:
    """Everything that shapes an engine; the defaults suit a laptop CPU.

    Each field's default is written here once; its flag, CRD name and help live in its
    ``Option``, from which ``kvserve serve``'s flags, ``LLM(**kwargs)``, the operator's
    mapping and the CRD's ``engine`` block are made (``kvserve.engine_options``).

    ``num_kv_blocks`` fixes the KV pool size directly; otherwise it is derived from
    ``kv_cache_memory`` bytes, or on CUDA from ``gpu_memory_utilization`` of the GPU's
    memory after the weights are loaded, or on CPU from 1 GiB (but no more blocks than
    ``max_num_seqs`` requests of ``max_model_len`` tokens need).
    """

    model: str = field(
        metadata={
            "option": Option(
                "Hugging Face checkpoint directory (LLM() and kvserve serve default to the "
                "bundled travel-assistant demo model, kvserve-travel-tiny)",
                flag="--model",
                operator_owned=True,
                shown_default="the demo model",
            )
        }
    )
    tokenizer: str | None = _option(
        None, Option("tokenizer directory (default: the checkpoint's)", flag="--tokenizer")
    )
    dtype: str = _option(
        "auto",
        Option(
            "weights dtype, and the KV cache's unless kv_cache_dtype is set; auto: on CUDA "
            "the checkpoint's (or bfloat16), on CPU bfloat16 where the CPU computes it "
            "natively, else float32",
            flag="--dtype",
            crd="dtype",
            choices=("auto", *DTYPES),
            aliases=tuple(_SHORT_NAMES),
        ),
    )
    # int8 weight-only quantization (docs/engine.md, "int8 weights").
    quantization: str | None = _option(
        None,
        Option(
            "weight quantization; int8: per-output-channel int8 weights for the attention "
            "and MLP projections, made at load (default: none, the weights stay in dtype)",
            flag="--quantization",
            crd="quantization",
            choices=QUANTIZATION_METHODS,
        ),
    )
    # fp8 KV cache (docs/engine.md, "fp8 KV cache"): vLLM's flag and names.
    kv_cache_dtype: str = _option(
        "auto",
        Option(
            "KV cache storage dtype; auto: the model's dtype; fp8_e4m3 (alias fp8) or "
            "fp8_e5m2: one byte per element with a per-layer scale, twice the blocks of "
            "bf16 in the same memory",
            flag="--kv-cache-dtype",
            crd="kvCacheDtype",
            choices=KV_CACHE_DTYPES,
            aliases=tuple(_KV_CACHE_ALIASES),
        ),
    )
    device: str = _option(
        "auto",
        Option(
            "cpu, cuda or cuda:N; auto: cuda when available",
            flag="--device",
        ),
    )
    block_size: int = _option(
        DEFAULT_BLOCK_SIZE,
        Option(
            "tokens per KV-cache block",
            flag="--block-size",
            crd="blockSize",
            minimum=1,
            maximum=256,
        ),
    )
    max_num_seqs: int = _option(
        64,
        Option(
            "most requests in one step's batch",
            flag="--max-num-seqs",
            crd="maxNumSeqs",
            minimum=1,
            maximum=4096,
        ),
    )
    max_num_batched_tokens: int = _option(
        2048,
        Option(
            "token budget of one step (decodes plus prefill chunks)",
            flag="--max-num-batched-tokens",
            crd="maxNumBatchedTokens",
            minimum=1,
            maximum=INT32_MAX,
        ),
    )
    max_model_len: int | None = _option(
        None,
        Option(
            "longest prompt + output in tokens (default: the model's max_position_embeddings)",
            flag="--max-model-len",
            crd="maxModelLen",
            minimum=1,
            maximum=INT32_MAX,
        ),
    )
    num_kv_blocks: int | None = _option(
        None,
        Option(
            "KV-cache blocks (default: from the memory settings)", flag="--num-kv-blocks", minimum=1
        ),
    )
    kv_cache_memory: int | None = _option(
        None,
        Option(
            "bytes for the KV cache (default: from gpu_memory_utilization on CUDA, 1 GiB on CPU)",
            flag="--kv-cache-memory",
            minimum=1,
        ),
    )
    gpu_memory_utilization: float = _option(
        0.9,
        Option(
            "share of the GPU's memory the engine may use (weights + KV cache)",
            flag="--gpu-memory-utilization",
            crd="kvCacheMemoryFraction",
            minimum=0,
            exclusive_minimum=True,
            maximum=1,
        ),
    )
    enable_prefix_caching: bool = _option(
        True,
        Option(
            "reuse the KV blocks of shared prompt prefixes",
            flag="--no-prefix-caching",
            crd="enablePrefixCaching",
        ),
    )
    seed: int = _option(0, Option("seed of the sampler's default generator", flag="--seed"))
    # Tensor parallelism (docs/engine.md, "Tensor parallelism"): vLLM's name. Rank 0 runs
    # the scheduler and sampler; the other ranks are worker processes (kvserve.parallel).
    tensor_parallel_size: int = _option(
        1,
        Option(
            "shard the model across this many ranks (processes; one GPU each on CUDA): "
            "attention heads, MLP and vocabulary split Megatron-style",
            flag="--tensor-parallel-size",
            crd="tensorParallelSize",
            minimum=1,
            maximum=1024,
        ),
    )
    # LoRA adapters (docs/engine.md, "LoRA adapters"). Not in the CRD's engine block: an
    # InferenceModel's spec.lora will own them (issue 20, item 5).
    enable_lora: bool = _option(
        False, Option("serve LoRA adapters (PEFT format) chosen per request", flag="--enable-lora")
    )
    max_loras: int = _option(
        1,
        Option(
            "LoRA adapters in the compute device's slots at once (one batch mixes them all)",
            flag="--max-loras",
            minimum=1,
        ),
    )
    max_lora_rank: int = _option(
        16,
        Option(
            "highest LoRA rank r served (slots are sized for it)",
            flag="--max-lora-rank",
            minimum=1,
        ),
    )
    max_cpu_loras: int | None = _option(
        None,
        Option(
            "idle LoRA adapters kept in host memory besides those in slots (default: max_loras)",
            flag="--max-cpu-loras",
            minimum=0,
        ),
    )
    # Speculative decoding (docs/engine.md, "Speculative decoding"): vLLM's names.
    speculative_config: dict[str, Any] | None = field(
        default=None,
        metadata={
            "option": Option(
                'speculative decoding, as JSON: {"method": "ngram" or "suffix", '
                '"num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b} '
                "(suffix also takes suffix_decoding_min_token_prob; default: off)",
                flag="--speculative-config",
            )
        },
    )
    speculative_max_batch: int = _option(
        DEFAULT_SPECULATIVE_MAX_BATCH,
        Option(
            "skip speculation in a step with at least this many decoding requests (there "
            "verifying drafts costs more than it saves)",
            flag="--speculative-max-batch",
            minimum=1,
        ),
    )
    # KV-cache events (docs/engine.md, "KV-cache events"): vLLM's flags and wire format,
    # for precise-prefix routers. Not in the CRD: spec.engine.extraArgs can pass them.
    kv_events_endpoint: str | None = _option(
        None,
        Option(
            "publish the prefix cache's changes (BlockStored, BlockRemoved, "
            "AllBlocksCleared) in vLLM's KV-events format on this ZMQ PUB endpoint: "
            "tcp://*:PORT binds, tcp://HOST:PORT connects (default: off)",
            flag="--kv-events-endpoint",
        ),
    )
    kv_events_replay_endpoint: str | None = _option(
        None,
        Option(
            "ZMQ ROUTER endpoint (bound) where a late subscriber asks for the batches it "
            "missed, by sequence number (default: no replay)",
            flag="--kv-events-replay-endpoint",
        ),
    )
    kv_events_topic: str | None = _option(
        None,
        Option(
            "topic frame of each KV-events message (default: empty, as vLLM's)",
            flag="--kv-events-topic",
        ),
    )
    # Reference mode for tests: drop every request's KV after each step, so each token
    # is computed from scratch over the whole sequence (slow; prefix caching is off).
    recompute_every_step: bool = _option(
        False, Option("reference mode for tests: recompute every token from scratch")
    )

    def __post_init__(self) -> None:
        for f in fields(self):  # each number within its Option's bounds (as in the CRD)
            option, value = f.metadata["option"], getattr(self, f.name)
            if value is None or (option.minimum is None and option.maximum is None):
                continue
            integer = _value_types()[f.name] is int
            if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
                kind = "an integer" if integer else "a number"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
            if (problem := bound_problem(option, value)) is not None:
                raise ValueError(f"{f.name} {problem}, got {value!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        # Stored under its full name, so logs and status show the format in use.
        self.kv_cache_dtype = _KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not _cuda_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available here")
        if self.speculative_config is not None:
            # Stored complete (defaults filled in), so logs and /metrics show every key.
            settings = speculative_settings(self.speculative_config)
            self.speculative_config = asdict(settings)
            if settings.method != "suffix":  # its key means nothing to the others
                del self.speculative_config["suffix_decoding_min_token_prob"]
        if self.recompute_every_step:
            self.enable_prefix_caching = False

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return torch_dtype(self.dtype)
        if self.torch_device().type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        if checkpoint_dtype in DTYPES:
            return torch_dtype(checkpoint_dtype)
        return torch.bfloat16


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN computes bf16 natively here (AVX512-BF16 or AMX). Without it a bf16
    matmul is emulated and several times slower than fp32 (`kvserve bench suite --only
    roofline` measured 21 vs 169 GFLOP/s on an AVX2-only CPU)."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe and probe())
