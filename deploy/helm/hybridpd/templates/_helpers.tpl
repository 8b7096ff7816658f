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

{{/* Where the router and Ray pods mount what the chart hands them as files. */}}
{{- define "hybridpd.keysDir" -}}/etc/hybridpd-keys{{- end -}}
{{- define "hybridpd.tlsDir" -}}/etc/hybridpd-tls{{- end -}}
{{- define "hybridpd.redisCaDir" -}}/etc/hybridpd-redis-ca{{- end -}}

{{/* The Secret whose ca.crt hybridpd trusts for Redis over TLS ("": the system CAs, or no TLS). */}}
{{- define "hybridpd.redisCaSecret" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.tls.secretName -}}
{{- else -}}
{{- .Values.redis.tls.caSecret -}}
{{- end -}}
{{- end -}}

{{/* .url with the mounted CA as redis-py's ssl_ca_certs, when there is one to trust. */}}
{{- define "hybridpd.withRedisCa" -}}
{{- if include "hybridpd.redisCaSecret" .root -}}
{{- printf "%s%sssl_ca_certs=%s/ca.crt" .url (ternary "&" "?" (contains "?" .url)) (include "hybridpd.redisCaDir" .root) -}}
{{- else -}}
{{- .url -}}
{{- end -}}
{{- end -}}

