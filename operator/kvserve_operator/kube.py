"""The few Kubernetes API calls the operator makes, on plain dicts.

Server-side apply needs the ``application/apply-patch+yaml`` content type, which the
typed client methods do not choose by themselves, so every call goes through
``ApiClient.call_api`` with an explicit path. JSON is valid YAML, so bodies are JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvserve_operator.constants import (
    API_VERSION,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    KIND,
    LWS_API_VERSION,
    LWS_KIND,
    LWS_PLURAL,
    PLURAL,
)

PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    (API_VERSION, KIND): PLURAL,
    ("v1", "Pod"): "pods",
    ("v1", "ConfigMap"): "configmaps",
    (INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND): INFERENCE_POOL_PLURAL,
    (LWS_API_VERSION, LWS_KIND): LWS_PLURAL,
}


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiClient()
    if not api.configuration.verify_ssl:
        # The kubeconfig asked for insecure-skip-tls-verify; one warning per request
        # would drown the operator's own log.
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    return api


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"


class Kube:
    def __init__(self, api: client.ApiClient, field_manager: str) -> None:
        self.api = api
        self.field_manager = field_manager

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        method, url, headers, payload, post = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=payload, post_params=post, _request_timeout=30
        )
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        result: dict[str, Any] = json.loads(data) if data else {}
        return result

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply under our field manager; ``force`` takes fields back from
        anyone who changed them by hand (that is the drift we restore)."""
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self._call(
            "PATCH",
            f"{path}/{meta['name']}",
            body=obj,
            query=[("fieldManager", self.field_manager), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``kind`` (its CRD is installed), from the API
        group's discovery document, which every authenticated client may read. (A 404
        on an object cannot tell a missing CRD from a missing object.)"""
        try:
            found = self._call("GET", f"/apis/{api_version}")
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        plural = PLURALS[(api_version, kind)]
        return any(r.get("name") == plural for r in found.get("resources") or [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object; False when it was not there."""
        try:
            self._call("DELETE", f"{collection_path(api_version, kind, namespace)}/{name}")
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        result = self._call(
            "GET",
            collection_path(api_version, kind, namespace),
            query=[("labelSelector", selector)],
        )
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        path = f"{collection_path(API_VERSION, KIND, namespace)}/{name}/status"
        return self._call(
            "PATCH",
            path,
            body={"status": status},
            content_type="application/merge-patch+json",
        )
