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