{{/* The volume of the Redis CA (mounted at hybridpd.redisCaDir), if there is one to trust. */}}
{{- define "hybridpd.redisCaVolume" -}}
{{- with include "hybridpd.redisCaSecret" . -}}
- name: redis-ca
  secret:
    secretName: {{ . }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{/* Redis URL without the password (the password travels in a Secret and env var). */}}
{{- define "hybridpd.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- $scheme := ternary "rediss" "redis" (ne .Values.redis.tls.secretName "") -}}
{{- include "hybridpd.withRedisCa" (dict "root" . "url" (printf "%s://%s/0" $scheme (include "hybridpd.redisHostPort" .))) -}}
{{- else -}}
{{- include "hybridpd.withRedisCa" (dict "root" . "url" .Values.redis.externalUrl) -}}
{{- end -}}
{{- end -}}

{{- define "hybridpd.redisReplicaUrl" -}}
{{- if .Values.redis.replicaUrl -}}
{{- include "hybridpd.withRedisCa" (dict "root" . "url" .Values.redis.replicaUrl) -}}
{{- end -}}
{{- end -}}

{{/*
A Redis URL with the password from the env var REDIS_PASSWORD spliced in (Kubernetes
expands $(REDIS_PASSWORD)): after the ACL user of rediss://user@host, else as the
default user's, redis://:password@host.
*/}}
{{- define "hybridpd.withRedisPassword" -}}
{{- if regexMatch "^rediss?://[^:@/?#]+@" . -}}
{{- regexReplaceAll "^(rediss?://[^:@/?#]+)@" . "${1}:$$(REDIS_PASSWORD)@" -}}
{{- else -}}
{{- regexReplaceAll "^(rediss?://)" . "${1}:$$(REDIS_PASSWORD)@" -}}
{{- end -}}
{{- end -}}

{{- define "hybridpd.redisSecretName" -}}
{{- default (printf "%s-redis" (include "hybridpd.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* The Secret with the key files: the chart's, or auth.existingSecret. */}}
{{- define "hybridpd.keysSecretName" -}}
{{- default (printf "%s-keys" (include "hybridpd.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* "true" when the router mounts a keys Secret: API keys, or operator keys of an anonymous API. */}}
{{- define "hybridpd.mountKeys" -}}
{{- $a := .Values.auth -}}
{{- if or (not $a.allowAnonymous) $a.existingSecret (and $a.operatorKeys $a.operatorKeysSecretKey) -}}true{{- end -}}
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
from its Secret (env overrides the config file, see hybridpd/config.py).
*/}}
{{- define "hybridpd.secretEnv" -}}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "hybridpd.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
- name: HYBRIDPD_REDIS_URL
  value: {{ include "hybridpd.withRedisPassword" (include "hybridpd.redisUrl" .) | quote }}
{{- if .Values.redis.replicaUrl }}
- name: HYBRIDPD_REDIS_REPLICA_URL
  value: {{ include "hybridpd.withRedisPassword" (include "hybridpd.redisReplicaUrl" .) | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "hybridpd.configChecksum" -}}
{{- include (print $.Template.BasePath "/configmap.yaml") . | sha256sum -}}
{{- end -}}

{{/*
A container's securityContext: the shared `securityContext` with the component's keys (.override)
replacing its own (a plain key-by-key replace: sprig's merge functions skip false values).
*/}}
{{- define "hybridpd.securityContext" -}}
{{- $sc := deepCopy .root.Values.securityContext -}}
{{- range $k, $v := (default dict .override) -}}
{{- $_ := set $sc $k $v -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* HOME of the hybridpd image's user (Dockerfile): an emptyDir, as /tmp is, for the caches written there. */}}
{{- define "hybridpd.homeDir" -}}/home/ray{{- end -}}

{{/* The mounts and volumes of what a hybridpd container writes: the root filesystem may be read-only. */}}
{{- define "hybridpd.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ include "hybridpd.homeDir" . }}
{{- end -}}

{{- define "hybridpd.writableVolumes" -}}
# /tmp (Ray's /tmp/ray, hybridpd up's workdir, torch's caches) and HOME (model and compile caches)
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end -}}

{{/*
A PodDisruptionBudget over pods a RayCluster owns: .root, .name, .component, .budget (enabled,
maxUnavailable), .replicas, .labels (the ray.io labels KubeRay gives the pods, besides ray.io/cluster).
A RayCluster has no scale subresource, so the budget states an integer minAvailable (the only form
Kubernetes honours for such pods): replicas - maxUnavailable.
*/}}
{{- define "hybridpd.rayBudget" -}}
{{- if .budget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "hybridpd.rayClusterName" .root }}-{{ .name }}
  labels:
    {{- include "hybridpd.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  minAvailable: {{ max 0 (sub (int .replicas) (int .budget.maxUnavailable)) }}
  selector:
    matchLabels:
      ray.io/cluster: {{ include "hybridpd.rayClusterName" .root }}
      {{- toYaml .labels | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget over the pods of a Deployment or StatefulSet: .root, .name, .component, .budget. */}}
{{- define "hybridpd.budget" -}}
{{- if .budget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "hybridpd.fullname" .root }}-{{ .name }}
  labels:
    {{- include "hybridpd.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  maxUnavailable: {{ .budget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "hybridpd.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* The Secret holding Ray's auth token. */}}
{{- define "hybridpd.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "hybridpd.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}

{{/* Ray token auth for a container that runs Ray (the head, the workers, the router joining them). */}}
{{- define "hybridpd.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "hybridpd.rayTokenSecretName" . }}
      key: {{ .Values.ray.auth.secretKey }}
{{- end -}}

{{/* The deployment key (integrity_key_file): tags of store objects, handoffs and token frames. */}}
{{- define "hybridpd.integrityDir" -}}/etc/hybridpd-integrity{{- end -}}

{{- define "hybridpd.integritySecretName" -}}
{{- default (printf "%s-integrity" (include "hybridpd.fullname" .)) .Values.integrity.existingSecret -}}
{{- end -}}

{{/* The key's mount and volume: the router and every Ray pod read the same file (actors get its path in the config). */}}
{{- define "hybridpd.integrityMount" -}}
- name: integrity
  mountPath: {{ include "hybridpd.integrityDir" . }}
  readOnly: true
{{- end -}}

{{- define "hybridpd.integrityVolume" -}}
- name: integrity
  secret:
    secretName: {{ include "hybridpd.integritySecretName" . }}
    items:
      - key: {{ .Values.integrity.secretKey }}
        path: {{ .Values.integrity.secretKey }}
{{- end -}}
