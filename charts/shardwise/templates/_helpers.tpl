{{/*
Names and labels shared by every template.
Every object carries the app.kubernetes.io/* labels; `component` tells the operator's pods (operator), its
metrics endpoint (metrics) and its admission webhook (webhook) apart.
*/}}

{{/* The chart name, overridable with nameOverride. */}}
{{- define "shardwise.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release-qualified name of the objects. The release name alone when it already contains the chart name
(release "shardwise" -> "shardwise", not "shardwise-shardwise"). Truncated to 63 characters less room for the
longest suffix ("-metrics", "-webhook-tls", "-leader"), so that every derived name stays a valid DNS label.
*/}}
{{- define "shardwise.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 51 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 51 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 51 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* name-version, the value of helm.sh/chart. */}}
{{- define "shardwise.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The labels of every object. Call with a dict: (dict "ctx" $ "component" "operator").
*/}}
{{- define "shardwise.labels" -}}
helm.sh/chart: {{ include "shardwise.chart" .ctx }}
{{ include "shardwise.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: shardwise
{{- end }}

{{/*
The immutable subset used in selectors (a Deployment's selector cannot change on upgrade, so no version here).
Call with a dict: (dict "ctx" $ "component" "operator").
*/}}
{{- define "shardwise.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardwise.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "shardwise.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shardwise.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator's image; the tag defaults to the chart's appVersion. */}}
{{- define "shardwise.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/* The image of the worker pods' node agent; each empty part falls back to the operator's image. */}}
{{- define "shardwise.agentImage" -}}
{{- $repo := .Values.agentImage.repository | default .Values.image.repository }}
{{- $tag := .Values.agentImage.tag | default .Values.image.tag | default .Chart.AppVersion | toString }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* The webhook's Service: the name the serving certificate is issued for. */}}
{{- define "shardwise.webhookServiceName" -}}
{{- printf "%s-webhook" (include "shardwise.fullname" .) }}
{{- end }}

{{/* The Secret the webhook server reads tls.crt and tls.key from. */}}
{{- define "shardwise.webhookSecretName" -}}
{{- if eq .Values.webhook.certificate.mode "secret" }}
{{- required "webhook.certificate.mode=secret needs webhook.certificate.secret.name (a kubernetes.io/tls Secret in the release namespace)" .Values.webhook.certificate.secret.name }}
{{- else }}
{{- printf "%s-webhook-tls" (include "shardwise.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Lease the operator replicas elect their leader on. */}}
{{- define "shardwise.leaseName" -}}
{{- printf "%s-leader" (include "shardwise.fullname" .) }}
{{- end }}

{{/* Fails the render on a certificate mode the chart does not know. */}}
{{- define "shardwise.validateWebhookMode" -}}
{{- $modes := list "helm" "certManager" "secret" }}
{{- if not (has .Values.webhook.certificate.mode $modes) }}
{{- fail (printf "webhook.certificate.mode must be one of helm, certManager, secret; got %q" .Values.webhook.certificate.mode) }}
{{- end }}
{{- end }}
