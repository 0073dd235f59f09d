{{/*
Names. Kubernetes object names that become DNS labels (Services, and the Pod hostnames derived from
Deployments) may be at most 63 characters (RFC 1123), so every name is cut to 63 and a dash left dangling
by the cut is removed.
*/}}
{{- define "squeezeserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "squeezeserve.fullname" -}}
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

{{/*
The name of one component's objects: "<fullname>-<component>", at most 63 characters for the same DNS
reason. The full name is cut, never the component suffix: cutting the joined string would give the gateway
and the worker of a long release name the same name.
*/}}
{{- define "squeezeserve.componentName" -}}
{{- $room := sub 62 (len .component) | int }}
{{- printf "%s-%s" (include "squeezeserve.fullname" .ctx | trunc $room | trimSuffix "-") .component }}
{{- end }}

{{- define "squeezeserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: the few labels that identify a component's Pods. They are immutable on a Deployment, so
they never carry versions or user labels (a chart upgrade would otherwise fail on the selector).
Call with (dict "ctx" $ "component" "gateway").
*/}}
{{- define "squeezeserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "squeezeserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels: the selector labels plus version, manager and the user's commonLabels. */}}
{{- define "squeezeserve.labels" -}}
helm.sh/chart: {{ include "squeezeserve.chart" .ctx }}
{{ include "squeezeserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: squeezeserve
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* "repository:tag", the tag defaulting to the chart's appVersion (never a floating tag). */}}
{{- define "squeezeserve.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "squeezeserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "squeezeserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The worker Service's in-cluster URL: how the gateway (and the validation job) find the workers. */}}
{{- define "squeezeserve.workerUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "squeezeserve.componentName" (dict "ctx" . "component" "worker")) .Release.Namespace (int .Values.worker.port) }}
{{- end }}

{{- /* The gateway's upstream for this release's workers: the Service while there is one replica; above
one, every Pod behind the headless Service (the gateway resolves it again before each health round). */ -}}
{{- define "squeezeserve.workerUpstream" -}}
{{- if gt (int .Values.worker.replicaCount) 1 -}}
{{- printf "dns+http://%s.%s.svc:%d" (include "squeezeserve.componentName" (dict "ctx" . "component" "worker-pods")) .Release.Namespace (int .Values.worker.port) }}
{{- else -}}
{{- include "squeezeserve.workerUrl" . }}
{{- end }}
{{- end }}

{{- define "squeezeserve.gatewayUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "squeezeserve.componentName" (dict "ctx" . "component" "gateway")) .Release.Namespace (int .Values.gateway.service.port) }}
{{- end }}

{{- define "squeezeserve.apiKeySecretName" -}}
{{- default (include "squeezeserve.componentName" (dict "ctx" . "component" "api-keys")) .Values.gateway.apiKeys.existingSecret }}
{{- end }}

{{/* The served model name: explicit, or the last path element of the model directory (the CLI's rule). */}}
{{- define "squeezeserve.servedModelName" -}}
{{- $engine := index .Values.worker .Values.worker.engine }}
{{- default (base $engine.model) .Values.worker.servedModelName }}
{{- end }}

{{/* Pod and container hardening shared by every component. */}}
{{- define "squeezeserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "squeezeserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end }}
