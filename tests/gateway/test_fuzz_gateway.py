"""Schema-driven fuzzing of the gateway, with a real replica behind it: whatever a client
with a valid key sends, the gateway never answers 5xx, and every 4xx is an OpenAI error
object (out-of-range integers used to reach the proto builder and come back as 500s).

The replica has a small context (96 tokens), so an accepted request is short and a large
``max_tokens`` must be refused with a 4xx. The gateway serves its API description for
the fuzzer (``serve_api_docs``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis

from tests.support.gateway import KEY_A, Gateway, start_gateway
from tests.support.openapi_fuzz import fuzz_operation
from tests.support.replicas import REPLICA_MODEL, Replica, start_replicas

MAX_EXAMPLES = 30
OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
]


@pytest.fixture(scope="module")
def short_replica(model_dir: Path) -> Iterator[Replica]:
    (rep,) = start_replicas(model_dir, 1, "--max-model-len", "96")
    yield rep
    rep.stop()


@pytest.fixture(scope="module")
def fuzz_gateway(short_replica: Replica) -> Iterator[Gateway]:
    gw = start_gateway([short_replica], serve_api_docs=True)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_gateway: Gateway) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_gateway.url}/openapi.json", timeout=30)


def test_the_schema_publishes_the_fuzzed_api_operations(api_schema: Any) -> None:
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert set(OPERATIONS) <= labels


@pytest.mark.slow
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_errors_and_openai_errors(
    label: str, api_schema: Any, fuzz_gateway: Gateway
) -> None:
    headers = {"authorization": f"Bearer {KEY_A}"}
    fuzz_operation(api_schema, label, fuzz_gateway.url, REPLICA_MODEL, MAX_EXAMPLES, headers)
