"""Shared fixtures: tiny random checkpoints built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support import processes
from tests.support.checkpoints import CHECKPOINTS, TRAINED_CHECKPOINTS


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Returns a function name → path of a built (cached) checkpoint."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            kwargs = dict({**CHECKPOINTS, **TRAINED_CHECKPOINTS}[name])
            arch = str(kwargs.pop("arch"))
            built[name] = build_random_checkpoint(
                tmp_path_factory.mktemp(name),
                arch,
                **kwargs,  # type: ignore[arg-type]
            )
        return built[name]

    return get


@pytest.fixture(scope="session")
def shared_replicas(checkpoint_dir):  # type: ignore[no-untyped-def]
    """Two ``kvserve serve`` replicas of the llama checkpoint (``start_replicas``' default
    flags), started once for every module that neither stops nor reconfigures its
    replicas: a test that does starts its own. Starting a pair cost ~10 s of the suite
    in each of the ten modules that now share this one."""
    from tests.support.replicas import start_replicas

    reps = start_replicas(checkpoint_dir("llama"), 2)
    yield reps
    for rep in reps:
        rep.stop()


@pytest.fixture(scope="session")
def lws_crd_file() -> Path:
    """The LeaderWorkerSet CRD file from its Go module (tests/support/lws.py); the test is
    skipped when it cannot be fetched."""
    from tests.support.lws import lws_crd

    try:
        return lws_crd()
    except RuntimeError as exc:
        pytest.skip(f"the LeaderWorkerSet CRD could not be fetched: {exc}")


@pytest.fixture(scope="session")
def k8s_cluster():  # type: ignore[no-untyped-def]
    """A real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok with
    fake GPU nodes) on 127.0.0.1 for the whole session; always stopped at the end."""
    from tests.cluster import build, controlplane

    try:
        cluster = controlplane.start()
    except build.NotBuildable as reason:  # no Go, or too little disk to build the binaries
        pytest.skip(str(reason))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def pod_runner(k8s_cluster, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Runs the real commands of the pods on the control plane's runner node as local
    processes on pod IPs routed to this machine's loopback device
    (tests/cluster/pod_runner.py); at the end of the session
    every process it started is killed by PID."""
    from tests.cluster.pod_runner import PodRunner, RunnerUnavailable

    try:
        runner = PodRunner(k8s_cluster, tmp_path_factory.mktemp("pods")).start()
    except RunnerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield runner
    finally:
        runner.stop()


# ---- processes started by tests: their output is shown when a test fails ----------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, text in processes.reports_since(call.start):
            report.sections.append((title, text))


def pytest_sessionfinish(session: pytest.Session) -> None:
    processes.remove_logs()
