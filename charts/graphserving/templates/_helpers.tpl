{{/* Names: "<release>-<chart>" unless the release name already contains the chart name. */}}
{{- define "graphserving.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "graphserving.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "graphserving.operatorName" -}}
{{- printf "%s-operator" (include "graphserving.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "graphserving.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The recommended app.kubernetes.io labels. */}}
{{- define "graphserving.labels" -}}
helm.sh/chart: {{ include "graphserving.chart" . }}
app.kubernetes.io/name: {{ include "graphserving.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: graphserving
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "graphserving.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "graphserving.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "graphserving.operatorLabels" -}}
{{ include "graphserving.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "graphserving.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "graphserving.operatorName" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "graphserving.leaseName" -}}
{{- default (include "graphserving.operatorName" .) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{/* image reference: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "graphserving.image" -}}
{{- $image := .image -}}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .appVersion $image.tag) }}
{{- end }}
{{- end }}

{{- define "graphserving.operatorImage" -}}
{{- include "graphserving.image" (dict "image" .Values.operator.image "appVersion" .Chart.AppVersion) }}
{{- end }}

{{- define "graphserving.testImage" -}}
{{- if .Values.test.image.repository }}
{{- printf "%s:%s" .Values.test.image.repository (default .Chart.AppVersion .Values.test.image.tag) }}
{{- else }}
{{- include "graphserving.operatorImage" . }}
{{- end }}
{{- end }}

{{- define "graphserving.testNamespace" -}}
{{- default .Release.Namespace .Values.test.graphServing.namespace }}
{{- end }}

{{/*
The operator's namespaced permissions (mirrors manifests/rbac/operator.yaml): rendered into one
ClusterRole when it watches every namespace, or into a Role per watched namespace.
*/}}
{{- define "graphserving.operatorRules" -}}
# The API it serves.
- apiGroups: ["graphserving.io"]
  resources: ["graphservings"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["graphserving.io"]
  resources: ["graphservings/status"]
  verbs: ["get", "patch", "update"]
# Children (server-side apply = patch; create for the first apply).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# A worker's capacity counts once its revision Service's EndpointSlices list it.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list"]
# Worker pods: read reports, set the graphs-ready condition, record accepted reports.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# The workers' identity in each GraphServing namespace (ServiceAccount, Role, RoleBinding).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
# Planner histograms for autoCaptureSizes.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Cluster-scoped reads kopf needs in any mode: CRD discovery and namespace watching. */}}
{{- define "graphserving.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}
