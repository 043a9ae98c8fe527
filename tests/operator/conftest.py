"""The ``operator`` fixture: one operator process per test module, fed fake engine metrics."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster.controlplane import Cluster
from tests.support.operator_process import (
    OPERATOR_NS,
    OPERATOR_SA,
    MetricsFeed,
    OperatorProcess,
    install_operator_rbac,
)


@pytest.fixture(scope="module")
def operator(
    k8s_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_operator_rbac(k8s_cluster)
    workdir = tmp_path_factory.mktemp("operator")
    feed = MetricsFeed()
    op = OperatorProcess(
        [
            "--reconcile-interval", "3", "--autoscale-interval", "0.5",
            "--metrics-url-template", feed.template, "--log-format", "json",
            "--engine-image", "registry.example/kvserve:test",
        ],
        k8s_cluster.service_account_kubeconfig(OPERATOR_NS, OPERATOR_SA, workdir / "kubeconfig"),
        workdir / "operator.log",
        k8s_cluster.env(),
        feed=feed,
    )  # fmt: skip
    op.start()
    try:
        yield op
    finally:
        op.stop()
        feed.close()
        if os.environ.get("KVSERVE_SHOW_OPERATOR_LOG"):
            print(op.logs())
