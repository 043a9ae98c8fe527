"""The device the engine-equivalence tests run on: ``cpu`` unless ``KVSERVE_TEST_DEVICE``
names another (``cuda``). CI has no GPU; scripts/cuda-check.sh runs these tests on one
(docs/performance.md, "On a GPU")."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")
