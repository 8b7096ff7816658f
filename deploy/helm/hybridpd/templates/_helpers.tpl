{{/* Names, labels and addresses shared by every template. */}}

{{- define "hybridpd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hybridpd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hybridpd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hybridpd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "hybridpd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "hybridpd.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: hybridpd
{{- end -}}

{{- define "hybridpd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "hybridpd.rayClusterName" -}}
{{- printf "%s-ray" (include "hybridpd.fullname" .) -}}
{{- end -}}

{{/* KubeRay names the head Service <cluster>-head-svc. */}}
{{- define "hybridpd.rayHeadService" -}}
{{- printf "%s-head-svc" (include "hybridpd.rayClusterName" .) -}}
{{- end -}}

{{- define "hybridpd.redisHostPort" -}}
{{- printf "%s-redis:%d" (include "hybridpd.fullname" .) (int .Values.redis.port) -}}
{{- end -}}

{{/* Redis URL without the password (the password travels in a Secret and env var). */}}
{{- define "hybridpd.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s/0" (include "hybridpd.redisHostPort" .) -}}
{{- else -}}
{{- .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "hybridpd.redisSecretName" -}}
{{- default (printf "%s-redis" (include "hybridpd.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "hybridpd.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "hybridpd.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{- define "hybridpd.mooncakeMaster" -}}
{{- if .Values.mooncake.enabled -}}
{{- printf "%s-mooncake:%d" (include "hybridpd.fullname" .) (int .Values.mooncake.rpcPort) -}}
{{- else -}}
{{- .Values.mooncake.externalMaster -}}
{{- end -}}
{{- end -}}

{{- define "hybridpd.mooncakeMetadataUrl" -}}
{{- if .Values.mooncake.enabled -}}
{{- printf "http://%s-mooncake:%d/metadata" (include "hybridpd.fullname" .) (int .Values.mooncake.metadataPort) -}}
{{- else if .Values.mooncake.externalMetadataUrl -}}
{{- .Values.mooncake.externalMetadataUrl -}}
{{- else -}}
{{- printf "http://%s:8080/metadata" (regexReplaceAll ":[0-9]+$" .Values.mooncake.externalMaster "") -}}
{{- end -}}
{{- end -}}

{{/*
The environment every hybridpd process needs: the Redis URL with the password
from its Secret (env overrides the config file, see hybridpd/config.py) and
the API keys.
*/}}
{{- define "hybridpd.secretEnv" -}}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "hybridpd.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
- name: HYBRIDPD_REDIS_URL
  value: {{ include "hybridpd.redisUrl" . | replace "redis://" "redis://:$(REDIS_PASSWORD)@" | replace "rediss://" "rediss://:$(REDIS_PASSWORD)@" | quote }}
{{- if .Values.redis.replicaUrl }}
- name: HYBRIDPD_REDIS_REPLICA_URL
  value: {{ .Values.redis.replicaUrl | replace "redis://" "redis://:$(REDIS_PASSWORD)@" | replace "rediss://" "rediss://:$(REDIS_PASSWORD)@" | quote }}
{{- end }}
{{- end }}
{{- if .Values.apiKeys.enabled }}
- name: HYBRIDPD_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ include "hybridpd.apiKeysSecretName" . }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- end -}}

{{- define "hybridpd.configChecksum" -}}
{{- include (print $.Template.BasePath "/configmap.yaml") . | sha256sum -}}
{{- end -}}
