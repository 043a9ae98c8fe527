"""The operator's configuration: flags, then environment variables, then defaults, handed
to the handlers in Kopf's memo (never through the environment)."""

from __future__ import annotations

import logging
import os

import kopf
import pytest

from kvserve_operator import handlers
from kvserve_operator.__main__ import build_parser, config_from_args
from kvserve_operator.config import OperatorConfig, config_from_env
from kvserve_operator.render import OperatorSettings

ENV = {
    "KVSERVE_ENGINE_IMAGE": "registry.example/kvserve:env",
    "KVSERVE_IMAGE_PULL_POLICY": "Always",
    "KVSERVE_CLUSTER_DOMAIN": "example.internal",
    "KVSERVE_RECONCILE_INTERVAL": "7",
    "KVSERVE_AUTOSCALE_INTERVAL": "0.5",
    "KVSERVE_METRICS_URL_TEMPLATE": "http://{pod_name}/m",
    "KVSERVE_OPERATOR_METRICS_PORT": "9100",
    "KVSERVE_OPERATOR_METRICS_HOST": "127.0.0.1",
}


def test_no_environment_gives_the_defaults() -> None:
    assert config_from_env({}) == OperatorConfig()
    assert OperatorConfig().metrics_port is None  # `kopf run` serves no /metrics unless asked


def test_every_variable_is_read() -> None:
    assert config_from_env(ENV) == OperatorConfig(
        render=OperatorSettings(
            engine_image="registry.example/kvserve:env",
            image_pull_policy="Always",
            cluster_domain="example.internal",
        ),
        reconcile_interval_s=7.0,
        autoscale_interval_s=0.5,
        metrics_url_template="http://{pod_name}/m",
        metrics_port=9100,
        metrics_host="127.0.0.1",
    )


def test_flags_beat_the_environment_which_beats_the_defaults() -> None:
    args = build_parser().parse_args(["--engine-image", "flag:1", "--reconcile-interval", "3"])
    config = config_from_args(args, ENV)
    assert config.render.engine_image == "flag:1"
    assert config.reconcile_interval_s == 3.0
    assert config.render.cluster_domain == "example.internal"  # from the environment
    assert config.autoscale_interval_s == 0.5
    # The command line always serves /metrics (its flags have defaults).
    assert (config.metrics_port, config.metrics_host) == (8081, "0.0.0.0")
    assert config_from_args(build_parser().parse_args([]), {}) == OperatorConfig(metrics_port=8081)


def test_the_command_line_leaves_the_environment_alone() -> None:
    before = dict(os.environ)
    config_from_args(build_parser().parse_args(["--engine-image", "flag:1"]), os.environ)
    assert dict(os.environ) == before


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[OperatorConfig]:
    """Run the startup handler without a cluster: no kubeconfig, no timers registered."""
    registered: list[OperatorConfig] = []
    for variable in ("KVSERVE_OPERATOR_METRICS_PORT", "KVSERVE_AUTOSCALE_INTERVAL"):
        monkeypatch.delenv(variable, raising=False)  # no /metrics server from this process
    monkeypatch.setattr(handlers, "load_config", lambda: None)
    monkeypatch.setattr(
        handlers, "register_timers", lambda registry, config: registered.append(config)
    )
    return registered


def test_startup_uses_the_config_in_the_memo(started: list[OperatorConfig]) -> None:
    config = OperatorConfig(reconcile_interval_s=5.0)
    memo = kopf.Memo(config=config)
    handlers.startup(settings=kopf.OperatorSettings(), memo=memo, logger=logging.getLogger("test"))
    assert started == [config]
    assert memo.reconciler.config is config


def test_startup_under_kopf_run_reads_the_environment(
    started: list[OperatorConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_AUTOSCALE_INTERVAL", "2.5")
    memo = kopf.Memo()
    handlers.startup(settings=kopf.OperatorSettings(), memo=memo, logger=logging.getLogger("test"))
    assert memo.config.autoscale_interval_s == 2.5
    assert started == [memo.config]
