"""Shared fixtures: tiny random checkpoints built once per test session."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserve.testing.checkpoints import build_random_checkpoint
from tests.support import processes

# name → build arguments. Together they cover every supported architecture and the
# config features that change the forward pass.
CHECKPOINTS: dict[str, dict[str, object]] = {
    "llama": {"arch": "llama"},
    "llama3-tied-mqa": {
        "arch": "llama",
        "num_kv_heads": 1,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"arch": "mistral", "tokenizer": "byte_fallback"},
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"arch": "qwen3", "head_dim": 32, "num_heads": 4, "num_kv_heads": 2},
}
# Briefly trained (peaked distributions, like a real model): for dtype comparisons.
TRAINED_CHECKPOINTS: dict[str, dict[str, object]] = {
    "qwen3-trained": {"arch": "qwen3", "head_dim": 32, "train_steps": 200},
}


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


def make_prompts(tokenizer, n: int = 24, seed: int = 0) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Prompts of many lengths, some sharing a long prefix, one repeated."""
    rng = random.Random(seed)
    words = [
        "the",
        "cache",
        "keeps",
        "keys",
        "and",
        "values",
        "for",
        "every",
        "token",
        "so",
        "a",
        "new",
        "token",
        "attends",
    ]
    shared = tokenizer.encode(" ".join(rng.choice(words) for _ in range(12)))
    prompts: list[list[int]] = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text)
        prompts.append(shared + ids if i % 3 == 0 else ids)
    prompts.append(list(prompts[0]))  # an exact repeat
    return prompts


@pytest.fixture(scope="session")
def k8s_cluster():  # type: ignore[no-untyped-def]
    """A real control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok with
    fake GPU nodes) on 127.0.0.1 for the whole session; always stopped at the end."""
    from tests.cluster import build, controlplane

    if not build.go_available():
        pytest.skip(
            "Kubernetes cluster tests need Go >= 1.26 on PATH (binaries are built from the "
            "Go module proxy on first use, cached in ~/.cache/kvserve/k8s)"
        )
    cluster = controlplane.start()
    try:
        yield cluster
    finally:
        cluster.stop()


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
