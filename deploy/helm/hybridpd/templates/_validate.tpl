{{/* Fail fast on values that contradict each other (values.schema.json checks each field alone). */}}
{{- define "hybridpd.validate" -}}
{{- $c := .Values.config -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.externalUrl) -}}
{{- fail "redis.enabled is false: set redis.externalUrl (redis://host:port/db) to an external Redis" -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.externalUrl -}}
{{- fail "redis.externalUrl is set while redis.enabled is true: choose one (set redis.enabled=false to use the external Redis)" -}}
{{- end -}}
{{- if and .Values.redis.cluster .Values.redis.enabled -}}
{{- fail "redis.cluster needs an external Redis Cluster: set redis.enabled=false and redis.externalUrl to any of its nodes" -}}
{{- end -}}
{{- if and .Values.redis.readReplicas .Values.redis.enabled -}}
{{- fail "redis.readReplicas needs an external Redis with replicas: set redis.enabled=false and redis.externalUrl" -}}
{{- end -}}
{{- if and .Values.redis.readReplicas (not .Values.redis.cluster) (not .Values.redis.replicaUrl) -}}
{{- fail "redis.readReplicas: set redis.replicaUrl to a replica of redis.externalUrl (or redis.cluster: a cluster names its replicas)" -}}
{{- end -}}
{{- if and .Values.redis.replicaUrl .Values.redis.cluster -}}
{{- fail "redis.replicaUrl: a Redis Cluster names its replicas itself; unset it and keep redis.readReplicas" -}}
{{- end -}}
{{- if and .Values.redis.replicaUrl (not .Values.redis.readReplicas) -}}
{{- fail "redis.replicaUrl is read only with redis.readReplicas: set that too" -}}
{{- end -}}
{{- if and .Values.redis.cluster (regexMatch "/[1-9][0-9]*([?].*)?$" .Values.redis.externalUrl) -}}
{{- fail "redis.cluster: a Redis Cluster has database 0 only; end redis.externalUrl with /0 or no database" -}}
{{- end -}}
{{- if eq .Values.ray.prefill.resource .Values.ray.decode.resource -}}
{{- fail "ray.prefill.resource and ray.decode.resource must differ (they keep prefill and decode actors apart)" -}}
{{- end -}}
{{- if and (not .Values.mooncake.enabled) (not .Values.mooncake.externalMaster) -}}
{{- fail "mooncake.enabled is false: set mooncake.externalMaster (host:port)" -}}
{{- end -}}
{{- if and .Values.mooncake.enabled .Values.mooncake.externalMaster -}}
{{- fail "mooncake.externalMaster is set while mooncake.enabled is true: choose one" -}}
{{- end -}}
{{- if ne (mod (int $c.mamba_block_size) (int $c.prefix_match_unit)) 0 -}}
{{- fail (printf "config.mamba_block_size (%d) must be a multiple of config.prefix_match_unit (%d)" (int $c.mamba_block_size) (int $c.prefix_match_unit)) -}}
{{- end -}}
{{- $gpus := or (gt (int .Values.ray.prefill.gpus) 0) (gt (int .Values.ray.decode.gpus) 0) -}}
{{- if and (eq $c.device "cuda") (or (eq (int .Values.ray.prefill.gpus) 0) (eq (int .Values.ray.decode.gpus) 0)) -}}
{{- fail "config.device is cuda: set ray.prefill.gpus and ray.decode.gpus > 0" -}}
{{- end -}}
{{- if and $gpus (ne $c.device "cuda") -}}
{{- fail "ray.prefill.gpus / ray.decode.gpus are set but config.device is cpu: set config.device=cuda (or gpus to 0)" -}}
{{- end -}}
{{- if and .Values.router.autoscaling.enabled (gt (int .Values.router.autoscaling.minReplicas) (int .Values.router.autoscaling.maxReplicas)) -}}
{{- fail (printf "router.autoscaling.minReplicas (%d) exceeds maxReplicas (%d)" (int .Values.router.autoscaling.minReplicas) (int .Values.router.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- $replicas := ternary .Values.router.autoscaling.minReplicas .Values.router.replicas .Values.router.autoscaling.enabled -}}
{{- if and .Values.router.podDisruptionBudget.enabled (ge (int .Values.router.podDisruptionBudget.minAvailable) (int $replicas)) -}}
{{- fail (printf "router.podDisruptionBudget.minAvailable (%d) must be below the router replicas (%d), or no pod could ever be evicted" (int .Values.router.podDisruptionBudget.minAvailable) (int $replicas)) -}}
{{- end -}}
{{- $a := .Values.auth -}}
{{- if and (not $a.allowAnonymous) (not $a.existingSecret) (not $a.apiKeys) -}}
{{- fail "no API keys: set auth.apiKeys (or auth.existingSecret, a Secret with the key files); auth.allowAnonymous=true serves anyone who reaches the router" -}}
{{- end -}}
{{- if and $a.allowAnonymous $a.apiKeys -}}
{{- fail "auth.allowAnonymous is true and auth.apiKeys are set: choose one (operator keys may stay)" -}}
{{- end -}}
{{- if and $a.operatorKeys (not $a.operatorKeysSecretKey) -}}
{{- fail "auth.operatorKeys are set but auth.operatorKeysSecretKey is empty: name their key in the Secret" -}}
{{- end -}}
{{- if and $a.existingSecret (or $a.apiKeys $a.operatorKeys) -}}
{{- fail "auth.existingSecret holds the keys: unset auth.apiKeys and auth.operatorKeys" -}}
{{- end -}}
{{- if and .Values.redis.tls.secretName (not .Values.redis.enabled) -}}
{{- fail "redis.tls.secretName is for the bundled Redis: give redis.externalUrl a rediss:// URL (redis.tls.caSecret for a private CA)" -}}
{{- end -}}
{{- if and .Values.redis.tls.caSecret .Values.redis.enabled -}}
{{- fail "redis.tls.caSecret is for an external Redis: the bundled one trusts the ca.crt of redis.tls.secretName" -}}
{{- end -}}
{{- if and .Values.redis.tls.caSecret (not (hasPrefix "rediss://" .Values.redis.externalUrl)) -}}
{{- fail "redis.tls.caSecret: redis.externalUrl is not a rediss:// URL" -}}
{{- end -}}
{{- if and .Values.redis.replicaUrl (ne (hasPrefix "rediss://" .Values.redis.replicaUrl) (hasPrefix "rediss://" .Values.redis.externalUrl)) -}}
{{- fail "redis.replicaUrl and redis.externalUrl must both be rediss:// (TLS) or both redis://" -}}
{{- end -}}
{{- if eq (int .Values.router.service.httpPort) (int .Values.router.service.grpcPort) -}}
{{- fail "router.service.httpPort and grpcPort must differ" -}}
{{- end -}}
{{- end -}}
