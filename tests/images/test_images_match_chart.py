"""The built images have what the Helm chart and the operator's renderers assume of them:
the user the pods run as, the ports they declare, the programs their commands start (on
the image's PATH), HOME and the working directory on the /tmp emptyDir, and the demo
model at the path the chart's example uses. Read from the built images (podman image
inspect, and commands run in them), not from the Dockerfiles."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve_operator.render import (
    GRPC_PORT,
    HTTP_PORT,
    RUN_AS,
    TMP_DIR,
    OperatorSettings,
    render_deployment,
)
from kvserve_operator.spec import parse_spec
from tests.images.containers import POD_SECURITY, inspect, run

pytestmark = [pytest.mark.images, pytest.mark.slow]

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvserve"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
DEMO_SOURCE = "file:///opt/kvserve/demo-model"
IMAGE_LINE = re.compile(
    r'image: \{\{ include "kvserve\.image" \(list \. \.Values\.images\.(\w+)\) \}\}'
)


def chart_commands() -> list[tuple[str, str, str]]:
    """(template, image key, program) of every container command in the chart."""
    found = []
    for path in sorted((CHART / "templates").rglob("*.yaml")):
        lines = path.read_text().splitlines()
        image = None
        for i, line in enumerate(lines):
            if m := IMAGE_LINE.search(line):
                image = m[1]
            elif (m := re.match(r"\s*command:\s*(.*)$", line)) and image is not None:
                inline = m[1].strip()
                first = yaml.safe_load(inline)[0] if inline else lines[i + 1].strip()[2:]
                found.append((str(path.relative_to(CHART)), image, str(first)))
    return found


def rendered_pod() -> dict[str, Any]:
    spec = parse_spec({"model": {"source": DEMO_SOURCE, "servedName": "kvserve-travel-tiny"}})
    dep = render_deployment("demo", "models", "uid", spec, OperatorSettings(), 1)
    return dep["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def in_image(ref: str, script: str) -> str:
    proc = run(ref, ["-c", script], options=[*POD_SECURITY, "--entrypoint", "/bin/sh"])
    assert proc.returncode == 0, f"{ref}: {script}: {proc.stderr}"
    return proc.stdout


def env(info: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in info["Config"]["Env"])


def test_user_ports_entrypoints_and_paths(engine_image: str, operator_image: str) -> None:
    images = {"kvserve": engine_image, "operator": operator_image}
    info = {key: inspect(ref) for key, ref in images.items()}
    pod = rendered_pod()

    # The user: the chart's and the operator's pod securityContext (runAsNonRoot needs a
    # numeric uid in the image, or it refuses to start the container).
    user = f"{RUN_AS}:{RUN_AS}"
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == RUN_AS
    chart = VALUES["podSecurityContext"]
    assert f"{chart['runAsUser']}:{chart['runAsGroup']}" == user
    for key in images:
        assert info[key]["Config"]["User"] == user, key

    # Ports: the engine's (render.py), the gateway's and the operator's (values.yaml).
    exposed = {key: set(info[key]["Config"]["ExposedPorts"]) for key in images}
    (engine,) = pod["containers"]
    assert {p["containerPort"] for p in engine["ports"]} == {HTTP_PORT, GRPC_PORT}
    assert {f"{HTTP_PORT}/tcp", f"{GRPC_PORT}/tcp", f"{VALUES['gateway']['port']}/tcp"} <= exposed[
        "kvserve"
    ]
    operator = VALUES["operator"]
    assert {f"{operator['healthPort']}/tcp", f"{operator['metricsPort']}/tcp"} <= exposed[
        "operator"
    ]

    # Entrypoints: the programs every command of the chart and of the rendered engine pod
    # starts are on the image's PATH, and the image's own entrypoint is the main one.
    assert info["kvserve"]["Config"]["Entrypoint"] == ["kvserve"]
    assert info["operator"]["Config"]["Entrypoint"] == ["kvserve-operator"]
    programs: dict[str, set[str]] = {"kvserve": set(), "operator": set()}
    commands = chart_commands()
    assert {(t, i) for t, i, _ in commands} >= {
        ("templates/operator-deployment.yaml", "operator"),
        ("templates/gateway-deployment.yaml", "kvserve"),
    }, commands
    for _, key, program in commands:
        programs[key].add(program)
    for container in [*pod["initContainers"], *pod["containers"]]:
        programs["kvserve"].add(container["command"][0])
    for key, ref in images.items():
        for program in sorted(programs[key]):
            where = in_image(ref, f"command -v {program}").strip()
            assert where.startswith("/opt/"), f"{key}: {program} is {where!r}, not the image's own"
    if "python" in programs["operator"]:
        # The chart's cleanup hook and `helm test` run Python scripts in the operator
        # image that import the Kubernetes client.
        in_image(operator_image, "python -c 'import kubernetes.client, kubernetes.config'")

    # Paths: HOME and the working directory are the pods' /tmp emptyDir (the root
    # filesystem is read-only), and the engine pod mounts /tmp there too.
    for key in images:
        assert env(info[key])["HOME"] == TMP_DIR, key
        assert info[key]["Config"]["WorkingDir"] == TMP_DIR, key
    assert {"name": "HOME", "value": TMP_DIR} in engine["env"]
    assert TMP_DIR in {m["mountPath"] for m in engine["volumeMounts"]}
    # The demo model where values.yaml's example InferenceModel and the README find it,
    # readable by the pods' user.
    assert DEMO_SOURCE in (CHART / "values.yaml").read_text()
    path = DEMO_SOURCE.removeprefix("file://")
    in_image(engine_image, f"test -r {path}/config.json && test -r {path}/model.safetensors")
