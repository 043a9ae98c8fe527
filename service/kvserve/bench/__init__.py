"""Benchmarks: commands that print figures measured side by side in one run.

A small harness: ``launcher`` (replica, stub-replica and gateway processes, configured by
a ``LaunchSettings``, and their /metrics), ``processes`` (child processes), ``cpu`` (CPU
time and placement), ``sse_client`` (the one streaming client), ``timelines`` (workloads,
greedy requests, a closed loop on the engine's step API, latency figures), ``results``
(tables, progress messages) and ``suite.SuiteContext`` (checkpoints, engines, alternating
rounds). Sections use it through public names only: ``suite`` and its sections
(``engine_vs_transformers``, ``batching``, ``prefix_caching``, ``roofline``,
``kv_memory``, ``serving_path``, ``structured``), and the commands ``offline``,
``serving``, ``gateway`` (with its phases ``gateway_overhead``, ``gateway_capacity`` and
``gateway_routing``, and ``stub_replica``) and ``attacks``.
"""
