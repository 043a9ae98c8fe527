{{/* Names ------------------------------------------------------------------------ */}}

{{- define "kvserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<release>-kvserve", or the release name when it already contains the chart name. */}}
{{- define "kvserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.operator.fullname" -}}
{{- printf "%s-operator" (include "kvserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvserve.gateway.fullname" -}}
{{- printf "%s-gateway" (include "kvserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Service of the gateway's metrics port (gateway.metricsPort). */}}
{{- define "kvserve.gateway.metricsFullname" -}}
{{- printf "%s-metrics" (include "kvserve.gateway.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvserve.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "kvserve.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}
{{- default (include "kvserve.gateway.fullname" .) .Values.gateway.serviceAccount.name -}}
{{- else -}}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.gateway.cacheSaltSecretName" -}}
{{- default (printf "%s-cache-salt" (include "kvserve.gateway.fullname" .)) .Values.gateway.cacheSaltSecret.name | trunc 253 -}}
{{- end -}}

{{- define "kvserve.gateway.keysSecretName" -}}
{{- default (printf "%s-keys" (include "kvserve.gateway.fullname" .)) .Values.gateway.keys.secretName | trunc 253 -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------- */}}

{{/* Labels of an object: (list $ COMPONENT EXTRA...). COMPONENT may be "" (none);
     each EXTRA is a map of further labels. The chart's own labels win over extras and
     commonLabels, so selectors and ownership never change; extras are merged in order
     (the first one to set a key wins). */}}
{{- define "kvserve.componentLabels" -}}
{{- $ := index . 0 -}}
{{- $labels := dict
      "helm.sh/chart" (printf "%s-%s" $.Chart.Name $.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-")
      "app.kubernetes.io/name" (include "kvserve.name" $)
      "app.kubernetes.io/instance" $.Release.Name
      "app.kubernetes.io/version" $.Chart.AppVersion
      "app.kubernetes.io/managed-by" $.Release.Service
      "app.kubernetes.io/part-of" "kvserve" -}}
{{- with index . 1 -}}
{{- $_ := set $labels "app.kubernetes.io/component" . -}}
{{- end -}}
{{- range rest (rest .) -}}
{{- $labels = merge $labels (default dict .) -}}
{{- end -}}
{{- $labels = merge $labels (default dict $.Values.commonLabels) -}}
{{- toYaml $labels -}}
{{- end -}}

{{- define "kvserve.labels" -}}
{{- include "kvserve.componentLabels" (list . "") -}}
{{- end -}}

{{/* Selector labels of one component: (list $ "operator"). */}}
{{- define "kvserve.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "kvserve.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Labels of a component's pods: (list $ COMPONENT podLabels). */}}
{{- define "kvserve.podLabels" -}}
{{- $labels := include "kvserve.selectorLabels" (list (index . 0) (index . 1)) | fromYaml -}}
{{- toYaml (merge $labels (default dict (index . 2))) -}}
{{- end -}}

{{/* The labels of the engine pods the operator creates (kvserve_operator/render.py). */}}
{{- define "kvserve.engineSelector" -}}
app.kubernetes.io/name: kvserve-engine
app.kubernetes.io/managed-by: kvserve-operator
{{- end -}}

{{/* Images: (list $ .Values.images.kvserve) → repository:tag[@digest]. */}}
{{- define "kvserve.image" -}}
{{- $ := index . 0 -}}
{{- $image := index . 1 -}}
{{- $ref := printf "%s:%s" $image.repository (default $.Chart.AppVersion $image.tag) -}}
{{- if $image.digest -}}
{{- $ref = printf "%s@%s" $ref $image.digest -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* Namespaces ------------------------------------------------------------------- */}}

{{/* The namespaces the gateway watches (JSON list; empty = all). */}}
{{- define "kvserve.gateway.namespaces" -}}
{{- if .Values.gateway.discovery.namespaces -}}
{{- toJson .Values.gateway.discovery.namespaces -}}
{{- else -}}
{{- toJson (default list .Values.operator.watchNamespaces) -}}
{{- end -}}
{{- end -}}

{{/* Pods ------------------------------------------------------------------------- */}}

{{- define "kvserve.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit | quote }}
{{- end -}}

{{/* The gateway's config file (docs/gateway-config.md): values.gateway.config plus
     the fields the chart owns (listen's host, port and metrics_port, keys_file,
     discovery). */}}
{{- define "kvserve.gateway.config" -}}
{{- $config := deepCopy .Values.gateway.config -}}
{{- $listen := deepCopy (.Values.gateway.config.listen | default dict) -}}
{{- $_ := set $listen "host" "0.0.0.0" -}}
{{- $_ := set $listen "port" (int .Values.gateway.port) -}}
{{- with .Values.gateway.metricsPort -}}
{{- if eq (int .) (int $.Values.gateway.port) -}}
{{- fail (printf "gateway.metricsPort (%d) must differ from gateway.port: /metrics gets a port of its own" (int .)) -}}
{{- end -}}
{{- $_ := set $listen "metrics_port" (int .) -}}
{{- end -}}
{{- $_ := set $config "listen" $listen -}}
{{- $_ := set $config "keys_file" "/etc/kvserve/keys/keys.yaml" -}}
{{- if .Values.gateway.discovery.enabled -}}
{{- $kubernetes := dict
      "namespaces" (include "kvserve.gateway.namespaces" . | fromJsonArray)
      "label_selector" .Values.gateway.discovery.labelSelector
      "port_name" .Values.gateway.discovery.portName -}}
{{- $_ := set $config "discovery" (dict "kubernetes" $kubernetes) -}}
{{- else if not $config.models -}}
{{- fail "gateway.discovery.enabled is false: list the engine replicas under gateway.config.models.<name>.replicas" -}}
{{- end -}}
{{- if not (hasKey $config "models") -}}
{{- $_ := set $config "models" dict -}}
{{- end -}}
# The kvserve gateway's config (docs/gateway-config.md), rendered by the kvserve chart.
{{ toYaml $config }}
{{- end -}}
