"""The gateway's app does not load torch: a gateway process needs none of the engine."""

from __future__ import annotations

from tests.fresh_python import heavy_modules_after


def test_the_gateway_app_imports_without_torch() -> None:
    assert heavy_modules_after("import kvserve.gateway.app", {"torch", "transformers"}) == set()
