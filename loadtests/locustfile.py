"""Locust load test for kvserve's OpenAI API (engine server or gateway), measuring SLO goodput.

    locust -f loadtests/locustfile.py --headless -H http://127.0.0.1:8000 -u 8 -r 8 -t 60s \\
        --workload chat --slo-ttft-ms 1000 --slo-tpot-ms 100 --slo-attainment 0.9

See loadtests/README.md. This file is only the Locust glue: users, the load shape, the
options, the events and the web UI tab; the logic (workloads, SSE timing, records, the
report) lives in ``kvserve.loadtest`` where it is typed and unit-tested.

* Users: ``ClosedLoopUser`` (one request at a time, the next when the last is done) and
  ``PoissonArrivals`` (open loop: one dispatcher starts a request at each arrival of a
  Poisson process at ``--rate``, never waiting for responses, so an overloaded server shows
  up as growing latency, not as fewer requests).
* ``KvserveShape`` picks them: ``--load-shape constant`` (``-u`` users), ``step`` (a step
  ramp) or ``poisson``.
* Per request, custom events ``TTFT``, ``TPOT``, ``ITL`` (one per gap) and ``E2E`` with
  float milliseconds: they appear in Locust's tables and CSVs next to the ``POST`` entries
  (whose response time only covers the response headers of a stream).
* At the end: the report (stderr), ``records.jsonl``, ``summary.json``/``.csv`` and PNGs in
  ``--out-dir``; exit code 1 when the SLO attainment is below ``--slo-attainment``.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from typing import Any

import gevent
from gevent.pool import Group
from locust import HttpUser, LoadTestShape, User, constant, events, task
from locust.env import Environment
from locust.runners import STATE_CLEANUP, STATE_INIT, STATE_STOPPED, STATE_STOPPING
from locust.stats import CSV_STATS_INTERVAL_SEC
from requests.adapters import HTTPAdapter

from kvserve.loadtest import webui
from kvserve.loadtest.client import stream_request
from kvserve.loadtest.options import DEFAULT_STOP_TIMEOUT_S, Settings, add_options
from kvserve.loadtest.records import RequestRecord, round_us
from kvserve.loadtest.run import LoadTestRun, timing_events

RUN: LoadTestRun | None = None
_USER_NUMBERS = itertools.count(1)


def _run() -> LoadTestRun:
    if RUN is None:
        raise RuntimeError("kvserve load test not initialised (no init event)")
    return RUN


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def _add_options(parser: Any) -> None:
    add_options(parser.add_argument, locust=True)


@events.init.add_listener  # type: ignore[untyped-decorator]
def _init(environment: Environment, **_: Any) -> None:
    global RUN
    opts = environment.parsed_options
    if opts is not None and (opts.master or opts.worker or (opts.processes or 1) != 1):
        # Records and the report live in one process. For more load than one process
        # drives, run several with their own --out-dir and --seed, then `kvserve report`
        # all their records.jsonl together (see loadtests/README.md).
        raise SystemExit(
            "kvserve load test: error: --master/--worker/--processes are not supported; "
            "run separate Locust processes and combine their records with kvserve report"
        )
    try:
        RUN = LoadTestRun(Settings.from_namespace(opts))
    except ValueError as exc:
        raise SystemExit(f"kvserve load test: error: {exc}") from exc
    # Wait for requests in flight when the run ends (a closed cohort), unless told otherwise.
    if not environment.stop_timeout:
        environment.stop_timeout = DEFAULT_STOP_TIMEOUT_S
    if environment.web_ui is not None:
        webui.install(environment.web_ui, RUN)


@events.test_start.add_listener  # type: ignore[untyped-decorator]
def _test_start(environment: Environment, **_: Any) -> None:
    run = _run()
    try:
        run.settings = Settings.from_namespace(environment.parsed_options)  # web UI may edit
        run.start(environment.host or "")
    except Exception as exc:
        # The users idle and the shape's next tick ends the test (KvserveShape.tick). Ending
        # it from here raced Locust's own end of a shape test: both stopped the same users,
        # and Locust printed a greenlet traceback per user under this error.
        run.workload = None
        print(f"kvserve load test: error: {exc}", file=sys.stderr)
        environment.process_exit_code = 2


@events.test_stop.add_listener  # type: ignore[untyped-decorator]
def _test_stop(environment: Environment, **_: Any) -> None:
    run = _run()
    if run.workload is None:
        return
    if getattr(environment.parsed_options, "csv_prefix", None):
        # Locust rewrites its CSVs every second and not again at exit: let it see the last
        # requests before the report below blocks the event loop.
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)
    users = getattr(environment.runner, "final_user_classes_count", None) or {}
    run.finish({"users": {k: v for k, v in users.items() if v}})
    if run.exit_code is not None:
        environment.process_exit_code = run.exit_code


class _LoadTestUser(HttpUser):
    abstract = True
    user_name = "user"


def _send(user: _LoadTestUser) -> RequestRecord:
    """One request of the workload, recorded, with the custom timing events fired."""
    run = _run()
    s = run.settings
    spec = run.next_spec()

    def post(path: str, body: dict[str, Any]) -> Any:
        return user.client.post(
            path,
            json=body,
            headers=s.headers(),
            name=f"{path} [{spec.scenario}]",
            stream=True,
            catch_response=True,
            timeout=(30, s.request_timeout),
        )

    def mark(response: Any, status: str, error: str | None) -> None:
        if status == "error":
            response.failure(error or "error")
        else:
            response.success()  # a planned cancellation is not a failure

    def sink(rec: RequestRecord) -> None:
        run.add(rec)
        for request_type, name, ms, length in timing_events(rec):
            events.request.fire(
                request_type=request_type,
                name=name,
                response_time=ms,
                response_length=length,
                exception=None,
                context={},
            )

    return stream_request(
        post, spec, run.model, extra_body=s.extra_body(), user=user.user_name, mark=mark, sink=sink
    )


class ClosedLoopUser(_LoadTestUser):
    """One request at a time; the next one when the last is done (plus --think-time)."""

    wait_time = constant(0)
    user_name = "closed"

    def on_start(self) -> None:
        self.user_name = f"closed-{next(_USER_NUMBERS)}"
        self.think = _run().settings.think_time

    @task
    def request(self) -> None:
        if _run().workload is None:  # the test did not start (the error is printed)
            gevent.sleep(0.5)
            return
        _send(self)
        if self.think:
            gevent.sleep(self.think)


class PoissonArrivals(_LoadTestUser):
    """Open loop: requests start at the arrivals of a Poisson process at --rate per second.

    Arrival times are drawn ahead (exponential gaps, seeded) and slept to, so the rate holds
    however long the responses take; each arrival runs in its own greenlet. At the end the
    dispatcher waits for the requests in flight (the run's --stop-timeout bounds it).
    """

    fixed_count = 1
    wait_time = constant(0)
    user_name = "poisson"

    def on_start(self) -> None:
        self.outstanding = Group()
        s = _run().settings
        self.rng = random.Random(f"kvserve-loadtest-arrivals:{s.seed}")
        self.next_at = time.perf_counter()
        # One connection per request in flight (requests' pool would otherwise drop them).
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=s.max_outstanding)
        self.client.mount("http://", adapter)
        self.client.mount("https://", adapter)

    @task
    def arrive(self) -> None:
        run = _run()
        s = run.settings
        if run.workload is None:  # the test did not start (the error is printed)
            gevent.sleep(0.5)
            return
        self.next_at += self.rng.expovariate(s.rate)
        while (wait := self.next_at - time.perf_counter()) > 0:
            if self._stopping():
                return  # the run ended before this arrival: it is not part of the cohort
            gevent.sleep(min(wait, 0.25))
        if self._stopping():
            return
        if len(self.outstanding) >= s.max_outstanding:
            spec = run.next_spec()
            run.add(
                RequestRecord(
                    send_time=round_us(time.time()),
                    status="error",
                    end_s=0.0,
                    api=spec.api,
                    scenario=spec.scenario,
                    max_tokens=spec.max_tokens,
                    error=f"not sent: {s.max_outstanding} requests already in flight "
                    "(--max-outstanding)",
                    user=self.user_name,
                )
            )
            return
        self.outstanding.spawn(_send, self)

    def _stopping(self) -> bool:
        runner = self.environment.runner
        return runner is not None and runner.state in (STATE_CLEANUP, STATE_STOPPING, STATE_STOPPED)

    def on_stop(self) -> None:
        try:
            self.outstanding.join()
        except BaseException:
            self.outstanding.kill()  # each request records itself as interrupted
            raise


class KvserveShape(LoadTestShape):
    """--load-shape: constant users, a step ramp, or Poisson arrivals; honours -t."""

    use_common_options = True

    def tick(self) -> tuple[int, float, list[type[User]] | None] | None:
        assert self.runner is not None
        opts = self.runner.environment.parsed_options
        assert opts is not None
        run = _run()
        if run.workload is None and self.runner.state != STATE_INIT:
            return None  # test_start has run (the state left INIT) and failed: stop
        s = run.settings
        elapsed = self.get_run_time()
        if opts.run_time and elapsed >= opts.run_time:
            return None
        if s.load_shape == "poisson":
            return 1, 1.0, [PoissonArrivals]
        if s.load_shape == "step":
            step = int(elapsed // s.step_seconds)
            if step >= s.steps:
                return None
            users = s.step_users * (step + 1)
            return users, float(users), [ClosedLoopUser]
        users = int(opts.num_users or 1)
        return users, float(opts.spawn_rate or users), [ClosedLoopUser]
