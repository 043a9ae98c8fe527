"""``kvserve gateway`` paces its refusals (``listen.refusals_per_second``): requests without
a key are answered 401 no faster than the pace, while a health probe sent meanwhile is not
held (docs/security.md, "Refusal pacing"). The command itself, so that its wiring of the
protocol and the middleware to one pacer is what is tested."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.support.gateway import gateway_command
from tests.support.net import free_port
from tests.support.processes import start_logged
from tests.support.replicas import REPLICA_MODEL
from tests.support.waiting import wait_until

INTERVAL = 2.0  # seconds between paced refusals (= the most a refusal is held)


def test_refusals_are_paced_and_a_probe_is_not_held(tmp_path: Path) -> None:
    port = free_port()
    # No replica needs to answer: every request here is refused before routing.
    argv = gateway_command(
        tmp_path,
        f"{{port: {port}, refusals_per_second: {1 / INTERVAL}}}",
        f"grpc://127.0.0.1:{free_port()}",
    )
    proc = start_logged(argv, "gateway")
    url = f"http://127.0.0.1:{port}"

    def alive() -> bool:
        assert proc.poll() is None, proc.tail()
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(alive, timeout=120)
        answered: list[tuple[float, httpx.Response]] = []

        def anonymous() -> None:
            r = httpx.post(f"{url}/v1/completions", json={"model": REPLICA_MODEL}, timeout=60)
            answered.append((time.monotonic(), r))

        threads = [threading.Thread(target=anonymous) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(answered) >= 1, timeout=60)  # the burst's one
        probe = httpx.get(f"{url}/health", timeout=60)
        probed_at = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        assert probe.status_code == 200
        assert [r.status_code for _, r in answered] == [401, 401, 401]
        assert all(r.json()["error"]["type"] == "authentication_error" for _, r in answered)
        times = sorted(at for at, _ in answered)
        assert probed_at < times[-1], "a health probe waited behind held refusals"
        # The burst's one at once, the next a turn later; the third's turn would be two
        # turns away, past the 2 s cap on holding, so it too is answered at 2 s.
        assert times[-1] - times[0] >= INTERVAL - 0.5
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stop()
