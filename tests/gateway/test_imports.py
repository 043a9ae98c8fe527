"""The gateway's app does not load torch: a gateway process needs none of the engine."""

from __future__ import annotations

from tests.support.fresh_python import heavy_modules_after


def test_the_gateway_app_imports_without_torch() -> None:
    assert heavy_modules_after("import kvserve.gateway.app", {"torch", "transformers"}) == set()


def test_the_gateway_imports_nothing_of_the_engine_server() -> None:
    """The OpenAI kit (kvserve.openai) and the gRPC codec (kvserve.rpc) are shared; the
    engine server's own package is not the gateway's business."""
    code = "import kvserve.gateway.app, kvserve.gateway.main"
    assert heavy_modules_after(code, {"kvserve.server", "kvserve.engine"}) == set()
