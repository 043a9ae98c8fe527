"""The load test's own options, defined once for Locust's parser and for ``kvserve loadtest``.

The locustfile adds them to Locust's command line (``@events.init_command_line_parser``),
so ``locust -f loadtests/locustfile.py --workload agents --slo-ttft-ms 1000 ...`` works, and
they show in the web UI's form; ``kvserve loadtest run`` adds the same ones and turns its
namespace back into Locust arguments with :func:`to_argv`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.arg_types import non_negative_seconds
from kvserve.loadtest.report import Slo, WindowRule
from kvserve.loadtest.workloads import WORKLOADS

SHAPES = ("constant", "step", "poisson")
DEFAULT_STOP_TIMEOUT_S = 300.0  # how long the end of a run waits for requests in flight


@dataclass(frozen=True)
class Opt:
    flag: str
    kwargs: dict[str, Any]
    locust_kwargs: dict[str, Any] | None = None  # only for Locust's parser (web UI form)

    @property
    def dest(self) -> str:
        return str(self.kwargs.get("dest") or self.flag.lstrip("-").replace("-", "_"))


OPTIONS: tuple[Opt, ...] = (
    Opt("--workload", {"choices": sorted(WORKLOADS), "default": "chat",
        "help": "request mix: chat (varied lengths), agents (shared ~200-token system "
        "prompt), rag (long prompts), cancel (30%% of clients disconnect mid-stream)"}),
    Opt("--load-shape", {"choices": SHAPES, "default": "constant",
        "help": "constant: -u closed-loop users for -t; step: a step ramp of "
        "--step-users more users every --step-seconds, --steps times; poisson: open-loop "
        "arrivals at --rate requests/s, whatever the responses do"}),
    Opt("--rate", {"type": float, "default": 1.0,
        "help": "poisson shape: mean arrivals per second"}),
    Opt("--max-outstanding", {"type": int, "default": 512,
        "help": "poisson shape: at most this many requests in flight; an arrival beyond "
        "it is recorded as a failed request (the server is far past saturation)"}),
    Opt("--step-users", {"type": int, "default": 2,
        "help": "step shape: users added at each step"}),
    Opt("--step-seconds", {"type": float, "default": 30.0,
        "help": "step shape: seconds per step"}),
    Opt("--steps", {"type": int, "default": 5, "help": "step shape: number of steps"}),
    Opt("--think-time", {"type": float, "default": 0.0,
        "help": "closed-loop users: seconds to wait between a response and the next request"}),
    Opt("--slo-ttft-ms", {"type": float, "default": None,
        "help": "TTFT SLO in ms (client side: send to first visible token)"}),
    Opt("--slo-tpot-ms", {"type": float, "default": None,
        "help": "TPOT SLO in ms ((last − first token) / (output tokens − 1))"}),
    Opt("--slo-attainment", {"type": float, "default": 0.9,
        "help": "share of requests that must meet every SLO; below it the process exits "
        "with code 1 (a CI gate)"}),
    Opt("--window", {"choices": ("cohort", "steady"), "default": "cohort",
        "help": "report window: cohort (every request, first send to last done) or "
        "steady (requests sent after --warmup-s and before the last --cooldown-s)"}),
    Opt("--warmup-s", {"type": non_negative_seconds, "default": 0.0,
        "help": "steady window: warm-up"}),
    Opt("--cooldown-s", {"type": non_negative_seconds, "default": 0.0,
        "help": "steady window: cool-down"}),
    Opt("--out-dir", {"default": "loadtest-out",
        "help": "where records.jsonl, summary.json, summary.csv and the PNGs go"}),
    Opt("--model", {"default": "",
        "help": "the model name to send (default: the first of GET /v1/models)"}),
    Opt("--api-key", {"default": "",
        "help": "Bearer token for the gateway (default: $KVSERVE_API_KEY; none for a bare "
        "engine server)"}, {"is_secret": True}),
    Opt("--max-tokens", {"type": int, "default": None,
        "help": "every request's max_tokens (default: the workload's own mix)"}),
    Opt("--context-tokens", {"type": int, "default": None,
        "help": "the model's context length, to size prompts (default: max_model_len from "
        "GET /v1/models, else 4096)"}),
    Opt("--tokens-per-word", {"type": float, "default": None,
        "help": "the tokenizer's tokens per word on the workloads' text, to size prompts "
        "(default: measured at the start with one 1-token request)"}),
    Opt("--ignore-eos", {"action": "store_true", "default": False,
        "help": "send ignore_eos (a kvserve/vLLM extension) so every output runs to "
        "max_tokens"}),
    Opt("--seed", {"type": int, "default": 0, "help": "the workload's seed"}),
    Opt("--request-timeout", {"type": float, "default": 600.0,
        "help": "seconds without a byte from the server before a request fails"}),
    Opt("--no-plots", {"action": "store_true", "default": False,
        "help": "skip the PNG charts"}),
)  # fmt: skip


def add_options(add_argument: Callable[..., Any], locust: bool = False) -> None:
    """Add every option with ``add_argument`` (argparse's, or Locust's with ``locust``)."""
    for opt in OPTIONS:
        add_argument(opt.flag, **opt.kwargs, **((locust and opt.locust_kwargs) or {}))


def to_argv(ns: Any) -> list[str]:
    """The options set in ``ns`` (non-default ones only), as command-line arguments."""
    argv: list[str] = []
    for opt in OPTIONS:
        value = getattr(ns, opt.dest, opt.kwargs.get("default"))
        if value == opt.kwargs.get("default"):
            continue
        if opt.kwargs.get("action") == "store_true":
            argv.append(opt.flag)
        else:
            argv += [opt.flag, str(value)]
    return argv


@dataclass(frozen=True)
class Settings:
    """The parsed options, typed (Locust's namespace is untyped)."""

    workload: str
    load_shape: str
    rate: float
    max_outstanding: int
    step_users: int
    step_seconds: float
    steps: int
    think_time: float
    slo: Slo
    window: WindowRule
    out_dir: Path
    model: str
    api_key: str
    max_tokens: int | None
    context_tokens: int | None
    tokens_per_word: float | None
    ignore_eos: bool
    seed: int
    request_timeout: float
    plots: bool

    @classmethod
    def from_namespace(cls, ns: Any) -> Settings:
        def get(name: str) -> Any:
            opt = next(o for o in OPTIONS if o.dest == name)
            default = opt.kwargs.get("default")
            value = getattr(ns, name, default)
            convert = opt.kwargs.get("type")
            if isinstance(value, str) and convert is not None:
                # Locust's web form sets options whose default is None as strings.
                value = convert(value) if value.strip() else default
            return value

        if get("load_shape") == "poisson" and not get("rate") > 0:
            raise ValueError(f"--rate must be > 0 for Poisson arrivals, got {get('rate')}")
        return cls(
            workload=get("workload"),
            load_shape=get("load_shape"),
            rate=float(get("rate")),
            max_outstanding=int(get("max_outstanding")),
            step_users=int(get("step_users")),
            step_seconds=float(get("step_seconds")),
            steps=int(get("steps")),
            think_time=float(get("think_time")),
            slo=Slo(get("slo_ttft_ms"), get("slo_tpot_ms"), float(get("slo_attainment"))),
            window=WindowRule(get("window"), float(get("warmup_s")), float(get("cooldown_s"))),
            out_dir=Path(get("out_dir")),
            model=get("model") or "",
            api_key=get("api_key") or os.environ.get("KVSERVE_API_KEY", ""),
            max_tokens=get("max_tokens"),
            context_tokens=get("context_tokens"),
            tokens_per_word=get("tokens_per_word"),
            ignore_eos=bool(get("ignore_eos")),
            seed=int(get("seed")),
            request_timeout=float(get("request_timeout")),
            plots=not get("no_plots"),
        )

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def extra_body(self) -> dict[str, Any]:
        return {"ignore_eos": True} if self.ignore_eos else {}


def describe_argv(argv: Sequence[str]) -> str:
    """A command line for logs, with the API key hidden."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "***"
    return " ".join(out)
