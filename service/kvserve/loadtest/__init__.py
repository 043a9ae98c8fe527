"""Locust load tests that measure SLO goodput (docs/architecture.md §3), and their reports.

``loadtests/locustfile.py`` is the Locust glue; this package holds what it uses:
:mod:`~kvserve.loadtest.workloads` (seeded request mixes),
:mod:`~kvserve.loadtest.client` (one streamed request, timed),
:mod:`~kvserve.loadtest.records` (the versioned JSONL record),
:mod:`~kvserve.loadtest.report` (goodput, attainment, percentiles via
``kvserve.telemetry.definitions``), :mod:`~kvserve.loadtest.plots`,
:mod:`~kvserve.loadtest.sweep` (max goodput rate) and :mod:`~kvserve.loadtest.cli`.
"""
