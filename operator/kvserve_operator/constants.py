"""Names of the operator's API and of the operator itself, written once.

The CRD (manifests/crd.yaml) spells the same names; tests/operator/test_crd.py checks
that it agrees with these.
"""

from __future__ import annotations

from typing import Final

GROUP: Final = "kvserve.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "InferenceModel"
PLURAL: Final = "inferencemodels"
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# The operator's name: the field manager of its server-side applies, and the value of
# the managed-by label on its children (the label its Deployment watch selects on).
OPERATOR_NAME: Final = "kvserve-operator"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"

# The Gateway API Inference Extension's InferencePool (GIE v1), which the operator renders
# for an InferenceModel with spec.inferencePool.enabled. Its CRD comes from GIE, not from
# this project; the operator only writes objects of it.
INFERENCE_POOL_GROUP: Final = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION: Final = "v1"
INFERENCE_POOL_API_VERSION: Final = f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}"
INFERENCE_POOL_KIND: Final = "InferencePool"
INFERENCE_POOL_PLURAL: Final = "inferencepools"
INFERENCE_POOL_CRD_NAME: Final = f"{INFERENCE_POOL_PLURAL}.{INFERENCE_POOL_GROUP}"

# The LeaderWorkerSet (sigs.k8s.io/lws) that runs a model of several pods per replica
# (spec.nodes > 1). Its CRD comes from the LWS project; the operator only writes objects
# of it, and refuses such a model while the API server does not serve it.
LWS_GROUP: Final = "leaderworkerset.x-k8s.io"
LWS_VERSION: Final = "v1"
LWS_API_VERSION: Final = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_KIND: Final = "LeaderWorkerSet"
LWS_PLURAL: Final = "leaderworkersets"
LWS_CRD_NAME: Final = f"{LWS_PLURAL}.{LWS_GROUP}"
