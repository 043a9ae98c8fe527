"""A worker node: ``kvserve serve`` on a node other than node 0 (``--node-rank`` ≥ 1, or
a LeaderWorkerSet worker pod).

It runs this node's ranks as worker processes and serves only ``GET /health`` and
``GET /ready`` on the HTTP port: 200 while every rank runs, 503 otherwise. It exits when
its ranks do: status 0 when node 0 stopped the group, 1 when any rank failed (then the
group is broken; the LeaderWorkerSet restarts it). SIGTERM stops the ranks.
"""

from __future__ import annotations

import http.server
import json
import logging
import signal
import threading
from types import FrameType

from kvserve.config import EngineConfig
from kvserve.parallel.launch import Launch, LocalWorkers

log = logging.getLogger(__name__)


def serve_worker_node(config: EngineConfig, launch: Launch, host: str, port: int) -> int:
    ranks = launch.node_ranks(config.tensor_parallel_size)
    lost: list[str] = []
    done = threading.Event()

    def on_lost(why: str) -> None:
        lost.append(why)
        done.set()

    workers = LocalWorkers(config, launch, ranks, config.tensor_parallel_size, on_lost)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/health", "/ready"):
                self._answer(404, {"error": "a worker node serves only /health and /ready"})
            elif workers.alive() and not lost:
                self._answer(200, {"status": "ok", "node_rank": launch.node_rank})
            else:
                self._answer(503, {"status": "ranks lost", "why": lost})

        def _answer(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # probes: no log line
            pass

    server = http.server.ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    print(
        f"worker node {launch.node_rank} of {launch.nnodes}: ranks {ranks.start}-"
        f"{ranks.stop - 1} joining {launch.master_addr}:{launch.master_port}; /health on "
        f"http://{host}:{port}",
        flush=True,
    )

    def stop(sig: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping this node's ranks", sig)
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    # Done when a rank fails, on a signal, or when every rank left (node 0 stopped them).
    def all_left() -> None:
        workers.wait()
        done.set()

    threading.Thread(target=all_left, name="ranks", daemon=True).start()
    done.wait()
    workers.terminate()
    server.shutdown()
    return 1 if lost or workers.failed() else 0
