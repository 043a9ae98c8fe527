"""GIE's endpoint picker (EPP) as a local process, and a client that asks it as Envoy does.

The picker is the unmodified ``cmd/epp`` of the Gateway API Inference Extension, built by
tests/cluster/build.py. It watches one InferencePool and its pods through a kubeconfig,
scrapes each Ready pod's ``/metrics`` at podIP:targetPort, and answers Envoy's external
processing (ext_proc) gRPC stream: for the request headers and then the body of an
OpenAI request it returns, with the headers' response, the chosen ``IP:port`` as the
``x-gateway-destination-endpoint`` header and as the same key under the ``envoy.lb``
dynamic metadata namespace. ``EndpointPicker.pick`` plays Envoy's side of that stream
with the ext_proc stubs of the ``xds-protos`` package.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.support.net import free_port
from tests.support.processes import LoggedProcess, start_logged
from tests.support.waiting import poll

# Where GIE puts the chosen endpoint (its pkg/epp/metadata, v1.3.0).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"

# The scorers and weights that GIE's inferencepool Helm chart configures by default
# (no latency predictor): queue length, KV-cache use and prefix affinity.
DEFAULT_PLUGINS: dict[str, Any] = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
            ],
        }
    ],
}


def _health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest{service}, encoded by hand: its one string field
    (number 1) is all there is, and no installed package ships the health stubs."""
    data = service.encode()
    assert len(data) < 128  # a one-byte length varint
    return b"\x0a" + bytes([len(data)]) + data


@dataclass
class Pick:
    """What the picker answered for one request."""

    endpoint: str | None  # the x-gateway-destination-endpoint header it set
    metadata_endpoint: str | None  # the same under the envoy.lb dynamic metadata
    body: bytes = b""  # the request body it hands back (streamed body mutation)
    status: int | None = None  # an immediate response's HTTP status (no endpoint then)


@dataclass
class EndpointPicker:
    """``epp`` for one pool, on free loopback ports, its output in a temp file."""

    binary: Path
    pool: str
    namespace: str
    env: dict[str, str]  # with KUBECONFIG: the picker's client reads it
    workdir: Path
    grpc_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: LoggedProcess | None = None
    _channel: grpc.Channel | None = None
    _health: grpc.Channel | None = None

    def start(self) -> None:
        config = self.workdir / "epp-plugins.yaml"
        config.write_text(yaml.safe_dump(DEFAULT_PLUGINS))
        args = [
            str(self.binary),
            "--pool-name", self.pool,
            "--pool-namespace", self.namespace,
            "--config-file", str(config),
            "--grpc-port", str(self.grpc_port),
            "--grpc-health-port", str(self.health_port),
            "--metrics-port", str(self.metrics_port),
            # Plain gRPC: GIE's default is TLS with a self-signed certificate, which
            # Envoy accepts unverified and Python's gRPC cannot.
            "--secure-serving=false",
            # Its metrics without a TokenReview per scrape; no OTLP collector here.
            "--metrics-endpoint-auth=false",
            "--tracing=false",
            "--enable-pprof=false",
            # Flush its per-pool gauges often (default 5 s); pod metrics are scraped
            # every 50 ms whatever this says.
            "--refresh-prometheus-metrics-interval", "500ms",
        ]  # fmt: skip
        self.proc = start_logged(args, "epp", env=self.env)
        self._channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self._health = grpc.insecure_channel(f"127.0.0.1:{self.health_port}")

    def serving(self) -> bool:
        """Its gRPC health check: SERVING once it has read the pool and listed its pods."""
        self._check_alive()
        assert self._health is not None
        check = self._health.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            reply = check(_health_request("inference-extension"), timeout=5)
        except grpc.RpcError:
            return False
        return bool(reply == b"\x08\x01")  # status = SERVING (1)

    def wait_serving(self, timeout: float = 60) -> None:
        poll("the endpoint picker's health check SERVING", self.serving, timeout=timeout)

    def pick(self, model: str, content: str | None = None, max_tokens: int = 8) -> Pick:
        """Envoy's side of one ext_proc stream: the request headers, then the whole body
        (an OpenAI chat request), then half-close; the picker answers each part."""
        self._check_alive()
        assert self._channel is not None
        body = json.dumps(
            {
                "model": model,
                # A fresh prompt per call unless given, so that the prefix scorer has no
                # affinity to any pod.
                "messages": [{"role": "user", "content": content or f"{uuid.uuid4()} hello"}],
                "max_tokens": max_tokens,
            }
        ).encode()
        headers = {
            ":method": "POST",
            ":path": "/v1/chat/completions",
            ":authority": "inference-gateway",
            ":scheme": "http",
            "content-type": "application/json",
            "content-length": str(len(body)),
            "x-request-id": str(uuid.uuid4()),
        }
        messages = [
            ext_proc.ProcessingRequest(
                request_headers=ext_proc.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[
                            base_pb2.HeaderValue(key=k, raw_value=v.encode())
                            for k, v in headers.items()
                        ]
                    ),
                    end_of_stream=False,
                )
            ),
            ext_proc.ProcessingRequest(
                request_body=ext_proc.HttpBody(body=body, end_of_stream=True)
            ),
        ]
        stub = ext_proc_grpc.ExternalProcessorStub(self._channel)
        pick = Pick(endpoint=None, metadata_endpoint=None)
        for resp in stub.Process(iter(messages), timeout=30):
            kind = resp.WhichOneof("response")
            if kind == "immediate_response":
                pick.status = int(resp.immediate_response.status.code)
            elif kind == "request_headers":
                for option in resp.request_headers.response.header_mutation.set_headers:
                    if option.header.key == DESTINATION_HEADER:
                        pick.endpoint = option.header.raw_value.decode()
                lb = resp.dynamic_metadata.fields.get(DESTINATION_NAMESPACE)
                if lb is not None:
                    value = lb.struct_value.fields.get(DESTINATION_HEADER)
                    pick.metadata_endpoint = value.string_value if value is not None else None
            elif kind == "request_body":
                streamed = resp.request_body.response.body_mutation.streamed_response
                pick.body += streamed.body
        return pick

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Its own /metrics as {(sample name, sorted labels): value}."""
        self._check_alive()
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def queue_sizes(self) -> dict[str, float]:
        """The pods it holds now (Ready and in the pool) → the waiting-queue length it last
        read from each one's metrics (its inference_pool_per_pod_queue_size gauge)."""
        try:
            page = self.metrics()
        except httpx.TransportError:
            return {}
        return {
            # v1.3 holds one endpoint per pod and target port, named POD-rank-N.
            re.sub(r"-rank-\d+$", "", dict(labels)["model_server_pod"]): value
            for (name, labels), value in page.items()
            if name == "inference_pool_per_pod_queue_size" and dict(labels)["name"] == self.pool
        }

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the endpoint picker exited ({self.proc.returncode})")

    def stop(self) -> None:
        """SIGTERM by PID (it shuts its manager down), SIGKILL if it lingers."""
        for channel in (self._channel, self._health):
            if channel is not None:
                channel.close()
        self._channel = self._health = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
