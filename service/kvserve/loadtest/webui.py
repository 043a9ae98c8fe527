"""An "SLO" tab in Locust's web UI: live goodput, attainment, TTFT and TPOT percentiles.

Locust 2.x's web UI takes extra tabs from ``template_args`` (``extendedTabs`` names the
tab, ``extendedTables`` its columns) and their rows from an ``extendedStats`` entry in the
``/stats/requests`` JSON it polls every couple of seconds; this module adds all three (the
mechanism of Locust's ``examples/extend_web_ui.py``). The same rows are served as JSON at
``/kvserve/slo`` and as CSV at ``/kvserve/slo.csv`` (linked from the download tab).
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from kvserve.loadtest.run import LoadTestRun

TAB_KEY = "kvserve-slo"
COLUMNS = (
    ("metric", "Metric"),
    ("recent", "Last 30 s (requests done)"),
    ("run", "Whole run"),
    ("target", "SLO target"),
)


def install(web_ui: Any, run: LoadTestRun) -> None:
    """Register the tab, its data and the two routes on Locust's ``WebUI``."""
    from flask import Response, request

    web_ui.template_args["extendedTabs"] = [{"title": "SLO", "key": TAB_KEY}]
    web_ui.template_args["extendedTables"] = [
        {"key": TAB_KEY, "structure": [{"key": k, "title": t} for k, t in COLUMNS]}
    ]
    web_ui.template_args["extendedCsvFiles"] = [
        {"href": "/kvserve/slo.csv", "title": "Download the live SLO table (CSV)"}
    ]
    app = web_ui.app

    @app.after_request  # type: ignore[untyped-decorator]
    def add_slo_rows(response: Any) -> Any:
        if not request.path.endswith("/stats/requests") or not response.is_json:
            return response
        data = {**response.get_json(), "extendedStats": [{"key": TAB_KEY, "data": run.live_rows()}]}
        response.set_data(json.dumps(data))
        return response

    @app.route("/kvserve/slo")  # type: ignore[untyped-decorator]
    def slo_json() -> Any:
        return Response(run.live_json(), mimetype="application/json")

    @app.route("/kvserve/slo.csv")  # type: ignore[untyped-decorator]
    def slo_csv() -> Any:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=[k for k, _ in COLUMNS])
        w.writeheader()
        w.writerows(run.live_rows())
        return Response(buf.getvalue(), mimetype="text/csv")
